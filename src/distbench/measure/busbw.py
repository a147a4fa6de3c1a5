"""Collective bandwidth in nccl-tests' convention, as an in-rank job.

For a collective over n ranks moving a buffer of S bytes in time t (nccl-tests, doc/PERFORMANCE.md):

* algbw = S / t, where S is the full buffer: the all_reduce buffer, the all_gather *output*, the
  reduce_scatter *input* (each rank holds S/n of the gathered or scattered side).
* busbw = algbw * factor, the bandwidth each link must sustain, comparable with the hardware's link speed
  whatever n is: all_reduce 2(n-1)/n (a reduce-scatter then an all-gather), all_gather and
  reduce_scatter (n-1)/n.

GB/s are 1e9 bytes/s. The reference ceiling is what a ring reaches over NVLink4 on H100/H200 SXM with
NVLink multicast (NVLS) off, about 365 GB/s busbw (measured with nccl-tests' convention); results report busbw as a fraction of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import first_line
from ..runtime.context import RankContext
from .mfu import gpu_key

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Ring busbw ceiling in GB/s per GPU model (PEAK_TFLOPS row), NVLS off.
RING_CEILING_GBPS: dict[str, float] = {"H100 SXM": 365.0, "H200 SXM": 365.0}

DEFAULT_SIZES_CUDA = (1 << 20, 16 << 20, 128 << 20, 1 << 30)
DEFAULT_SIZES_CPU = (1 << 10, 16 << 10, 256 << 10)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` over `n` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def algbw_gbps(size_bytes: int, time_s: float) -> float:
    return size_bytes / time_s / 1e9


def busbw_gbps(op: str, size_bytes: int, time_s: float, n: int) -> float:
    return algbw_gbps(size_bytes, time_s) * bus_factor(op, n)


def ring_ceiling_gbps(device_name: str | None) -> float | None:
    """The NVLink ring busbw ceiling for a GPU model, None where no reference is known (PCIe, CPU, ...)."""
    key = gpu_key(device_name)
    return RING_CEILING_GBPS.get(key) if key else None


def _collective(op: str, count: int, n: int, dtype: torch.dtype, device: torch.device):
    """A zero-argument callable running `op` on a buffer of `count` elements (divisible by n)."""
    if op == "all_reduce":
        buf = torch.zeros(count, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        inp = torch.zeros(count // n, dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if op == "reduce_scatter":
        inp = torch.zeros(count, dtype=dtype, device=device)
        out = torch.empty(count // n, dtype=dtype, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def _max_over_ranks(ctx: RankContext, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def bandwidth_table(
    ctx: RankContext,
    sizes_bytes: tuple[int, ...] | list[int] | None = None,
    ops: tuple[str, ...] | list[str] = OPS,
    iters: int = 20,
    warmup: int = 5,
    dtype: str = "fp32",
    ceiling_gbps: float | None = None,
) -> dict[str, Any]:
    """Time each collective at each size; every rank returns the same table (times are the max over ranks).

    Needs an initialized process group (the rank pool's). Sizes are rounded down to a multiple of
    world_size elements. A collective the backend does not implement (reduce_scatter on older gloo) is
    skipped with the backend's reason. `ceiling_gbps` overrides the per-GPU ring reference.
    """
    n = ctx.world_size
    dt = DTYPES[dtype]
    elem = torch.empty((), dtype=dt).element_size()
    sizes = sizes_bytes or (DEFAULT_SIZES_CUDA if ctx.is_cuda else DEFAULT_SIZES_CPU)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else None
    ceiling = ceiling_gbps if ceiling_gbps is not None else ring_ceiling_gbps(device_name)
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    for op in ops:
        for size in sizes:
            count = max(n, size // elem // n * n)
            try:
                t = _time_collective(ctx, _collective(op, count, n, dt, ctx.device), iters, warmup)
            except (RuntimeError, NotImplementedError) as e:
                if ctx.is_cuda or isinstance(e, torch.OutOfMemoryError):
                    raise
                # gloo rejects what it does not implement alike on every rank, before any traffic
                skipped.append({"op": op, "reason": f"{ctx.backend} cannot run {op}: {first_line(str(e))}"})
                break
            nbytes = count * elem
            bus = busbw_gbps(op, nbytes, t, n)
            results.append(
                {
                    "op": op,
                    "size_bytes": nbytes,
                    "time_s": t,
                    "algbw_gbps": algbw_gbps(nbytes, t),
                    "busbw_gbps": bus,
                    "fraction_of_ceiling": bus / ceiling if ceiling else None,
                }
            )
    return {
        "backend": ctx.backend,
        "world_size": n,
        "dtype": dtype,
        "device_name": device_name,
        "ceiling_gbps": ceiling,
        "results": results,
        "skipped": skipped,
    }


def _time_collective(ctx: RankContext, run: Callable[[], Any], iters: int, warmup: int) -> float:
    """Seconds per call of `run`, the slowest rank's, after one call that raises where the backend cannot run
    it and `warmup` more."""
    run()
    for _ in range(warmup):
        run()
    ctx.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    ctx.synchronize()
    return _max_over_ranks(ctx, time.perf_counter() - t0) / iters
