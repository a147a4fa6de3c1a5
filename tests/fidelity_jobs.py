"""Rank jobs that plant a cost in the harness alone, for the harness-fidelity claim's bite on a GPU."""

from __future__ import annotations

from typing import Any

import torch

from distbench.config import RunConfig
from distbench.jobs.fidelity import STATE_KEY, fidelity_setup
from distbench.runtime import worker
from distbench.runtime.context import RankContext


def planted_fidelity_setup(
    ctx: RankContext, cfg: RunConfig, steps: int, fraction: float, warmup: int = 2
) -> dict[str, Any]:
    """fidelity_setup, then extra device work after every harness step (never the bare loop's), sized from two
    measured rounds to `fraction` of the bare loop's step: a harness that costs that much more throughput."""
    out = fidelity_setup(ctx, cfg, steps=steps, warmup=warmup)
    pair = worker.STATE[STATE_KEY]
    bare_step_s = pair.summary(pair.rounds(2))["bare_step_time_s"]
    a = torch.randn(4096, 4096, device=ctx.device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ a
    start.record()
    for _ in range(20):
        a @ a
    end.record()
    end.synchronize()
    per_matmul_s = start.elapsed_time(end) / 1e3 / 20
    n = max(1, round(fraction * bare_step_s / per_matmul_s))
    harness_step = pair.trainer.step_async

    def slower(micro_batches: Any, capture_grads: bool = False) -> torch.Tensor:
        loss = harness_step(micro_batches, capture_grads)
        for _ in range(n):
            a @ a
        return loss

    pair.trainer.step_async = slower  # this pair's trainer only; fidelity_finish closes it
    return {**out, "planted_matmuls": n, "planted_s": n * per_matmul_s, "bare_step_time_s": bare_step_s}
