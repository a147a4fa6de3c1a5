"""The jobs the correctness checks run in the ranks: the independent reference, collectives counted and
recorded, the training state's memory. The checks' own rules and models stay in distbench/invariants."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ..config import LocalPath, RunConfig
from ..invariants.collectives import CollectiveRecorder, collectives_per_step, op_names, profiled_kinds
from ..invariants.reference import reference_run
from ..invariants.regime import DtypeRecorder, regime_of
from ..runtime.context import RankContext
from ..runtime.shelf import save_tensors
from ..workloads import get_model
from .train import make_trainer, run_steps


def reference_job(
    ctx: RankContext, cfg: RunConfig, keep_tensors_at: LocalPath | None = None
) -> dict[str, Any]:
    """The reference (world size 1) in a pool rank, so it runs on the same device type as the strategies.
    With `keep_tensors_at` its tensors (parameters, gradients, LoRA's initial and merged weights) go to that
    safetensors file (runtime/shelf.py) instead of through the pipe."""
    t0 = time.perf_counter()
    out = reference_run(cfg, ctx.device)
    if keep_tensors_at:
        save_tensors(keep_tensors_at, {k: v for k, v in out.items() if isinstance(v, dict)})
        out = {k: v for k, v in out.items() if not isinstance(v, dict)}
    return {**out, "phases": {"reference run": time.perf_counter() - t0}}


def initial_weights_job(ctx: RankContext, cfg: RunConfig, keep_tensors_at: LocalPath) -> dict[str, Any]:
    """The model's weights before training as a rank builds them (on its device, from cfg's seed), written to
    a safetensors file under "initial"."""
    model = get_model(cfg.model).build(cfg.seed, ctx.device)
    save_tensors(keep_tensors_at, {"initial": {k: v.detach().cpu() for k, v in model.state_dict().items()}})
    return {}


def count_collectives(ctx: RankContext, cfg: RunConfig, steps: int = 2) -> dict[str, float]:
    """Collectives per optimizer step, by kind, over `steps` steps after one untimed step (see
    invariants/collectives.py)."""
    trainer = make_trainer(ctx, cfg)
    try:
        run_steps(ctx, trainer, cfg, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(ctx, trainer, cfg, 1 + steps)
    finally:
        trainer.close()
    return collectives_per_step(op_names(prof), steps, ctx.world_size)


#: Steps before a strategy's collectives repeat step after step: DDP rebuilds its buckets after its first step,
#: ZeRO-3 records its modules' order in its first step and broadcasts it in its second (seen on gloo).
SETTLE_STEPS = 2


def record_collectives(ctx: RankContext, cfg: RunConfig, steps: int = 1) -> dict[str, Any]:
    """Every collective of `steps` optimizer steps as invariants/collectives.py describes it: {"steps": one list
    of calls a step, "profiled": the collectives by kind the profiler counted in the step before them}, after
    SETTLE_STEPS untimed steps."""
    trainer = make_trainer(ctx, cfg)
    recorded = []
    try:
        run_steps(ctx, trainer, cfg, SETTLE_STEPS)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(ctx, trainer, cfg, SETTLE_STEPS + 1)
        for step in range(steps):
            with CollectiveRecorder() as recorder:
                run_steps(ctx, trainer, cfg, SETTLE_STEPS + 2 + step)
            recorded.append(recorder.calls)
    finally:
        trainer.close()
    return {"steps": recorded, "profiled": profiled_kinds(op_names(prof))}


def record_regime(ctx: RankContext, cfg: RunConfig) -> dict[str, list[str]]:
    """The precision regime of one optimizer step of cfg's strategy (invariants/regime.py): the dtypes its
    matmuls compute in, its layer norms see and its trained module's parameters are held in."""
    trainer = make_trainer(ctx, cfg)
    try:
        with DtypeRecorder() as recorder:
            run_steps(ctx, trainer, cfg, 1)
        return regime_of(recorder.seen, list(trainer.trained_module().parameters()))
    finally:
        trainer.close()


def state_memory(ctx: RankContext, cfg: RunConfig) -> dict[str, Any]:
    """Allocator bytes of this rank's training state, measured around the optimizer step of step 2."""
    if not ctx.is_cuda:
        raise RuntimeError("state_memory reads the CUDA caching allocator: run it on the GPU tier")
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(ctx.device)
    trainer = make_trainer(ctx, cfg)
    marks: dict[str, int] = {}
    original = trainer.optimizer_step

    def probed() -> None:
        torch.cuda.synchronize(ctx.device)
        marks["before_optimizer_step"] = torch.cuda.memory_allocated(ctx.device) - base
        original()
        torch.cuda.synchronize(ctx.device)
        marks["after_optimizer_step"] = torch.cuda.memory_allocated(ctx.device) - base

    trainer.optimizer_step = probed  # type: ignore[method-assign]
    try:
        run_steps(ctx, trainer, cfg, 2)  # step 1 creates the optimizer state; step 2 is measured
    finally:
        trainer.close()
        original = None  # type: ignore[assignment]  # the probe's closure reaches the trainer through it
        del trainer, probed  # a cycle through the probe: freed below
    gc.collect()
    torch.cuda.empty_cache()
    end = torch.cuda.memory_allocated(ctx.device)
    # Memory an earlier job left allocated and this one freed (on 4 H200s, after a DDP job: 0.55 GiB) was
    # counted in `base` but not in the marks, so state looked 0.55 GiB smaller than it is. What is still
    # allocated once this job's trainer is gone bounds the baseline from above.
    if end < base:
        marks = {k: v + base - end for k, v in marks.items()}
    n = get_model(cfg.model).param_count()
    return {
        "rank": ctx.rank,
        "n_params": n,
        "baseline_bytes": base,
        "left_after_close_bytes": max(0, end - base),
        **marks,
    }
