"""DeepSpeed ZeRO's partitioning, stated from DeepSpeed 0.19's code, and the job that reads it from a real engine.

ZeRO-1/2 flatten the parameter group, pad it to a multiple of 2 x world size elements (nccl_start_alignment_factor
x world size, stage_1_and_2.py) and give every rank an equal partition of it; every rank holds the whole flat
buffer of parameters. ZeRO-3 pads each parameter to a multiple of the world size (Init._padding_size,
partition_parameters.py) and every rank holds one equal partition of each. Ranks import this module by name.
"""

from __future__ import annotations

from typing import Any

from distbench.config import RunConfig
from distbench.jobs.train import make_trainer


def zero_elements(stage: int, numels: list[int], world_size: int) -> dict[str, int]:
    """A rank's elements by DeepSpeed's rules: `held`, the parameters it keeps on its device, and `partition`,
    its share of the optimizer's (fp32 master) partition."""
    if stage < 3:
        align = 2 * world_size
        flat = -(-sum(numels) // align) * align
        return {"held": flat, "partition": flat // world_size}
    per_rank = sum(-(-n // world_size) for n in numels)
    return {"held": per_rank, "partition": per_rank}


def engine_elements(ctx: Any, cfg: RunConfig) -> dict[str, int]:
    """The same two counts read from the engine cfg builds on this rank (no step taken)."""
    trainer = make_trainer(ctx, cfg)
    try:
        opt = trainer.engine.optimizer
        if cfg.strategy in ("zero1", "zero2"):
            return {
                "held": sum(t.numel() for t in opt.bit16_groups_flat),
                "partition": sum(t.numel() for t in opt.single_partition_of_fp32_groups),
            }
        return {
            "held": sum(p.ds_tensor.ds_numel for p in trainer.engine.module.parameters()),
            "partition": sum(t.numel() for t in opt.fp32_partitioned_groups_flat),
        }
    finally:
        trainer.close()
