"""The harness-fidelity benchmark (jobs/fidelity.py) on the CPU tier: each strategy's harness and bare loop do
the same work, the overhead is computed as documented, and a cost planted in the harness alone shows in it.
Whether the overhead holds within 1% is the GPU tier's question (tests/test_benchmarks.py)."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Iterator

import pytest
import torch

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.jobs.fidelity import Fidelity, harness_overhead
from distbench.runtime.context import RankContext
from distbench.strategies.single import SingleTrainer
from distbench.testsuite.claims import decide, settle

CPU = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
TINY = RunConfig(strategy="single", model="gpt2-tiny", global_batch=4, micro_batch=2, deterministic=False)


@pytest.mark.strategies("single", "ddp", "fsdp_grad", "fsdp_full", "zero2", "zero3")
@pytest.mark.default_cases("single-ws1", "ddp-ws2", "fsdp_full-ws2", "zero3-ws2")  # a bare loop of each kind
def test_harness_and_bare_loop_do_the_same_work(suite, strategy, world_size):
    """Through the rank pool: the first step's global loss agrees (same weights, data and loss; fp32 on CPU
    agrees to float rounding) and both loops train."""
    if world_size < 2 and strategy != "single":
        pytest.skip("the multi-rank loops run at world size 2 (the CPU tier's budget)")
    # two micro-batches a rank at every world size, so the loops' skipped gradient syncs are exercised
    micro = suite.bench_config(strategy, world_size).micro_batch
    cfg = suite.bench_config(strategy, world_size, global_batch=2 * micro * world_size)
    assert cfg.accum_steps == 2, cfg
    outs = suite.run_job(world_size, harness_overhead, cfg=cfg, steps=2, rounds=2, warmup=1)
    out = outs[0]
    assert (out["strategy"], out["world_size"]) == (strategy, world_size)
    assert all(o["rounds"] == out["rounds"] for o in outs)  # every rank reports the slowest rank's rounds
    first = out["first_step_loss"]
    assert first["bare"] == pytest.approx(first["harness"], rel=1e-5), first
    assert out["bare_tokens_per_s"] > 0 and out["harness_tokens_per_s"] > 0


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test, restored after it whatever its outcome. With the 2 cores
    shared by another job, torch's pool of 2 threads waits on whichever is descheduled: a bare round of the
    planted-cost test's 13 ms step took 26-276 ms (one thread: 13-15 ms), which left its claim undecided in
    most loaded runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_overhead_sees_a_cost_planted_in_the_harness(monkeypatch, one_torch_thread):
    """CPU work added to every harness step (and nowhere in the bare loop) shows as overhead: the benchmark can
    fail. The overhead is the geometric mean over rounds of harness / bare time, minus 1; rounds are added
    until its interval lies wholly above zero, and it reaches half the planted cost. On 2 cores shared with
    another job a round's times spread 0.21-0.51 s, so a fixed 3 rounds could not show it: a claim the noise
    leaves open after the budget is UNDECIDED, not failed. The plant spins rather than sleeps: a loaded host
    stretches a spin as it stretches the bare loop's step, where it stretched 50 ms sleeps up to 20x."""
    delay_s = 0.02
    step_async = SingleTrainer.step_async

    def slow(self, *args, **kwargs):
        end = time.thread_time() + delay_s
        while time.thread_time() < end:
            pass
        return step_async(self, *args, **kwargs)

    monkeypatch.setattr(SingleTrainer, "step_async", slow)
    pair = Fidelity.build(CPU, TINY, steps=2, warmup=1)
    rounds: list[dict[str, float]] = []
    try:

        def draw() -> float:
            """The round's overhead against the plant's own: ln(harness / bare) - ln(1 + plant / bare)."""
            r = pair.rounds(1)[0]
            rounds.append(r)
            return math.log(r["harness_s"] / r["bare_s"]) - math.log1p(pair_steps * delay_s / r["bare_s"])

        pair_steps = len(pair.data)
        d = decide(draw, low=math.log(0.5), first=3, most=20, budget_s=15)
    finally:
        pair.close()
    out = pair.summary(rounds)
    ratios = [r["harness_s"] / r["bare_s"] for r in rounds]
    assert out["overhead"] == pytest.approx(statistics.geometric_mean(ratios) - 1)
    settle(
        d.verdict,
        "the overhead over the planted CPU time (log ratio; at least half of it: > -0.69)",
        d.interval,
    )


@pytest.mark.parametrize("collect", [False, True], ids=["garbage", "garbage-and-a-collect-call"])
def test_the_collector_stays_out_of_the_rounds_but_for_the_calls_a_step_makes(collect):
    """A bare step that leaves cyclic garbage would set off collections inside its timing; the rounds run
    with the collector off (after a collection) and switch it back on. Where the step calls the collector
    itself (DeepSpeed's ZeRO-3 does), that time is its side's own part, and no other's."""
    pair = Fidelity.build(CPU, TINY, steps=1, warmup=1)
    step = pair.bare.step

    def littering(mbs):
        for _ in range(50_000):
            cycle: list = []
            cycle.append(cycle)
        if collect:
            gc.collect()
        return step(mbs)

    pair.bare.step = littering
    try:
        rows = pair.rounds(2)
    finally:
        pair.close()
    assert gc.isenabled()
    assert all((r["bare_gc_s"] > 0) is collect and r["harness_gc_s"] == 0 for r in rows), rows


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
