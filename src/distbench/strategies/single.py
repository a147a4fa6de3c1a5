"""`single` and the shared plain-module trainer that DDP extends."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..config import RunConfig
from ..errors import CheckpointError, first_line
from ..runtime.context import RankContext
from .base import (
    Batch,
    Trainer,
    build_scheduler,
    maybe_compile,
    torch_load,
)
from .checkpoint_files import verify_manifest


class SingleTrainer(Trainer):
    """A bare module on one device; accumulates gradients over all micro-batches of the global batch."""

    def __init__(self, ctx: RankContext, cfg: RunConfig, model: nn.Module) -> None:
        super().__init__(ctx, cfg, model)
        self.module = maybe_compile(model, cfg)
        self.model = self.wrap(self.module)
        self.optimizer = self.make_optimizer(self.module.parameters())
        self.scheduler = build_scheduler(self.optimizer, cfg)

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        return self.accumulate(self.model, batch)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu().clone() for k, v in self.module.state_dict().items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {
            n: p.grad.detach().float().cpu().clone()
            for n, p in self.module.named_parameters()
            if p.grad is not None
        }

    def save_checkpoint(self, path: str) -> None:
        """A plain torch state dict written by rank 0 (replicas are identical), plus per-rank RNG."""
        Path(path).mkdir(parents=True, exist_ok=True)
        if self.ctx.rank == 0:
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "world_size": self.ctx.world_size,
            }
            tmp = os.path.join(path, "checkpoint.pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(path, "checkpoint.pt"))
        self.save_extra_state(path)
        self.seal_checkpoint(path)

    def load_checkpoint(self, path: str, *, reshard: bool = False) -> None:
        if reshard:
            from . import REGISTRY

            which = [s.name for s in REGISTRY.values() if s.checkpoint and s.checkpoint.reshards]
            raise CheckpointError(
                f"checkpoint {path}: resharding is for sharded checkpoints ({', '.join(which)}); "
                f"{self.cfg.strategy}'s replicas load as saved"
            )
        verify_manifest(path)
        state = torch_load(os.path.join(path, "checkpoint.pt"))
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as e:
            raise CheckpointError(
                f"checkpoint {path} does not match this model: {first_line(str(e))} "
                f"(was it saved with another --model?)"
            ) from e
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.restore_extra_state(path)
