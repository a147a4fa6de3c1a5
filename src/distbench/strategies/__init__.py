"""The strategy registry.

Adding a strategy is one module (its Trainer) plus one entry here. The entry's StrategySpec (spec.py) carries
every fact the rest of distbench reads about a strategy: the memory model, export and resharding, DeepSpeed's
config check, the default grids of `distbench run`, asv and `distbench ab`, the user options and where it
runs; tests/test_registries.py fails on an entry that lacks one. Only a new checkpoint format is more: its
exporter goes into invariants/export.py's EXPORTERS. (docs/strategies.md's table is generated from it.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..config import PositiveInt, RunConfig
from ..errors import ConfigError, did_you_mean
from .spec import (
    COMPONENTS,
    DCP,
    DEEPSPEED,
    DEEPSPEED_STAGE0,
    FULLY_SHARDED,
    GRIDS,
    REPLICATED,
    TORCH_SAVE,
    Grid,
    MemoryLayout,
    Option,
    StrategySpec,
)

if TYPE_CHECKING:
    from torch import nn

    from ..runtime.context import RankContext
    from .base import Trainer

#: A DeepSpeed config JSON (path or dict) merged into the harness's, see ds_config.py.
DS_OPTIONS = (Option("ds_config", dict[str, Any] | str),)
DS_CHECK = "distbench.strategies.ds_config:check_run_config"
#: FSDP1's prefetch and rate-limiter switches (fsdp1.py), for CPU-bound runs with memory to spare.
FSDP1_OPTIONS = (Option("forward_prefetch", bool), Option("limit_all_gathers", bool))
ALL_GRIDS: frozenset[Grid] = frozenset({"cpu", "cuda", "asv-cpu"})
_FSDP2 = "distbench.strategies.fsdp:FSDP2Trainer"
_FSDP1 = "distbench.strategies.fsdp1:FSDP1Trainer"
_ZERO = "distbench.strategies.deepspeed:DeepSpeedTrainer"
#: Why DeepSpeed's fp16 (its own optimizer wrapper and loss scaler) does not run on the CPU tier.
DS_FP16_WHY = "DeepSpeed 0.19's CPU accelerator does not support fp16"

_ENTRIES = [
    StrategySpec(
        "single",
        "one process, no wrapper; accumulates gradients over the whole global batch",
        "distbench.strategies.single:SingleTrainer",
        max_world_size=1,
        memory=REPLICATED,
        checkpoint=TORCH_SAVE,
        grids=ALL_GRIDS,
    ),
    StrategySpec(
        "ddp",
        "DistributedDataParallel: replicated model, gradient all-reduce, no_sync while accumulating",
        "distbench.strategies.ddp:DDPTrainer",
        memory=REPLICATED,
        checkpoint=TORCH_SAVE,
        grids=ALL_GRIDS | {"ab"},
    ),
    StrategySpec(
        "fsdp_full",
        "FSDP2 fully_shard per block, reshard_after_forward=True (FULL_SHARD / ZeRO-3)",
        _FSDP2,
        memory=FULLY_SHARDED,
        checkpoint=DCP,
        grids=ALL_GRIDS,
        defaults=(("reshard_after_forward", True),),
    ),
    StrategySpec(
        "fsdp_grad",
        "FSDP2 fully_shard per block, reshard_after_forward=False (SHARD_GRAD_OP / ZeRO-2)",
        _FSDP2,
        memory=FULLY_SHARDED,
        checkpoint=DCP,
        grids=frozenset({"cpu", "cuda", "ab"}),
        defaults=(("reshard_after_forward", False),),
    ),
    StrategySpec(
        "fsdp_hybrid",
        "FSDP2 on a 2D (replicate x shard) device mesh (HYBRID_SHARD)",
        _FSDP2,
        memory=MemoryLayout(sharded=COMPONENTS, shard_group="hybrid"),
        checkpoint=DCP,
        defaults=(("reshard_after_forward", True), ("hybrid", True)),
        # the mesh's replicate groups (e.g. 4 x 2 at 8 ranks); default: the nodes, or 2 on one node
        user_options=(Option("replicate", PositiveInt),),
        config_check="distbench.strategies.fsdp:check_hybrid_config",
    ),
    StrategySpec(
        "fsdp_offload",
        "FSDP2 full sharding with CPUOffloadPolicy (parameters and optimizer on host)",
        _FSDP2,
        memory=MemoryLayout(sharded=COMPONENTS, on_host=COMPONENTS),
        checkpoint=DCP,
        cpu=False,
        gpu_only_why="CPUOffloadPolicy pins host memory, which needs an accelerator",
        defaults=(("reshard_after_forward", True), ("offload", True)),
        fp16_devices=(),
        fp16_why="its gradients are host DTensors on the CUDA mesh: GradScaler's overflow flag, max-reduced "
        "over the mesh by DTensor, would go through NCCL from host memory, which NCCL cannot read",
    ),
    StrategySpec(
        "fsdp1_full",
        "legacy FSDP1 FullyShardedDataParallel, ShardingStrategy.FULL_SHARD",
        _FSDP1,
        memory=FULLY_SHARDED,
        checkpoint=DCP,
        cpu=False,
        gpu_only_why="legacy FSDP1 requires CUDA",
        defaults=(("sharding", "FULL_SHARD"),),
        user_options=FSDP1_OPTIONS,
    ),
    StrategySpec(
        "fsdp1_grad",
        "legacy FSDP1 FullyShardedDataParallel, ShardingStrategy.SHARD_GRAD_OP",
        _FSDP1,
        memory=FULLY_SHARDED,
        checkpoint=DCP,
        cpu=False,
        gpu_only_why="legacy FSDP1 requires CUDA",
        defaults=(("sharding", "SHARD_GRAD_OP"),),
        user_options=FSDP1_OPTIONS,
    ),
    StrategySpec(
        "zero0",
        "DeepSpeed engine without ZeRO (stage 0): replicated like DDP, DeepSpeed's gradient all-reduce, bf16/fp16 "
        "optimizer wrappers and checkpoint",
        _ZERO,
        memory=MemoryLayout(bytes_per_param="deepspeed"),
        checkpoint=DEEPSPEED_STAGE0,
        defaults=(("stage", 0),),
        user_options=DS_OPTIONS,
        config_check=DS_CHECK,
        fp16_devices=("cuda",),
        fp16_why=DS_FP16_WHY,
    ),
    StrategySpec(
        "zero1",
        "DeepSpeed ZeRO stage 1: optimizer state sharded",
        _ZERO,
        memory=MemoryLayout(sharded=frozenset({"optimizer"}), bytes_per_param="deepspeed"),
        checkpoint=DEEPSPEED,
        defaults=(("stage", 1),),
        user_options=DS_OPTIONS,
        config_check=DS_CHECK,
        fp16_devices=("cuda",),
        fp16_why=DS_FP16_WHY,
    ),
    StrategySpec(
        "zero2",
        "DeepSpeed ZeRO stage 2: optimizer state and gradients sharded",
        _ZERO,
        memory=MemoryLayout(sharded=frozenset({"grads", "optimizer"}), bytes_per_param="deepspeed"),
        checkpoint=DEEPSPEED,
        defaults=(("stage", 2),),
        user_options=DS_OPTIONS,
        config_check=DS_CHECK,
        grids=frozenset({"cpu", "cuda", "ab"}),
        fp16_devices=("cuda",),
        fp16_why=DS_FP16_WHY,
    ),
    StrategySpec(
        "zero3",
        "DeepSpeed ZeRO stage 3: optimizer state, gradients and parameters sharded",
        _ZERO,
        memory=MemoryLayout(sharded=COMPONENTS, bytes_per_param="deepspeed"),
        checkpoint=DEEPSPEED,
        defaults=(("stage", 3),),
        user_options=DS_OPTIONS,
        config_check=DS_CHECK,
        grids=frozenset({"cuda", "ab"}),
        fp16_devices=("cuda",),
        fp16_why=DS_FP16_WHY,
    ),
    StrategySpec(
        "zero3_offload",
        "DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to CPU",
        _ZERO,
        memory=MemoryLayout(sharded=COMPONENTS, on_host=COMPONENTS, bytes_per_param="deepspeed"),
        checkpoint=DEEPSPEED,
        defaults=(("stage", 3), ("offload", True)),
        user_options=DS_OPTIONS,
        config_check=DS_CHECK,
        fp16_devices=("cuda",),
        fp16_why=DS_FP16_WHY,
    ),
]

REGISTRY: dict[str, StrategySpec] = {s.name: s for s in _ENTRIES}


def get_spec(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {name!r}.{did_you_mean(name, REGISTRY)} Known strategies: {', '.join(REGISTRY)} (see `distbench strategies`)"
        ) from None


def default_strategies(grid: Grid) -> list[str]:
    """The strategies a default grid runs, in registry order (see spec.GRIDS)."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; known: {', '.join(GRIDS)}")
    return [s.name for s in _ENTRIES if grid in s.grids]


def build_trainer(ctx: RankContext, cfg: RunConfig, model: nn.Module) -> Trainer:
    """Wrap `model` (built identically on every rank) with the strategy `cfg.strategy` names."""
    spec = get_spec(cfg.strategy)
    reason = spec.unsupported_reason(ctx.device_type, ctx.world_size, precision=cfg.precision)
    if reason:
        raise ConfigError(reason)
    module_name, cls_name = spec.target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if cfg.dropout:
        from ..workloads.dropout import apply_dropout

        apply_dropout(model, cfg.dropout)
    if cfg.activation_checkpointing:
        from .base import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    if cfg.lora_rank:
        from .lora import apply_lora

        model = apply_lora(model, cfg)
    return cls(ctx, cfg, model, **spec.options_for(cfg))
