"""A rank job that trains with a delay injected before collectives or the optimizer step, the way PyTorch's own
FSDP tests do (torch.testing._internal.common_fsdp: patch_all_gather / patch_reduce_scatter with a
torch.cuda._sleep before the real call): a strategy that reads a buffer before the collective filling it has
finished, or steps on gradients still being reduced, gets different numbers once the collective is late.

The rank processes import this module by name from the pytest process's sys.path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any
from unittest import mock

import torch.distributed as dist

import distbench.jobs.train as jobs
from distbench.config import RunConfig
from distbench.runtime.context import RankContext
from distbench.strategies import get_spec
from distbench.strategies.base import Trainer
from metric_jobs import delay, spin_rate

SITES = ("all_gather", "reduce_scatter", "optimizer_step")

#: The collectives each strategy family issues, by the module attribute it looks them up through at call
#: time. FSDP2 calls torch.distributed.all_gather_single / reduce_scatter_single (torch 2.13; PyTorch's tests
#: patch those), older torch all_gather_into_tensor / reduce_scatter_tensor; ZeRO-3 goes through
#: deepspeed.comm (allgather_fn, all_gather_into_tensor, reduce_scatter_fn as of DeepSpeed 0.19).
COLLECTIVES: dict[str, dict[str, tuple[str, ...]]] = {
    "fsdp": {
        "all_gather": ("all_gather_single", "all_gather_into_tensor"),
        "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    },
    "deepspeed": {
        "all_gather": ("allgather_fn", "all_gather_into_tensor", "all_gather_coalesced"),
        "reduce_scatter": ("reduce_scatter_fn", "reduce_scatter_tensor", "reduce_scatter_coalesced"),
    },
}
#: A planted defect: the names PyTorch's tests patched before FSDP2 moved to the *_single collectives, which
#: on torch 2.13 delay nothing.
LEGACY_FSDP = {"all_gather": ("all_gather_into_tensor",), "reduce_scatter": ("reduce_scatter_tensor",)}


def _module(family: str) -> ModuleType:
    if family == "deepspeed":
        import deepspeed.comm

        return deepspeed.comm
    return dist


def train_with_delays(
    ctx: RankContext, cfg: RunConfig, sites: list[str], delay_s: float, plant: str | None = None
) -> dict[str, Any]:
    """jobs.train.train with a delay of `delay_s` (a device-side spin on GPU, timed by spin_rate; a host
    sleep on CPU) before every call at each of `sites`; the reply adds {"delays": {site: calls delayed}}.
    plant "legacy_names": FSDP2's collectives patched under their pre-2.1x names only."""
    family = get_spec(cfg.strategy).trainer_module
    unknown = set(sites) - set(SITES)
    if unknown or family not in COLLECTIVES:
        raise ValueError(f"delays at {sites} are written for FSDP2 and ZeRO, not {cfg.strategy}")
    rate = spin_rate(ctx.device) if ctx.is_cuda else None
    fired = dict.fromkeys(sites, 0)

    def delayed(site: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            fired[site] += 1
            delay(ctx, delay_s, rate)
            return real(*args, **kwargs)

        return call

    names = LEGACY_FSDP if plant == "legacy_names" else COLLECTIVES[family]
    if plant not in (None, "legacy_names"):
        raise ValueError(f"unknown plant {plant!r}")
    module = _module(family)
    real_make = jobs.make_trainer

    def make(ctx_: RankContext, rc_: RunConfig) -> Trainer:
        trainer = real_make(ctx_, rc_)
        trainer.optimizer_step = delayed("optimizer_step", trainer.optimizer_step)  # type: ignore[method-assign]
        return trainer

    with contextlib.ExitStack() as stack:
        for site in sites:
            if site == "optimizer_step":
                stack.enter_context(mock.patch.object(jobs, "make_trainer", make))
                continue
            for name in names[site]:
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, delayed(site, getattr(module, name))))
        out = jobs.train(ctx, cfg)
    return {**out, "delays": fired}
