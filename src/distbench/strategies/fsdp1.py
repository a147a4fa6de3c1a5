"""Legacy FSDP1 (FullyShardedDataParallel): fsdp1_full and fsdp1_grad. GPU only: FSDP1 needs CUDA.

As seed 004 ran it: one unit per transformer block (ModuleWrapPolicy), bf16 MixedPrecision with fp32
reduction, and FSDP1's own throughput defaults written out: backward prefetch BACKWARD_PRE, no forward
prefetch, the all-gather rate limiter on. The PyTorch FSDP docs advise forward_prefetch=True and
limit_all_gathers=False only for CPU-bound workloads with memory to spare; both are user options
(docs/strategies-tuning.md).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ..config import RunConfig
from ..errors import ConfigError
from ..runtime.context import RankContext
from .base import (
    Batch,
    build_scheduler,
    maybe_compile,
    no_sync_if,
    transformer_blocks,
)
from .checkpoint_dcp import DCPCheckpointMixin

#: Measured on an H200 (torch 2.11): FSDP1 turns FULL_SHARD and SHARD_GRAD_OP into NO_SHARD on one rank, and
#: NO_SHARD's use_orig_params reshard after the forward asserts ("as_params=True type(prim_param)=Tensor", on a
#: shared weight) once LoRA has frozen part of a flat parameter. Refused before it wraps, with the way out.
LORA_ONE_RANK_WHY = (
    "FSDP1 on one rank runs NO_SHARD, whose use_orig_params path fails on a model LoRA has "
    "partly frozen (torch asserts on a shared weight); use ddp or fsdp_full for LoRA on one GPU, "
    "or two or more ranks"
)
#: ShardedGradScaler hands a fused optimizer a found-inf flag of shape [1] where fused AdamW's step counters
#: need a scalar ("output with shape [] doesn't match the broadcast shape [1]", torch 2.11 on an H200).
FP16_FUSED_WHY = "FSDP1's ShardedGradScaler cannot drive the fused AdamW; use --optimizer foreach"


class FSDP1Trainer(DCPCheckpointMixin):
    autocast_bf16 = False  # FSDP1's MixedPrecision owns the precision

    def __init__(
        self,
        ctx: RankContext,
        cfg: RunConfig,
        model: nn.Module,
        *,
        sharding: str = "FULL_SHARD",
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
    ) -> None:
        super().__init__(ctx, cfg, model)
        if cfg.lora_rank and ctx.world_size == 1:
            raise ConfigError(f"{cfg.strategy} with LoRA at world size 1: {LORA_ONE_RANK_WHY}")
        if cfg.precision == "fp16" and cfg.optimizer == "fused":
            raise ConfigError(f"{cfg.strategy} with fp16: {FP16_FUSED_WHY}")
        mp = (
            MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
            )
            if cfg.precision == "bf16"
            else None
        )
        block_types = {type(b) for b in transformer_blocks(model)}
        maybe_compile(model, cfg)
        self.model = FSDP(
            model,
            sharding_strategy=ShardingStrategy[sharding],
            auto_wrap_policy=ModuleWrapPolicy(block_types) if block_types else None,
            mixed_precision=mp,
            device_id=ctx.device,
            use_orig_params=True,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
        )
        if mp is not None:
            _allow_low_precision_grads(self.model)
        self.optimizer = self.make_optimizer(
            self.model.parameters(),
            no_fused="ShardedGradScaler's [1]-shaped found-inf flag breaks fused AdamW"
            if cfg.precision == "fp16"
            else None,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg)

    def make_grad_scaler(self) -> torch.amp.GradScaler | None:
        """FSDP1's ShardedGradScaler: its gradients are plain tensors holding each rank's shard, so the overflow
        flag must be all-reduced for every rank to skip the same steps (torch's GradScaler would not)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(
            self.ctx.device_type,
            init_scale=2.0**self.cfg.loss_scale_power,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=self.cfg.loss_scale_window,
        )

    def clip_gradients(self) -> torch.Tensor | None:
        """FSDP1's own clip_grad_norm_, which reduces the norm over its flat shards (torch's would not)."""
        if not self.cfg.clip_grad_norm:
            return None
        return cast(FSDP, self.model).clip_grad_norm_(self.cfg.clip_grad_norm)

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        with no_sync_if(self.model, skip=not sync):
            return self.accumulate(self.model, batch)

    def full_grads(self) -> dict[str, torch.Tensor]:
        # A frozen parameter (LoRA's base) has no gradient of its own, whatever its span of the flat gradient holds
        with FSDP.summon_full_params(self.model, with_grads=True, writeback=False):
            return {
                n: p.grad.detach().float().cpu().clone()
                for n, p in self.model.named_parameters()
                if p.grad is not None and p.requires_grad
            }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
            return {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        """Free the FlatParameters' storage. FSDP1 leaves each FlatParameter referenced from C++ after its
        module is collected: on an H100, every GPT-2 Medium configuration kept its parameters (1.32 GiB, even
        after a forward alone) and its gradients (another 1.32 GiB once trained) for the rank's life."""
        for unit in FSDP.fsdp_modules(self.model):
            handle = getattr(unit, "_handle", None)
            if handle is None:
                continue
            flat = handle.flat_param
            for t in (flat, flat.grad, *vars(flat).values()):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.untyped_storage().resize_(0)


def _allow_low_precision_grads(model: nn.Module) -> None:
    """FSDP1 with use_orig_params and bf16 MixedPrecision points each fp32 parameter's .grad at a bf16 view
    of the unsharded gradient between micro-batches (no_sync); torch >= 2.10 refuses that unless the
    parameter's grad_dtype is None ("attempting to assign a gradient with dtype BFloat16 to a tensor with
    grad_dtype Float"). FSDP1 still reduces and hands the optimizer fp32 gradients."""
    for p in model.parameters():
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None
