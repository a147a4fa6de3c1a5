"""Peak memory of a rank: what torch's caching allocator saw, and what the GPU as a whole had in use.

torch's counters miss the CUDA context, NCCL's communication buffers and other libraries' allocations;
NVML's device-level "used" sees all of them (and anything else on that GPU, so give each rank its own GPU).
On CPU every value is None, not zero: there is no device memory to report.
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.context import RankContext
from .nvml import device_memory


def reset_peaks(ctx: RankContext) -> None:
    """Start a new peak window (call after warm-up so peaks describe steady-state steps)."""
    if ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)


def memory_stats(ctx: RankContext, nvml_peak_bytes: int | None = None) -> dict[str, Any]:
    """Peaks since the last reset_peaks(). `nvml_peak_bytes` is the sampler's maximum of device memory
    used over the window; the reading taken now is folded in, so the peak is never below the final use."""
    if not ctx.is_cuda:
        return {
            "mem_allocated_peak_bytes": None,
            "mem_reserved_peak_bytes": None,
            "nvml_mem_used_peak_bytes": None,
            "mem_allocated_bytes": None,
            "mem_total_bytes": None,
            "nvml_mem_total_bytes": None,
        }
    now, nvml_total = device_memory(ctx.device) or (None, None)
    nvml_peak = max((v for v in (now, nvml_peak_bytes) if v is not None), default=None)
    return {
        "mem_allocated_peak_bytes": int(torch.cuda.max_memory_allocated(ctx.device)),
        "mem_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(ctx.device)),
        "nvml_mem_used_peak_bytes": nvml_peak,
        "mem_allocated_bytes": int(torch.cuda.memory_allocated(ctx.device)),
        "mem_total_bytes": int(torch.cuda.get_device_properties(ctx.device).total_memory),
        # what NVML's used counts against: a headroom from NVML's peak must be taken from this total
        "nvml_mem_total_bytes": nvml_total,
    }
