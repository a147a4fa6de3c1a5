"""`ddp`: DistributedDataParallel, skipping the all-reduce (no_sync) on all but the last micro-batch."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Batch, no_sync_if
from .single import SingleTrainer


class DDPTrainer(SingleTrainer):
    def wrap(self, module: nn.Module) -> nn.Module:
        ids = [self.ctx.device.index] if self.ctx.is_cuda else None
        return DistributedDataParallel(module, device_ids=ids)

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        with no_sync_if(self.model, skip=not sync):
            return super().forward_backward(batch, sync)
