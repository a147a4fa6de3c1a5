"""FSDP2 (`fully_shard`): fsdp_full, fsdp_grad, fsdp_hybrid and fsdp_offload.

Configured as torchtitan applies FSDP2 (torchtitan/models/llama3/infra/parallelize.py, apply_fsdp): each
transformer block its own unit, then the root, which keeps the embeddings, the final norm and the head
(GPT-2 ties its head to the token embedding, so the two stay in one unit) and which FSDP2 does not reshard
after forward (its default for the root); bf16 parameters with fp32 reduction (MixedPrecisionPolicy); FSDP2's implicit prefetch of the
next unit. Per-block wrapping is also what seed 004 found critical for prefetching and peak memory. Under
gradient accumulation, fsdp_grad keeps its parameters unsharded between the micro-batches of a step, as
FSDP1's SHARD_GRAD_OP does inside no_sync (docs/strategies-tuning.md).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..config import RunConfig
from ..errors import ConfigError
from ..runtime.context import RankContext
from .base import (
    Batch,
    build_scheduler,
    maybe_compile,
    transformer_blocks,
)
from .checkpoint_dcp import DCPCheckpointMixin


def hybrid_shape(world_size: int, nodes: int = 1, replicate: int | None = None) -> tuple[int, int]:
    """(replicate, shard) for HSDP: `replicate` groups when given (fsdp_hybrid's option); else across nodes,
    replicate over nodes and shard within each (the mesh users run, keeping the all-gathers on the fast link);
    on one node, replicate over 2 groups when the world is even."""
    if replicate is None:
        replicate = nodes if nodes > 1 else (2 if world_size % 2 == 0 else 1)
    elif world_size % replicate:
        raise ConfigError(
            f"fsdp_hybrid option replicate={replicate} does not divide world size {world_size}; use a "
            "divisor of the world size"
        )
    return replicate, world_size // replicate


def check_hybrid_config(cfg: RunConfig) -> None:
    """fsdp_hybrid's pre-flight check: a `replicate` option that divides the world size (ConfigError)."""
    hybrid_shape(cfg.world_size, replicate=cfg.options.get("replicate"))


class FSDP2Trainer(DCPCheckpointMixin):
    autocast_bf16 = False  # MixedPrecisionPolicy owns the precision

    def __init__(
        self,
        ctx: RankContext,
        cfg: RunConfig,
        model: nn.Module,
        *,
        reshard_after_forward: bool = True,
        hybrid: bool = False,
        offload: bool = False,
        replicate: int | None = None,
    ) -> None:
        super().__init__(ctx, cfg, model)
        self.reshard_after_forward = reshard_after_forward
        if hybrid:
            self.mesh = init_device_mesh(
                ctx.device_type,
                hybrid_shape(ctx.world_size, ctx.nodes, replicate),
                mesh_dim_names=("replicate", "shard"),
            )
        else:
            self.mesh = init_device_mesh(ctx.device_type, (ctx.world_size,), mesh_dim_names=("shard",))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if cfg.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        kw: dict[str, Any] = {
            "mesh": self.mesh,
            "mp_policy": mp,
            "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
        }
        maybe_compile(model, cfg)
        for block in transformer_blocks(model):
            fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
        # The root's reshard_after_forward left to FSDP2 (None: not after forward, its parameters being the
        # first that backward needs), as torchtitan leaves it: a root resharded after forward all-gathers
        # the embeddings and head again at every micro-batch's backward, before anything can overlap it.
        self.model = cast(nn.Module, fully_shard(model, **kw))
        self.optimizer = self.make_optimizer(self.model.parameters(), offload=offload)
        self.scheduler = build_scheduler(self.optimizer, cfg)

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        model = cast(FSDPModule, self.model)
        model.set_requires_gradient_sync(sync)
        if not self.reshard_after_forward:  # no all-gather again before the next micro-batch's forward
            model.set_reshard_after_backward(sync)
        return self.accumulate(self.model, batch)

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {n: self._gather(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self._gather(v) for k, v in self.model.state_dict().items()}

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """The full tensor of a sharded DTensor, as CPU fp32 (a collective: every rank calls it).

        Under CPUOffloadPolicy the shards live in host memory while the mesh is CUDA's, and NCCL cannot
        all-gather host tensors ("No backend type associated with device type cpu"): the shard travels to
        the rank's device first.
        """
        from torch.distributed.tensor import DTensor

        t = t.detach()
        if isinstance(t, DTensor):
            if t.device.type != self.ctx.device.type:
                t = DTensor.from_local(
                    t.to_local().to(self.ctx.device),
                    t.device_mesh,
                    t.placements,
                    run_check=False,
                    shape=t.shape,
                    stride=t.stride(),
                )
            t = t.full_tensor()
        return t.float().cpu().clone()
