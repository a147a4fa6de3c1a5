"""The harness-fidelity benchmark (jobs/fidelity.py) on the CPU tier: each strategy's harness and bare loop do
the same work, the overhead is computed as documented, and a cost planted in the harness alone shows in it.
Whether the overhead holds within 1% is the GPU tier's question (tests/test_benchmarks.py)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.gate.stats import paired_effect
from distbench.jobs.fidelity import harness_overhead
from distbench.runtime.context import RankContext
from distbench.strategies.single import SingleTrainer

CPU = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
TINY = RunConfig(strategy="single", model="gpt2-tiny", global_batch=4, micro_batch=2, deterministic=False)


@pytest.mark.strategies("single", "ddp", "fsdp_grad", "fsdp_full", "zero2", "zero3")
def test_harness_and_bare_loop_do_the_same_work(suite, strategy, world_size):
    """Through the rank pool: the first step's global loss agrees (same weights, data and loss; fp32 on CPU
    agrees to float rounding) and both loops train."""
    if world_size < 2 and strategy != "single":
        pytest.skip("the multi-rank loops run at world size 2 (the CPU tier's budget)")
    cfg = suite.bench_config(strategy, world_size)
    assert cfg.accum_steps > 1  # the loops' skipped gradient syncs are exercised
    outs = suite.run_job(world_size, harness_overhead, cfg=cfg, steps=2, rounds=2, warmup=1)
    out = outs[0]
    assert (out["strategy"], out["world_size"]) == (strategy, world_size)
    assert all(o["rounds"] == out["rounds"] for o in outs)  # every rank reports the slowest rank's rounds
    first = out["first_step_loss"]
    assert first["bare"] == pytest.approx(first["harness"], rel=1e-5), first
    assert out["bare_tokens_per_s"] > 0 and out["harness_tokens_per_s"] > 0


def test_overhead_sees_a_cost_planted_in_the_harness(monkeypatch):
    """A sleep added to every harness step (and nowhere in the bare loop) shows as overhead: the benchmark can
    fail. The overhead is the geometric mean over rounds of harness / bare time, minus 1, and its interval
    excludes zero."""
    delay_s = 0.05
    step_async = SingleTrainer.step_async

    def slow(self, *args, **kwargs):
        time.sleep(delay_s)
        return step_async(self, *args, **kwargs)

    monkeypatch.setattr(SingleTrainer, "step_async", slow)
    out = harness_overhead(CPU, TINY, steps=2, rounds=3, warmup=1)
    ratios = [r["harness_s"] / r["bare_s"] for r in out["rounds"]]
    assert out["overhead"] == pytest.approx(statistics.geometric_mean(ratios) - 1)
    bare, harness = ([r[k] for r in out["rounds"]] for k in ("bare_s", "harness_s"))
    assert paired_effect(bare, harness, 0.05).low > 0, out  # the interval the GPU tier's bound reads
    planted = delay_s / out["bare_step_time_s"]
    assert out["overhead"] >= 0.5 * planted, (out["overhead"], planted, out["rounds"])


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"strategy": "fsdp_hybrid"}, "no bare loop for 'fsdp_hybrid'"),
        ({"clip_grad_norm": 1.0}, "clip_grad_norm=1.0"),
        ({"deterministic": True}, "deterministic=True"),
        ({"world_size": 2}, "run it in a pool of 2"),
    ],
)
def test_configurations_without_a_bare_twin_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        harness_overhead(CPU, TINY.replace(**changes), steps=1)
