"""Step timing and throughput.

Only steady-state steps are timed (warm-up excluded by the caller), each between two device
synchronizations so that queued GPU work is inside the step it belongs to. A distributed step is as slow
as its slowest rank, so per-step times are combined across ranks by max before any statistic is taken.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..runtime.context import RankContext

T = TypeVar("T")


def timed(ctx: RankContext, fn: Callable[[], T]) -> tuple[T, float]:
    """Run `fn()` between two device synchronizations; return its result and the wall time in seconds."""
    ctx.synchronize()
    t0 = time.perf_counter()
    out = fn()
    ctx.synchronize()
    return out, time.perf_counter() - t0


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
