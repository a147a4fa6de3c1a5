"""Step timing and throughput.

Timed windows run the way users train: in "events" mode (the default) nothing synchronizes the host inside
a window, so the CPU runs ahead of the GPU as in a training loop; per-step times come from CUDA events
recorded on the stream around each step, and the window's throughput from its wall clock between one
synchronization before and one after. On 2x H200 a sync after every step cost a hand loop 5% of DDP's and
8-10% of FSDP2's throughput and turned host jitter into step time. "sync" mode (a device synchronization
around every step, per-step wall clock) is kept to compare with. On CPU both read the host clock.

A distributed step is as slow as its slowest rank, so per-step times are combined across ranks by max
before any statistic is taken.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..runtime.context import RankContext
from .hostcount import ThreadCounters

T = TypeVar("T")


def timed(ctx: RankContext, fn: Callable[[], T]) -> tuple[T, float]:
    """Run `fn()` between two device synchronizations; return its result and the wall time in seconds."""
    ctx.synchronize()
    t0 = time.perf_counter()
    out = fn()
    ctx.synchronize()
    return out, time.perf_counter() - t0


@dataclass
class Window:
    """One timed window of consecutive optimizer steps on one rank."""

    wall_s: float  # host wall clock from a synchronized start to the synchronization after the last step
    step_s: list[float]  # per step: CUDA event time ("events" on GPU), else host time between syncs
    host_cpu_s: list[float]  # per step: CPU seconds of the training thread while it issued the step
    losses: list[Any]  # what each step returned, read only after the window
    host_s: list[float] = field(default_factory=list)  # per step: host wall clock while it issued the step
    #: per step, per counter of measure/hostcount.py (user-mode instructions, cycles): what issuing it took
    counts: dict[str, list[int]] = field(default_factory=dict)
    #: the host's speed around the window, filled by the caller (measure/hostspeed.py)
    host_speed: dict[str, Any] = field(default_factory=dict)


def time_window(
    ctx: RankContext,
    timing: str,
    steps: Sequence[Callable[[], Any]],
    counters: ThreadCounters | None = None,
) -> Window:
    """Run `steps` (each one optimizer step, returning its loss) as one timed window; `counters` (opened by
    this thread) are read around each step, as the host clocks are."""
    import torch  # here: report and compare read this module's statistics without loading torch

    events = timing == "events" and ctx.is_cuda
    marks = (
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in steps]
        if events
        else []
    )
    host, cpu, losses = [], [], []
    deltas: list[tuple[int, ...]] = []
    ctx.synchronize()
    t0 = time.perf_counter()
    for i, fn in enumerate(steps):
        if events:
            marks[i][0].record()
        elif timing == "sync":
            ctx.synchronize()
        h0, c0 = time.perf_counter(), time.thread_time()
        k0 = counters.read() if counters else ()
        losses.append(fn())
        k1 = counters.read() if counters else ()
        if timing == "sync":
            ctx.synchronize()
        cpu.append(time.thread_time() - c0)
        host.append(time.perf_counter() - h0)
        deltas.append(tuple(b - a for a, b in zip(k0, k1, strict=True)))
        if events:
            marks[i][1].record()
    ctx.synchronize()
    wall = time.perf_counter() - t0
    step_s = [a.elapsed_time(b) / 1000.0 for a, b in marks] if events else host
    counts = {name: [d[j] for d in deltas] for j, name in enumerate(counters.names)} if counters else {}
    return Window(wall, step_s, cpu, losses, list(host), counts)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_stats(times: Sequence[float]) -> dict[str, Any]:
    """median, p10, p90, mean, std (sample, n-1), cv (std/mean) and n of step times in seconds."""
    n = len(times)
    if n == 0:
        raise ValueError("no timed steps: raise --steps above 0")
    mean = sum(times) / n
    std = math.sqrt(sum((t - mean) ** 2 for t in times) / (n - 1)) if n > 1 else 0.0
    return {
        "median": percentile(times, 50),
        "p10": percentile(times, 10),
        "p90": percentile(times, 90),
        "mean": mean,
        "std": std,
        "cv": std / mean if mean > 0 else 0.0,
        "n": n,
    }


def per_step_max(per_rank_times: Sequence[Sequence[float]]) -> list[float]:
    """Combine ranks' step times step by step: a step ends when its slowest rank does."""
    lengths = {len(t) for t in per_rank_times}
    if len(lengths) != 1:
        raise ValueError(f"ranks timed different numbers of steps: {sorted(lengths)}")
    return [max(ts) for ts in zip(*per_rank_times, strict=True)]


def throughput(global_batch: int, seq_len: int, world_size: int, step_time_s: float) -> dict[str, float]:
    """tokens/s and samples/s for the whole job and per GPU (rank), from one optimizer-step time."""
    if step_time_s <= 0:
        raise ValueError(f"step time must be positive, got {step_time_s}")
    samples = global_batch / step_time_s
    tokens = samples * seq_len
    return {
        "tokens_per_s": tokens,
        "tokens_per_s_per_gpu": tokens / world_size,
        "samples_per_s": samples,
        "samples_per_s_per_gpu": samples / world_size,
    }
