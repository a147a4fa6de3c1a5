"""What a timed round was made of, so that a claim left undecided by noisy rounds can say where the noise came
from: the host (issuing the work took as long as the round; the thread was descheduled; the collector ran) or
the device (the host was done early and waited; the SM clock moved).

A round's wall time runs from one device synchronization to the next. `issue_s` is the part the host spent
issuing the work: where it is close to the wall time the device waited on the host (a host-bound round), where
it is far below, the host waited on the device. While it issued, the thread ran on a core for `cpu_s`, waited
for one (other runnable threads held them all) for `runq_s` (over the whole round), and was blocked for the
rest (on the device's launch queue, a lock, a synchronization); `others_cpu_s` is the CPU time of the rank's
other threads over the round. The caller adds `gc_s`, the collector's time in the side (measure/pygc.GcWatch,
which also keeps it off). Beside the rounds (Readings): the whole host's busy share (`host_busy`: another
process at work) and the device's clock, temperature and power.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..machine import nvml
from ..runtime.context import RankContext
from .hostspeed import busy_share, host_jiffies, schedstat
from .nvml import device_handle, read_sample

#: The device's fields in Readings, with their units
READINGS = {"sm_clock_mhz": "MHz", "temp_c": "C", "power_w": "W"}


def _runq_s() -> float:
    """Seconds this thread has waited on a run queue (0 where the kernel does not say)."""
    got = schedstat(threading.get_native_id())
    return got[1] * 1e-9 if got is not None else 0.0


def timed_parts(ctx: RankContext, fn: Callable[[], Any]) -> dict[str, float]:
    """Run `fn()` between two device synchronizations: its wall seconds `s` and their parts."""
    ctx.synchronize()
    q0, p0 = _runq_s(), time.process_time()
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    issued, cpu = time.perf_counter() - t0, time.thread_time() - c0
    ctx.synchronize()
    wall = time.perf_counter() - t0
    return {
        "s": wall,
        "issue_s": issued,
        "cpu_s": cpu,
        "runq_s": _runq_s() - q0,
        # the process's CPU time counts threads that ended within the round too
        "others_cpu_s": max(0.0, time.process_time() - p0 - (time.thread_time() - c0)),
    }


class Readings:
    """What the host and the device did over a round: `start()` before it, `stop()` after it."""

    def __init__(self, ctx: RankContext) -> None:
        nv = nvml()
        self._nv, self._handle = nv, device_handle(ctx.device) if nv is not None else None
        self._host: tuple[int, int] | None = None

    def start(self) -> None:
        self._host = host_jiffies()

    def stop(self) -> dict[str, float]:
        """host_busy over the round; the device's SM clock, temperature and power at its end (NVML)."""
        out = {}
        busy = busy_share(self._host, host_jiffies())
        if busy is not None:
            out["host_busy"] = busy
        if self._handle is not None:
            sample = read_sample(self._nv, self._handle)
            out.update({k: float(sample[k]) for k in READINGS if sample.get(k) is not None})
        return out


def explain(rounds: Sequence[dict[str, float]], sides: Sequence[str]) -> str:
    """Where the rounds' time varied: per side, the spread of its wall time (sd of the log), the share of it
    the host spent issuing, its CPU time, and the most it waited for a core, its other threads ran and the
    collector ran; then the range of the host's busy share and of the device's readings."""
    parts = []
    for side in sides:
        wall = [r[f"{side}_s"] for r in rounds]
        if len(wall) < 2 or min(wall) <= 0:
            continue
        sd = statistics.stdev(math.log(w) for w in wall)
        issue = statistics.median(r[f"{side}_issue_s"] / r[f"{side}_s"] for r in rounds)
        cpu = [r[f"{side}_cpu_s"] for r in rounds]
        most = {k: max(r[f"{side}_{k}"] for r in rounds) * 1e3 for k in ("runq_s", "others_cpu_s", "gc_s")}
        parts.append(
            f"{side} {statistics.median(wall) * 1e3:.0f} ms (spread {sd:.1%}): host issuing {issue:.0%} of it "
            f"on {min(cpu) * 1e3:.0f}-{max(cpu) * 1e3:.0f} ms of CPU, waiting for a core up to "
            f"{most['runq_s']:.0f} ms, the rank's other threads up to {most['others_cpu_s']:.0f} ms of CPU, "
            f"the collector up to {most['gc_s']:.0f} ms"
        )
    busy = [r["host_busy"] for r in rounds if "host_busy" in r]
    if busy:
        parts.append(f"host CPUs busy {min(busy):.0%}-{max(busy):.0%}")
    for key, unit in READINGS.items():
        values = [r[key] for r in rounds if key in r]
        if values:
            parts.append(f"{key.removesuffix('_' + unit.lower())} {min(values):.0f}-{max(values):.0f} {unit}")
    return "; ".join(parts)
