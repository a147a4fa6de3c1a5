"""Rank jobs that measure what measure/ reports by other means, for tests/test_metric_truth.py.

The rank processes import this module by name: spawned ranks inherit the pytest process's sys.path, on which
pytest puts this directory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import distbench.measure.bench as bm
from distbench.config import RunConfig
from distbench.runtime.context import RankContext
from distbench.runtime.jobs import make_trainer, seq_len_of
from distbench.strategies.base import Trainer
from distbench.workloads.data import rank_micro_batches
from distbench.workloads.models import get_model
from mutants import _mutate


@contextlib.contextmanager
def _planted(plant: str | None) -> Iterator[None]:
    """A defect planted in the ranks, to show the checks that use these jobs can fail.

    first_micro_batch_only: each step trains on its first micro-batch and drops the rest (accumulation
    silently skipped), while the result still claims the configured global batch.
    """
    if plant is None:
        yield
        return
    if plant != "first_micro_batch_only":
        raise ValueError(f"unknown plant {plant!r}")
    real = bm.rank_micro_batches
    with mock.patch.object(bm, "rank_micro_batches", lambda *a, **k: real(*a, **k)[:1]):
        yield


def counted_bench(ctx: RankContext, cfg: dict[str, Any], plant: str | None = None) -> dict[str, Any]:
    """The `bench` job, with the model's input tokens counted by a forward hook and every time_window call
    timed by a clock of its own: {"reply": bench's reply, "windows": [{"tokens", "seconds"}, ...]} with one
    entry per window, warm-up first."""
    seen = [0]
    windows: list[dict[str, float]] = []

    def count(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        seen[0] += ids.numel()

    real_build, real_window = bm.build_trainer, bm.time_window

    def build(ctx_: RankContext, rc: RunConfig, model: nn.Module) -> Trainer:
        model.register_forward_pre_hook(count, with_kwargs=True)
        return real_build(ctx_, rc, model)

    def window(ctx_: RankContext, timing: str, steps: Any) -> Any:
        before, t0 = seen[0], time.perf_counter()
        w = real_window(ctx_, timing, steps)
        windows.append({"tokens": seen[0] - before, "seconds": time.perf_counter() - t0})
        return w

    with _planted(plant), mock.patch.object(bm, "build_trainer", build), \
            mock.patch.object(bm, "time_window", window):
        reply = bm.bench(ctx, cfg, nvml=False)
    return {"reply": reply, "windows": windows}


def _flat_grads(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None])


def _ranks_agree(ctx: RankContext, x: torch.Tensor) -> bool:
    """Whether every rank holds exactly the same tensor."""
    got = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(got, x)
    return all(torch.equal(got[0], g) for g in got[1:])


def grads_across_accumulation(ctx: RankContext, cfg: dict[str, Any], mutation: str | None = None) -> dict[str, bool]:
    """Whether the ranks' gradients agree after each micro-batch of one optimizer step, read in the ranks.

    Each rank sees different samples, so gradients agree only once they have been communicated: a strategy
    that skips the sync on all but the last micro-batch disagrees before it and agrees after. `mutation`
    names a trainer defect from tests/mutants.py.
    """
    rc = RunConfig.from_dict(cfg)
    trainer = make_trainer(ctx, rc)
    if mutation:
        _mutate(trainer, mutation)
    try:
        mbs = rank_micro_batches(rc, 0, ctx.rank, seq_len_of(rc), get_model(rc.model).vocab_size, ctx.device)
        agree = []
        for i, mb in enumerate(mbs):
            trainer.forward_backward(mb, sync=i == len(mbs) - 1)
            agree.append(_ranks_agree(ctx, _flat_grads(trainer)))
        return {"agree_after_each_micro_batch": agree}
    finally:
        trainer.close()
