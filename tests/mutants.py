"""Deliberately broken trainers, run in the rank pool, to prove each invariant's check can fail.

Each mutation breaks one property a real incident breaks, on top of a correct trainer (DDP unless noted):
  no_grad_sync       ranks never all-reduce gradients (replicas silently diverge)
  sum_not_mean       gradients are summed across ranks instead of averaged (a missing 1/world_size)
  sync_every_micro   gradients are all-reduced on every micro-batch (no_sync forgotten)
  fresh_optimizer    a resume restores the model but silently resets the optimizer state (any torch-native
                     trainer, resharding loads included)
  local_norm_clip    gradients clipped by the norm of this rank's own shard instead of the global norm (FSDP2)
  lora_base_trainable  LoRA applied, then the whole model set trainable again before the optimizer is built
                     (any strategy): the base weights train beside the adapters

The rank processes import this module by name: spawned ranks inherit the pytest process's sys.path, on which
pytest puts this directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import distbench.invariants.collectives as collectives
import distbench.runtime.jobs as jobs
import distbench.strategies.lora as lora
from distbench.strategies.ddp import DDPTrainer
from distbench.strategies.fsdp import FSDP2Trainer


def _sum_hook(state, bucket):  # unannotated: DDP rejects the string annotations of `from __future__`
    """DDP comm hook that all-reduces without dividing by the world size."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _mutate(trainer: Any, mutation: str) -> None:
    if mutation == "fresh_optimizer":
        load = trainer.load_checkpoint

        def load_but_reset_optimizer(path: str, **kwargs: Any) -> None:
            load(path, **kwargs)
            trainer.optimizer.state.clear()

        trainer.load_checkpoint = load_but_reset_optimizer
        return
    if mutation == "local_norm_clip":
        assert isinstance(trainer, FSDP2Trainer), "local_norm_clip is written against the FSDP2 strategies"

        def clip_by_local_shard() -> torch.Tensor:
            grads = [p.grad.to_local() for p in trainer.model.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(grads, trainer.cfg.clip_grad_norm)

        trainer.clip_gradients = clip_by_local_shard
        return
    assert isinstance(trainer, DDPTrainer), f"mutation {mutation!r} is written against the ddp strategy"
    if mutation == "no_grad_sync":
        trainer.forward_backward = lambda batch, sync: DDPTrainer.forward_backward(trainer, batch, False)
    elif mutation == "sync_every_micro":
        trainer.forward_backward = lambda batch, sync: DDPTrainer.forward_backward(trainer, batch, True)
    elif mutation == "sum_not_mean":
        trainer.model.register_comm_hook(None, _sum_hook)
    else:
        raise ValueError(f"unknown mutation {mutation!r}")


def _apply_lora_leaving_base_trainable(model: Any, cfg: Any) -> Any:
    return _apply_lora(model, cfg).requires_grad_(True)


_apply_lora = lora.apply_lora


@contextlib.contextmanager
def _mutated(mutation: str) -> Iterator[None]:
    """Every trainer the jobs build while inside is mutated (the modules hold make_trainer by name)."""
    if mutation == "lora_base_trainable":  # before the wrapper and the optimizer see the model
        with mock.patch.object(lora, "apply_lora", _apply_lora_leaving_base_trainable):
            yield
        return

    def make(ctx: Any, cfg: Any) -> Any:
        trainer = original(ctx, cfg)
        _mutate(trainer, mutation)
        return trainer

    original = jobs.make_trainer
    jobs.make_trainer = collectives.make_trainer = make
    try:
        yield
    finally:
        jobs.make_trainer = collectives.make_trainer = original


def train(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, Any]:
    with _mutated(mutation):
        return jobs.train(ctx, **kwargs)


def count_collectives(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, float]:
    with _mutated(mutation):
        return collectives.count_collectives(ctx, **kwargs)
