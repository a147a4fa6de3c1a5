"""Device time per step from CUPTI activity (through Kineto), and the regime it implies.

A gate has to know whether a configuration is device-bound (the GPU is busy for nearly the whole step, so a
change of device work moves the step time) or host-bound (the GPU idles waiting for launches, so device-side
changes hide in the gaps and host-side changes are what moves). So beside wall time every gated
configuration samples a few steps under the profiler with only CUDA activity recorded (no CPU op tracing)
and reads these figures per step from the raw Kineto events:

* compute_s: summed duration of kernels other than communication (NCCL): the device's own work. It is
  the quiet device-side figure: on 2x H200 its spread across processes was 0.07% where wall medians spread 1%.
* comm_s: summed duration of NCCL kernels, kept apart: they are mostly waiting for the other rank.
* floor_s: each compute kernel's least disturbed duration across the sampled steps of every rank, summed
  over a step's kernels (least_disturbed_s). NCCL kernels spin on some of the SMs while they wait for a
  peer, and compute kernels that overlap them run slower: on 2x H200 (results/gate-ab-2xh200-2026-11-23,
  runs of no planted change) a run's compute_s rose with its comm_s in ddp, fsdp_grad and zero3
  (correlation 0.68, 0.81 and 0.78; 0.04-0.12 ms of compute per ms of NCCL), not in zero2 (-0.03), whose
  reductions do not overlap compute. So at two or more ranks compute_s carries the other rank's jitter.
  The rank that reaches a collective last does not wait in it, so the kernels beside it run slowed by the
  transfer alone; the fastest run of each kernel over the steps and ranks carries little of the jitter,
  and a change of device work on every rank still moves it (a change on one rank alone moves the step
  time, which is gated beside it, and not the floor).
* busy_s: the union of the GPU activity intervals other than NCCL kernels (compute kernels, copies,
  memsets, all streams): time the device worked on its own. NCCL kernels are left out because they occupy
  the device while they wait for a peer: on 2x H200, fsdp_grad at micro-batch 8 read busy 1.00 with them
  and 0.78 without, and it is the host that bounds that step (wall spread 6-8% between processes).
* exposed_comm_s: the time NCCL kernels ran while nothing else did (the union of all activity less
  busy_s): communication the step waited for. What is left of the step, wall less both, is time the device
  had no work at all: in a step with no synchronization inside, the device waiting for the host's launches.

regime = "device-bound" when busy / wall >= DEVICE_BOUND_RATIO, else "host-bound" (host, or a network the
compute does not hide: comm_s beside it tells which).

Each sampled step is profiled on its own (a device synchronization before and after it), so that a
kernel's runs in different steps can be told apart.

The raw events are read directly (`kineto_results.events()`), never through `prof.events()` or
`key_averages()`: those build a Python object tree per event and cost tens of seconds per 10-step window of
a large model, which is why this sampling runs on a few extra steps outside the timed windows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..runtime.context import RankContext

#: busy / wall at or above this is device-bound: at micro-batch 16 (GPT-2 Large, fsdp_grad, 2x H200) the
#: device's summed kernel time was 0.97 of the step, at micro-batch 8 about 0.8 with wall CV up to 12%.
DEVICE_BOUND_RATIO = 0.9
_GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


def is_comm_kernel(name: str) -> bool:
    """NCCL's kernels (ncclDevKernel_*, ncclKernel_*): communication, not compute."""
    return "nccl" in name.lower()


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by the intervals [start, end) (any order, overlaps counted once)."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # A new covered run begins where an interval starts after everything before it has ended.
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    run_ids = np.cumsum(new) - 1
    run_start = s[new]
    run_end = np.zeros(run_start.size, dtype=e.dtype)
    np.maximum.at(run_end, run_ids, e)
    return float((run_end - run_start).sum())


#: (activity, name, start_ns, duration_ns), and the stream where Kineto gives it
Row = tuple[Any, ...]


def summarize_activity(events: Sequence[Row], steps: int, wall_s: float) -> dict[str, Any]:
    """Per-step compute, communication, busy and exposed-communication seconds from (activity, name, start_ns,
    duration_ns) rows."""
    gpu = [e for e in events if e[0] in _GPU_ACTIVITIES]
    kernels = [e for e in gpu if e[0] == "kernel"]
    comm = sum(e[3] for e in kernels if is_comm_kernel(e[1]))
    compute = sum(e[3] for e in kernels if not is_comm_kernel(e[1]))
    starts = np.array([e[2] for e in gpu], dtype=np.int64)
    ends = starts + np.array([e[3] for e in gpu], dtype=np.int64)
    own = np.array([not (e[0] == "kernel" and is_comm_kernel(e[1])) for e in gpu], dtype=bool)
    busy = union_length(starts[own], ends[own])
    anything = union_length(starts, ends)
    per = 1e-9 / steps
    out: dict[str, Any] = {
        "steps": steps,
        "kernels": len(kernels),
        "compute_s": compute * per,
        "comm_s": comm * per,
        "busy_s": busy * per,
        "exposed_comm_s": max(0.0, anything - busy) * per,
        "wall_s": wall_s / steps,
    }
    out["busy_ratio"] = out["busy_s"] / out["wall_s"] if out["wall_s"] > 0 else 0.0
    out["regime"] = regime(out["busy_ratio"])
    return out


def kernel_runs(rows: Sequence[Row]) -> list[tuple[Any, str, int]]:
    """A step's compute kernels (not NCCL) as (stream, name, duration_ns), in the order they started."""
    kernels = sorted((e for e in rows if e[0] == "kernel" and not is_comm_kernel(e[1])), key=lambda e: e[2])
    return [(e[4] if len(e) > 4 else 0, e[1], e[3]) for e in kernels]


def least_disturbed_s(steps: Sequence[Sequence[tuple[Any, str, int]]]) -> float:
    """Seconds per step of the compute kernels, each at its least disturbed: a kernel is the k-th of its name
    on its stream in a step, and counts with the shortest of its runs across `steps` (kernel_runs of each
    sampled step, of every rank), weighted by the share of the steps it ran in. The same work on a quieter
    device gives the same figure; another kernel, or a slower one, moves it."""
    runs: dict[tuple[Any, str, int], list[int]] = {}
    for step in steps:
        seen: dict[tuple[Any, str], int] = {}
        for stream, name, duration in step:
            k = seen[stream, name] = seen.get((stream, name), -1) + 1
            runs.setdefault((stream, name, k), []).append(duration)
    return sum(min(d) * len(d) for d in runs.values()) / max(1, len(steps)) * 1e-9


def regime(busy_ratio: float) -> str:
    return "device-bound" if busy_ratio >= DEVICE_BOUND_RATIO else "host-bound"


def _activity(event: Any) -> str:
    """Kineto's activity type of a device event; torch < 2.12 does not expose it, so it is told by name."""
    if hasattr(event, "activity_type"):
        return str(event.activity_type())
    if getattr(event, "is_user_annotation", lambda: False)():
        return "gpu_user_annotation"
    name = event.name()
    return (
        "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
    )


def sample_device_time(ctx: RankContext, step_fns: Sequence[Callable[[], Any]]) -> dict[str, Any] | None:
    """Run `step_fns` under the profiler (CUDA activity only), one step a profile between two device
    synchronizations, and summarize the device's time per step. None on CPU (no device timeline)."""
    if not ctx.is_cuda or not step_fns:
        return None
    from torch.profiler import ProfilerActivity, profile

    steps: list[list[Row]] = []
    wall = processing = 0.0
    for fn in step_fns:
        ctx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            ctx.synchronize()
            wall += time.perf_counter() - t0
        t1 = time.perf_counter()
        steps.append(
            [
                (_activity(e), e.name(), e.start_ns(), e.duration_ns(), e.device_resource_id())
                for e in prof.profiler.kineto_results.events()
                if e.device_type().name == "CUDA"
            ]
        )
        processing += time.perf_counter() - t1
    t2 = time.perf_counter()
    out = summarize_activity([e for rows in steps for e in rows], len(steps), wall)
    runs = [kernel_runs(rows) for rows in steps]
    if ctx.world_size > 1:  # every rank's runs: the floor is the same figure on each
        import torch.distributed as dist

        every: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every, runs)
        runs = [step for rank in every for step in rank]
    out["floor_s"] = least_disturbed_s(runs)
    out["processing_s"] = processing + time.perf_counter() - t2
    return out
