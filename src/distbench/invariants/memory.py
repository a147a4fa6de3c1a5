"""The memory model: per-rank bytes of parameters, gradients and optimizer state, measured and predicted.

Measured with the CUDA caching allocator's live bytes inside a training step: after the backward of the
step's last micro-batch (parameters + gradients + optimizer state) and after the optimizer step and
zero_grad (parameters + optimizer state). Activations are freed by then, so the difference from the
analytic model is what a strategy holds beyond its state: buffers, or a replica it should not keep.

Analytic model for N parameters trained with fp32 master weights (16N bytes in all, replicated):
  torch-native (single, DDP, FSDP):  parameters 4N (fp32, also the master copy), gradients 4N, AdamW 8N
  DeepSpeed bf16:                    parameters 2N (bf16), gradients 2N, fp32 master + AdamW 12N
Sharding divides a component by the shard-group size: ZeRO-1 the optimizer state; ZeRO-2 also gradients;
ZeRO-3, fsdp_full and fsdp_grad (at rest) also parameters. Offload moves state to host memory: FSDP2's
CPUOffloadPolicy all of it; ZeRO-3 offload parameters, optimizer state and (ZeRO-Offload) the gradient
partitions. What stays on the device is buffers: for zero3_offload DeepSpeed's reduce bucket (n_params
bf16 elements under the harness's config), whatever the world size.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from ..runtime.context import RankContext
from ..runtime.jobs import make_trainer, run_steps
from ..strategies import get_spec
from ..workloads import count_params, get_model


def analytic_bytes(strategy: str, n_params: int, world_size: int, precision: str) -> dict[str, float]:
    """Predicted device bytes per rank of each component (see module docstring), from the strategy's
    registry memory layout."""
    from ..strategies.fsdp import hybrid_shape

    layout = get_spec(strategy).memory
    if layout is None:
        raise ValueError(f"strategy {strategy} has no memory layout in the registry")
    deepspeed_bf16 = layout.bytes_per_param == "deepspeed" and precision == "bf16"
    per_param = {"params": 2, "grads": 2, "optimizer": 12} if deepspeed_bf16 else \
        {"params": 4, "grads": 4, "optimizer": 8}
    shard = hybrid_shape(world_size)[1] if layout.shard_group == "hybrid" else world_size
    return {k: 0.0 if k in layout.on_host else b * n_params / (shard if k in layout.sharded else 1)
            for k, b in per_param.items()}


def state_memory(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """Allocator bytes of this rank's training state, measured around the optimizer step of step 2."""
    if not ctx.is_cuda:
        raise RuntimeError("state_memory reads the CUDA caching allocator: run it on the GPU tier")
    rc = ctx.config(cfg)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(ctx.device)
    trainer = make_trainer(ctx, rc)
    marks: dict[str, int] = {}
    original = trainer.optimizer_step

    def probed() -> None:
        torch.cuda.synchronize(ctx.device)
        marks["before_optimizer_step"] = torch.cuda.memory_allocated(ctx.device) - base
        original()
        torch.cuda.synchronize(ctx.device)
        marks["after_optimizer_step"] = torch.cuda.memory_allocated(ctx.device) - base

    trainer.optimizer_step = probed  # type: ignore[method-assign]
    try:
        run_steps(ctx, trainer, rc, 2)  # step 1 creates the optimizer state; step 2 is measured
    finally:
        trainer.close()
        original = None  # type: ignore[assignment]  # the probe's closure reaches the trainer through it
        del trainer, probed  # a cycle through the probe: freed below
    gc.collect()
    torch.cuda.empty_cache()
    end = torch.cuda.memory_allocated(ctx.device)
    # Memory an earlier job left allocated and this one freed (on 4 H200s, after a DDP job: 0.55 GiB) was
    # counted in `base` but not in the marks, so state looked 0.55 GiB smaller than it is. What is still
    # allocated once this job's trainer is gone bounds the baseline from above.
    if end < base:
        marks = {k: v + base - end for k, v in marks.items()}
    n = count_params(get_model(rc.model).build(rc.seed, "meta"))
    return {"rank": ctx.rank, "n_params": n, "baseline_bytes": base,
            "left_after_close_bytes": max(0, end - base), **marks}
