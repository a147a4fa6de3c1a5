"""Performance benchmarks, recorded through pytest-benchmark.

Each optimizer step is one `benchmark.pedantic` round: the pytest process asks the warm ranks for one
synchronized step, so pytest-benchmark's statistics are real step times (plus a sub-millisecond round
trip); the in-rank step times and every other metric go to `extra_info`, so `--benchmark-json` and
`--benchmark-autosave` keep them. On GPUs: bf16, sequence 1024, micro-batch 8 per GPU.
"""

from __future__ import annotations

import math

import pytest

from distbench.gate.stats import paired_effect
from distbench.jobs.bench import bench_finish, bench_setup, bench_step, collective_bandwidth
from distbench.jobs.fidelity import harness_overhead
from distbench.matrix import run_benchmark, sweep_micro_batch
from distbench.results import summarize_bench
from distbench.runtime.fingerprint import environment_fingerprint
from distbench.strategies import default_strategies

#: Every test here times steps or reads memory: under lanes they run last, with nothing else on the machine.
pytestmark = pytest.mark.exclusive

SEED_STRATEGIES = default_strategies("cuda")  # seed 004's, the GPU default grid


@pytest.mark.strategies(*SEED_STRATEGIES)
def test_step_time(benchmark, suite, strategy, world_size, save_result):
    cfg = suite.bench_config(strategy, world_size)
    suite.run_job(world_size, bench_setup, cfg=cfg)
    finished = False
    try:
        benchmark.pedantic(suite.run_job, args=(world_size, bench_step), rounds=cfg.steps, iterations=1)
        replies = suite.run_job(world_size, bench_finish)
        finished = True
    finally:
        if not finished:  # free the kept trainer; the original error is the one to report
            try:
                suite.run_job(world_size, bench_finish)
            except Exception:
                pass
    result = summarize_bench(cfg, replies, env=environment_fingerprint())
    save_result(result)
    benchmark.extra_info.update(result["metrics"])
    benchmark.extra_info.update(
        config=result["config"],
        step_time_s=result["step_time_s"],
        throttled=bool((result.get("nvml") or {}).get("throttled")),
    )
    assert result["metrics"]["tokens_per_s"] > 0
    assert all(math.isfinite(x) for x in result["losses"]), result["losses"]


@pytest.mark.strategies("ddp", "fsdp_full", "zero3")
def test_pool_overhead_per_configuration(suite, strategy, world_size):
    """Once the pool is warm a configuration costs its steps plus at most 3 s (build, wrap, teardown)."""
    cfg = suite.bench_config(
        strategy, world_size, model=None if suite.device_type == "cpu" else "gpt2-large", steps=3, warmup=1
    )
    pool = suite.pool_manager.pool_for(world_size)
    run_benchmark(pool, cfg, nvml=False)  # warm the pool and the imports
    result = run_benchmark(pool, cfg, nvml=False)
    assert result["status"] == "ok", result.get("error")
    overhead = result["metrics"]["config_overhead_s"]
    print(f"{strategy} ws{world_size} {cfg.model}: wall {result['wall_s']:.2f}s, overhead {overhead:.2f}s")
    assert overhead <= 3.0, f"{strategy} ws{world_size}: {overhead:.2f}s of overhead per configuration"


#: How far apart the first-step losses of the harness and its bare loop may be under bf16: the same kernels on
#: the same weights and data, but non-deterministic ones (atomics) and bf16's 2**-8 rounding.
BF16_FIRST_LOSS_RTOL = 1e-2


@pytest.mark.gpu
@pytest.mark.strategies("single", "ddp", "fsdp_grad", "zero2", "zero3")
def test_harness_overhead_at_most_1_percent(suite, strategy, world_size):
    """The harness's timed loop against a bare loop of the same strategy doing the same work, same ranks: 16
    samples of 1024 tokens of GPT-2 Large per rank a step in 2 micro-batches, so the skipped gradient syncs
    are timed too. The bound holds only where the overhead's 95% interval lies under 1%: a noisy step fails
    as undecided rather than passing on a lucky median (fsdp_grad at world size 1 on one H200: rounds of
    2.3-3.0 s, median ratio +3.4%)."""
    cfg = suite.bench_config(
        strategy, world_size, model="gpt2-large", micro_batch=8, global_batch=16 * world_size
    )
    out = suite.run_job(world_size, harness_overhead, cfg=cfg, steps=6, rounds=11)[0]
    print(out)
    first = out["first_step_loss"]
    assert first["bare"] == pytest.approx(first["harness"], rel=BF16_FIRST_LOSS_RTOL), first
    bare, harness = ([r[k] for r in out["rounds"]] for k in ("bare_s", "harness_s"))
    e = paired_effect(bare, harness, 0.05)  # 95%: the harness's throughput cost, from paired rounds
    effect = f"{e.estimate:+.2%} [{e.low:+.2%}, {e.high:+.2%}]"
    assert e.low <= 0.01, f"{strategy} ws{world_size}: the harness costs {effect} throughput"
    assert e.high <= 0.01, (
        f"{strategy} ws{world_size}: UNDECIDED, the overhead {effect} may exceed 1%: the rounds are too noisy "
        f"to bound it (is the step host-bound here?): {out['rounds']}"
    )


def test_collective_bandwidth(suite, world_size):
    if world_size < 2:
        pytest.skip("bus bandwidth needs at least 2 ranks")
    sizes = [2**16, 2**20] if suite.device_type == "cpu" else [2**20, 2**24, 2**28, 2**30]
    out = suite.run_job(world_size, collective_bandwidth, sizes_bytes=sizes)[0]
    print(out)
    rows = out["results"]
    assert rows and all(r["busbw_gbps"] > 0 for r in rows)
    ceiling = out.get("ceiling_gbps")
    if ceiling:
        assert max(r["busbw_gbps"] for r in rows) <= 1.1 * ceiling


@pytest.mark.gpu
def test_micro_batch_sweep_to_oom(suite, save_result):
    """Throughput and memory per micro-batch size up to the OOM boundary; the pool survives the OOM."""
    cfg = suite.bench_config(
        "single", 1, model="gpt2-large", micro_batch=8, global_batch=8, steps=3, warmup=1
    )
    results = sweep_micro_batch(suite.pool_manager.pool_for(1), cfg, [8, 16, 32, 64, 128, 256])
    for r in results:
        save_result(r)
        m = r["metrics"]
        print(
            r["config"]["micro_batch"], r["status"], m.get("tokens_per_s"), m.get("mem_reserved_peak_bytes")
        )
    assert results[-1]["status"] == "oom", "no micro-batch size ran out of memory: extend the sweep"
    assert any(r["status"] == "ok" for r in results)
    after = run_benchmark(suite.pool_manager.pool_for(1), cfg)
    assert after["status"] == "ok", "the pool did not survive the OOM"
