"""Any rank of any world size in this one process: torch's fake process group (FakeStore), whose collectives
return at once and move no data. What a rank builds on its own is real (its device mesh, its shards of each
parameter, on the meta device for a model too large for this machine); what it computes with the others is not,
so losses and gradients under it mean nothing (docs/scale.md, fake ranks in one process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from distbench.config import RunConfig
from distbench.runtime.context import RankContext
from distbench.strategies import build_trainer
from distbench.strategies.base import Trainer
from distbench.workloads import get_model


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of `world_size` in a fake default process group, for the block's duration."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def trainer_at(cfg: RunConfig, rank: int, nodes: int = 1, device: str = "cpu") -> Iterator[Trainer]:
    """cfg's trainer as rank `rank` of cfg.world_size across `nodes` nodes builds it (the strategy's own code),
    its model built on `device` ("meta": no memory)."""
    with fake_rank(rank, cfg.world_size):
        ctx = RankContext(rank, cfg.world_size, 0, torch.device("cpu"), "fake", nodes=nodes)
        trainer = build_trainer(ctx, cfg, get_model(cfg.model).build(cfg.seed, device))
        try:
            yield trainer
        finally:
            trainer.close()


def fsdp2_state_bytes(trainer: Trainer) -> dict[str, int]:
    """An FSDP2 rank's training state as FSDP2 lays it out: its padded shard of every parameter (the storage
    fully_shard allocated), a gradient the shape of each local shard, and AdamW's two moments like it."""
    padded = local = 0
    for module in trainer.model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else []:
                padded += param._sharded_param_data.numel() * param._sharded_param_data.element_size()
                shard = param.sharded_param.to_local()
                local += shard.numel() * shard.element_size()
    return {"params": padded, "grads": local, "optimizer": 2 * local}
