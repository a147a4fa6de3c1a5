"""The strategy registry. Adding a strategy is one module plus one entry here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..config import RunConfig
from ..errors import ConfigError, did_you_mean
from .spec import StrategySpec

if TYPE_CHECKING:
    from torch import nn

    from ..runtime.context import RankContext
    from .base import Trainer

DS_OPTIONS = ("ds_config",)  # a DeepSpeed config JSON (path or dict) merged into the harness's, see ds_config.py
#: Why DeepSpeed's fp16 (its own optimizer wrapper and loss scaler) does not run on the CPU tier.
DS_FP16_WHY = "DeepSpeed 0.19's CPU accelerator does not support fp16"

_ENTRIES = [
    StrategySpec("single", "one process, no wrapper; accumulates gradients over the whole global batch",
                 "distbench.strategies.single:SingleTrainer", max_world_size=1, family="single"),
    StrategySpec("ddp", "DistributedDataParallel: replicated model, gradient all-reduce, no_sync while accumulating",
                 "distbench.strategies.ddp:DDPTrainer", family="ddp"),
    StrategySpec("fsdp_full", "FSDP2 fully_shard per block, reshard_after_forward=True (FULL_SHARD / ZeRO-3)",
                 "distbench.strategies.fsdp:FSDP2Trainer", family="fsdp",
                 defaults=(("reshard_after_forward", True),)),
    StrategySpec("fsdp_grad", "FSDP2 fully_shard per block, reshard_after_forward=False (SHARD_GRAD_OP / ZeRO-2)",
                 "distbench.strategies.fsdp:FSDP2Trainer", family="fsdp",
                 defaults=(("reshard_after_forward", False),)),
    StrategySpec("fsdp_hybrid", "FSDP2 on a 2D (replicate x shard) device mesh (HYBRID_SHARD)",
                 "distbench.strategies.fsdp:FSDP2Trainer", family="fsdp",
                 defaults=(("reshard_after_forward", True), ("hybrid", True))),
    StrategySpec("fsdp_offload", "FSDP2 full sharding with CPUOffloadPolicy (parameters and optimizer on host)",
                 "distbench.strategies.fsdp:FSDP2Trainer", cpu=False, family="fsdp",
                 defaults=(("reshard_after_forward", True), ("offload", True)),
                 gpu_only_why="CPUOffloadPolicy pins host memory, which needs an accelerator", fp16_devices=(),
                 fp16_why="its gradients are host DTensors on the CUDA mesh: GradScaler's overflow flag, max-reduced "
                 "over the mesh by DTensor, would go through NCCL from host memory, which NCCL cannot read"),
    StrategySpec("fsdp1_full", "legacy FSDP1 FullyShardedDataParallel, ShardingStrategy.FULL_SHARD",
                 "distbench.strategies.fsdp1:FSDP1Trainer", cpu=False, family="fsdp1",
                 defaults=(("sharding", "FULL_SHARD"),), gpu_only_why="legacy FSDP1 requires CUDA"),
    StrategySpec("fsdp1_grad", "legacy FSDP1 FullyShardedDataParallel, ShardingStrategy.SHARD_GRAD_OP",
                 "distbench.strategies.fsdp1:FSDP1Trainer", cpu=False, family="fsdp1",
                 defaults=(("sharding", "SHARD_GRAD_OP"),), gpu_only_why="legacy FSDP1 requires CUDA"),
    StrategySpec("zero1", "DeepSpeed ZeRO stage 1: optimizer state sharded",
                 "distbench.strategies.deepspeed:DeepSpeedTrainer", family="deepspeed",
                 defaults=(("stage", 1),), user_options=DS_OPTIONS,
                 fp16_devices=("cuda",), fp16_why=DS_FP16_WHY),
    StrategySpec("zero2", "DeepSpeed ZeRO stage 2: optimizer state and gradients sharded",
                 "distbench.strategies.deepspeed:DeepSpeedTrainer", family="deepspeed",
                 defaults=(("stage", 2),), user_options=DS_OPTIONS,
                 fp16_devices=("cuda",), fp16_why=DS_FP16_WHY),
    StrategySpec("zero3", "DeepSpeed ZeRO stage 3: optimizer state, gradients and parameters sharded",
                 "distbench.strategies.deepspeed:DeepSpeedTrainer", family="deepspeed",
                 defaults=(("stage", 3),), user_options=DS_OPTIONS,
                 fp16_devices=("cuda",), fp16_why=DS_FP16_WHY),
    StrategySpec("zero3_offload", "DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to CPU",
                 "distbench.strategies.deepspeed:DeepSpeedTrainer", family="deepspeed",
                 defaults=(("stage", 3), ("offload", True)), user_options=DS_OPTIONS,
                 fp16_devices=("cuda",), fp16_why=DS_FP16_WHY),
]

REGISTRY: dict[str, StrategySpec] = {s.name: s for s in _ENTRIES}


def get_spec(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {name!r}.{did_you_mean(name, REGISTRY)} Known strategies: {', '.join(REGISTRY)} (see `distbench strategies`)"
        ) from None


def strategy_names(device_type: str | None = None) -> list[str]:
    """All names, or those that run on `device_type` ("cpu" or "cuda")."""
    return [s.name for s in _ENTRIES if device_type != "cpu" or s.cpu]


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
