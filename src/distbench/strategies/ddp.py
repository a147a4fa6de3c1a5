"""`ddp`: DistributedDataParallel, skipping the all-reduce (no_sync) on all but the last micro-batch."""

from __future__ import annotations

import gc
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Batch, no_sync_if
from .single import SingleTrainer

# Two periods of ProcessGroupNCCL's watchdog (kWatchdogThreadSleepMillis = 100 ms): long enough for it to
# have moved every finished all-reduce's tensors to the group, where the next collective releases them.
WATCHDOG_PERIODS_S = 0.25


class DDPTrainer(SingleTrainer):
    def wrap(self, module: nn.Module) -> nn.Module:
        ids = [self.ctx.device.index] if self.ctx.is_cuda else None
        # DDP reduces its first step in one bucket and then rebuilds its buckets in gradient-ready order.
        # A ring all-reduce sums each element in an order set by its offset in the bucket, so at 3+ ranks a
        # run resumed from a checkpoint (old layout on its first step) drifts from the uninterrupted one
        # (rebuilt layout) by an ulp. find_unused_parameters keeps the first layout for good: deterministic
        # configurations use it; measured ones keep DDP's defaults.
        return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=self.cfg.deterministic)

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        with no_sync_if(self.model, skip=not sync):
            return super().forward_backward(batch, sync)

    def close(self) -> None:
        """Give back the gradient buckets. An async all-reduce whose Work is never waited (DDP keeps only its
        future) leaves its tensors on a shelf: NCCL's watchdog, polling every 100 ms, moves a finished Work's
        tensors to its process group, and the group lets them go when it next enqueues a collective. Without
        this, GPT-2 Medium's 1.3 GiB of buckets stayed allocated into the next jobs (H100, H200 at 1 GPU). So:
        drop the wrapper, let the GPU finish, give the watchdog time to move the shelf, then a barrier frees
        it. No barrier while an exception unwinds: the other ranks may never reach it, and this rank must
        report its error."""
        self.model = self.module
        gc.collect()  # DDP's hooks keep it in a reference cycle
        if self.ctx.is_cuda and sys.exc_info()[0] is None:
            torch.cuda.synchronize(self.ctx.device)
            time.sleep(WATCHDOG_PERIODS_S)
            dist.barrier()
