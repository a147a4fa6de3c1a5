"""How fast the host ran while a window was timed: a reference launch workload, the threads' CPU and wait
time, and the machine's stolen time.

Why: a host-bound step is as long as the host work that issues it, and the host's speed is not constant. On
one H200 virtual machine (16 vCPUs), DDP on GPT-2 124M at micro-batch 1 (device busy 22-27% of the step)
ran whole processes at 33-55 ms a step (CV 10-18% across processes), while the windows within one process
agreed far better. A figure that divides the step's host time by the time the same host takes, in the same
process and minutes, for a fixed piece of the same kind of work cancels that speed, the way cycles per step
cancel a GPU clock that moved.

* `reference_s(ctx)`: the host time to issue REF_LAUNCHES tiny kernels through Python, the dispatcher and the
  CUDA launch path (CPU ops on CPU), best of a few repeats: the training loop's own kind of host work.
* `ThreadTimes`: per thread of this process, CPU time, run-queue wait and name, from /proc (Linux
  schedstat): the training step's host work runs in two threads (the main thread, and autograd's device
  thread for backward), so the main thread's CPU time alone misses backward.
* `steal`: the share of CPU time the hypervisor took from this machine's CPUs (/proc/stat), where a virtual
  machine reports it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.affinity import is_autograd_thread
from ..runtime.context import RankContext

#: tiny kernels launched per reference repeat: 3-5 ms of host work on an H200 host
REF_LAUNCHES = 500
REF_REPEATS = 3


def reference_s(ctx: RankContext) -> float:
    """Seconds to issue REF_LAUNCHES tiny element-wise ops on this rank's device (best of REF_REPEATS): the
    host's speed at the training loop's kind of work, measured before the device has done them."""
    import torch

    x = torch.zeros(1, device=ctx.device)
    ctx.synchronize()
    best = float("inf")
    for _ in range(REF_REPEATS):
        t0 = time.perf_counter()
        for _ in range(REF_LAUNCHES):
            x.add_(1.0)
        best = min(best, time.perf_counter() - t0)
        ctx.synchronize()
    return best


def schedstat(tid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting on a run queue) of thread `tid`, or None where the kernel does not say."""
    try:
        run, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


@dataclass
class ThreadTimes:
    """CPU and run-queue wait seconds per thread group between `start()` and `stop()`: "main" (the thread
    that started it: the training thread), "autograd" (torch's pt_autograd_* threads) and "other"."""

    main_tid: int = 0
    _t0: dict[int, tuple[int, int]] | None = None

    def _now(self) -> dict[int, tuple[int, int]]:
        out = {}
        for name in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
            got = schedstat(int(name))
            if got is not None:
                out[int(name)] = got
        return out

    def start(self) -> ThreadTimes:
        self.main_tid = threading.get_native_id()
        self._t0 = self._now()
        return self

    def stop(self) -> dict[str, Any] | None:
        """{"<group>_cpu_s", "<group>_wait_s"} over the interval; None where /proc has no schedstat."""
        if not self._t0:
            return None
        t1 = self._now()
        out = {f"{g}_{k}": 0.0 for g in ("main", "autograd", "other") for k in ("cpu_s", "wait_s")}
        for tid, (run, wait) in t1.items():
            run0, wait0 = self._t0.get(tid, (0, 0))
            group = "main" if tid == self.main_tid else "autograd" if is_autograd_thread(tid) else "other"
            out[f"{group}_cpu_s"] += (run - run0) * 1e-9
            out[f"{group}_wait_s"] += (wait - wait0) * 1e-9
        return out


def cpu_stat() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's "cpu" line: user ... steal), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
        return [int(x) for x in first[1:9]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of all CPU time between two `cpu_stat()` readings that the hypervisor stole."""
    if not before or not after:
        return None
    d = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(d)
    return d[7] / total if total > 0 else 0.0


def host_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole host so far, in jiffies (cpu_stat); None where unreadable. Busy is
    everything but idle and iowait."""
    fields = cpu_stat()
    if fields is None or len(fields) < 5:
        return None
    total = sum(fields)  # its 8 counters: guest time is counted inside user and nice already
    return total - fields[3] - fields[4], total


def busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The host's busy CPU share between two host_jiffies readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
