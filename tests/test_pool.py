"""The rank pool: results come back per rank, failures fail the job with every rank's story, the pool
recovers, and nothing outlives it."""

from __future__ import annotations

import os
import time

import pytest

import rank_jobs
from distbench.config import RunConfig
from distbench.errors import ConfigError, ResourceError
from distbench.jobs.bench import bench
from distbench.jobs.train import train
from distbench.runtime.pool import JobError, PoolManager, RankPool


@pytest.fixture
def pool(_suites) -> RankPool:
    """The session's pool of 2 CPU ranks, which the tier's other tests use too: a pool of its own cost the
    tier a start (5-10 s on 2 cores), and what these tests check holds of any pool a session serves."""
    return _suites("cpu").pool_manager.pool_for(2)


@pytest.fixture(scope="module")
def faulted_pool():
    """A pool of its own for the tests that fault its ranks and see it rebuilt: quick to give up on a failed
    rank (error_grace), and never the session's."""
    p = RankPool(2, "cpu", error_grace=2.0)
    yield p
    p.close()


def _pids(pool: RankPool) -> set[int]:
    return {r["pid"] for r in pool.run(rank_jobs.whoami)}


def test_jobs_run_in_every_rank_and_reuse_the_processes(pool):
    out = pool.run(rank_jobs.whoami)
    assert [r["rank"] for r in out] == [0, 1] and {r["backend"] for r in out} == {"gloo"}
    assert _pids(pool) == {r["pid"] for r in out}, "a second job started new processes"
    assert pool.held_bytes == 0  # every reply says what the rank's tensors hold on its device: none on CPU


@pytest.mark.parametrize(
    ("name", "ac"),
    [
        ("fsdp_full", False),
        ("zero2", False),
        ("zero3", False),
        ("ddp", True),
        pytest.param(
            "zero3",
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="known leak: with activation checkpointing, DeepSpeed 0.19's ZeRO-3 pre- and post-backward "
                "autograd Functions (defined per module in DeepSpeedZeRoOffload._register_deepspeed_module, "
                "closing over it) stay in autograd's graph after close: the engine outlives it (about 2 GiB per "
                "GPT-2 124M configuration on an H200, named by the GPU tier's summary)",
            ),
        ),
    ],
)
def test_a_closed_trainer_frees_its_model(pool, name, ac):
    """A pool serves a whole session: a trainer that outlives close() keeps its GPU memory until an OOM.
    DeepSpeed 0.19's ZeRO-3 keeps every engine reachable from module-level state (11.6 GiB per GPT-2 Large
    configuration on an H200) unless the strategy unhooks it."""
    outlived = pool.run(
        rank_jobs.model_outlives_close, {"strategy": name, "activation_checkpointing": ac}, timeout=120
    )
    assert outlived == [False, False]


def test_a_zero3_build_formats_no_parameter_values(pool):
    """DeepSpeed's ZeRO-3 constructors (the optimizer's and the parameter offload's, which zero3_offload builds
    too) format their locals for a debug line they drop; with every parameter's values in them, that read GPU
    tensors element by element, about half of a warm build on an H200."""
    assert pool.run(rank_jobs.parameter_values_formatted_by_build, {"strategy": "zero3"}, timeout=120) == [
        0,
        0,
    ]


def test_between_jobs_garbage_is_collected_then_the_rest_frozen(pool):
    """The worker freezes what survives a job (so later full collections are cheap), but only after
    collecting the job's garbage: a cycle left behind must not be frozen alive."""
    pool.run(rank_jobs.leave_a_cycle)
    for r in pool.run(rank_jobs.cycle_and_frozen):
        assert not r["cycle_alive"] and r["frozen"] > 10_000


def test_a_job_finds_the_numerics_the_pool_started_with_whatever_the_last_job_set(pool):
    """A job that sets no numerics of its own (an account, a probe) must not run with the kernels the lane's last
    job chose: on 4 H200s an activation account counted 9.03 GiB in one lane order and 5.09 GiB in the
    others, and failed its test."""
    before = pool.run(rank_jobs.numerics)
    during = pool.run(rank_jobs.set_parity_numerics)
    assert during != before, "the parity numerics are the pool's own: this test shows nothing"
    assert pool.run(rank_jobs.numerics) == before


_REGISTRY: dict[str, object] = {}


class _Engine:
    """Stands in for a trainer that a library's module-level state keeps until the next build replaces it."""

    def __init__(self) -> None:
        self.me = self  # a cycle: only a full collection frees it


def test_what_an_earlier_job_left_frozen_is_freed_once_the_device_shows_it(monkeypatch):
    """An engine alive when the worker froze the survivors of its job, and dropped when the next job's build
    replaced it, is garbage no collection of the unfrozen generations frees: on GPUs, each configuration a
    lane's rank ran would leave its gigabytes. Once the device holds LEFTOVER_BYTES more between jobs than
    after the last full collection, the frozen objects are collected too."""
    import gc
    import weakref

    import torch

    from distbench.runtime import worker
    from distbench.runtime.context import RankContext

    engines: list[weakref.ref] = []

    def build() -> None:  # a job: its engine stays registered after it closes, until the next build
        _REGISTRY["engine"] = _Engine()
        engines.append(weakref.ref(_REGISTRY["engine"]))

    monkeypatch.setattr(worker, "_held_floor", 0)
    monkeypatch.setattr(worker, "_device_bytes", lambda ctx: 2**30 * sum(e() is not None for e in engines))
    ctx = RankContext(0, 1, 0, torch.device("cpu"), "gloo")
    try:
        for job in range(3):
            build()
            worker._between_jobs(ctx, lambda: None)
            assert [e() is not None for e in engines] == [False] * job + [True], (
                f"after job {job + 1}, an earlier job's engine still holds the device"
            )
        gc.collect()
        _REGISTRY.clear()
        assert engines[-1]() is not None, "collected without the frozen generation: this test shows nothing"
    finally:
        _REGISTRY.clear()
        gc.unfreeze()


def test_nothing_runs_between_a_kept_trainers_rounds(monkeypatch):
    """Between the rounds of a job that keeps a trainer in the rank (worker.STATE), neither a full collection
    (it left the next round slower and noisier) nor a cache release (the next round would cudaMalloc its
    activations again inside its timing) runs. Once nothing is kept, both do."""
    import torch

    from distbench.runtime import worker
    from distbench.runtime.context import RankContext

    emptied: list[int] = []
    collected: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda device=None: None)
    monkeypatch.setattr(worker.gc, "freeze", lambda: None)
    monkeypatch.setattr(worker.gc, "collect", lambda *a: collected.append(1) or 0)
    ctx = RankContext(0, 1, 0, torch.device("cuda", 0), "nccl")
    monkeypatch.setitem(worker.STATE, "bench", object())
    worker._between_jobs(ctx, lambda: None)
    assert emptied == [], "the kept trainer's cache was given back between its rounds"
    assert collected == [], "a full collection ran between a kept trainer's rounds"
    monkeypatch.delitem(worker.STATE, "bench")
    worker._between_jobs(ctx, lambda: None)
    assert emptied == [1], "nothing is kept, yet the cache stayed"
    assert collected == [1], "nothing is kept, yet the job's garbage stayed"


def _bound_pool_run(monkeypatch, mode: str, job) -> list:
    """`job` in a fresh 2-rank pool under DISTBENCH_BIND_CPUS=mode."""
    monkeypatch.setenv("DISTBENCH_BIND_CPUS", mode)
    p = RankPool(2, "cpu")
    try:
        return p.run(job)
    finally:
        p.close()


@pytest.mark.slow  # a pool of its own (~3 s on 2 cores)
def test_bind_cpus_gives_each_rank_its_own_slice(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    got = _bound_pool_run(monkeypatch, "exclusive", rank_jobs.cpus)
    k = len(allowed) // 2
    assert got == [allowed[:k], allowed[k : 2 * k]]  # disjoint, equal, within what the parent may use


@pytest.mark.slow  # a pool of its own (~3 s on 2 cores)
def test_pinned_binding_puts_the_training_threads_of_a_rank_on_one_cpu(monkeypatch):
    """`distbench ab` interleaves two variants' windows; with their training threads on one core per rank,
    both run on the very same core (runtime/affinity.py)."""
    allowed = sorted(os.sched_getaffinity(0))
    got = _bound_pool_run(monkeypatch, "pinned", rank_jobs.pinned_threads)
    k = len(allowed) // 2
    for rank, r in enumerate(got):
        mine = allowed[rank * k : (rank + 1) * k]
        assert r["cpu"] == mine[0] and r["main"] == r["pt_autograd_0"] == [mine[0]], r
        assert r["other"] == mine  # threads of NCCL, the sampler and the like keep the slice


@pytest.mark.parametrize(
    ("mode", "ranks", "message"),
    [("spread", 2, "not a binding mode"), ("exclusive", 4096, "needs a CPU per rank")],
)
def test_bind_cpus_refuses_bad_settings_before_any_rank_starts(monkeypatch, mode, ranks, message):
    monkeypatch.setenv("DISTBENCH_BIND_CPUS", mode)
    p = RankPool(ranks, "cpu")
    with pytest.raises(ConfigError, match=message):
        p.start()
    assert not p._procs


@pytest.mark.slow  # fault injection: the pool is rebuilt after it (~5 s on 2 cores)
def test_an_exception_reports_the_traceback_and_every_rank(faulted_pool):
    before = _pids(faulted_pool)
    with pytest.raises(JobError) as info:
        faulted_pool.run(rank_jobs.raise_in, {"rank": 1}, timeout=60)
    text = str(info.value)
    assert "rank 1 raised ValueError" in text and "planted failure in rank 1" in text
    assert "===== rank 0:" in text  # the healthy rank's state is reported too
    assert [r["rank"] for r in faulted_pool.run(rank_jobs.whoami)] == [0, 1], "the pool did not recover"
    assert _pids(faulted_pool) != before, "rank 0 was stuck in a barrier: the pool must be rebuilt"


@pytest.mark.slow  # fault injection: the pool is rebuilt after it (~5 s on 2 cores)
def test_a_hang_fails_with_each_ranks_python_stack_and_the_pool_is_rebuilt(faulted_pool):
    with pytest.raises(JobError) as info:
        faulted_pool.run(rank_jobs.hang_in, {"rank": 0}, timeout=2)
    err = info.value
    assert {o.status for o in err.outcomes} == {"timeout"}
    assert "did not finish in 2s" in str(err)
    stacks = {o.rank: o.text for o in err.outcomes}
    assert "planted_hang" in stacks[0], stacks[0]  # faulthandler's stack names the hung function
    assert "barrier" in stacks[1], stacks[1]  # and shows where the other rank waits
    assert [r["rank"] for r in faulted_pool.run(rank_jobs.whoami)] == [0, 1]


@pytest.mark.slow  # fault injection: the pool is rebuilt after it (~3 s on 2 cores)
def test_a_crashed_rank_is_reported_and_the_pool_is_rebuilt(faulted_pool):
    with pytest.raises(JobError) as info:
        faulted_pool.run(rank_jobs.crash_in, {"rank": 1}, timeout=60)
    outcomes = {o.rank: o for o in info.value.outcomes}
    assert outcomes[1].status == "crashed" and "code 17" in outcomes[1].text
    assert [r["rank"] for r in faulted_pool.run(rank_jobs.whoami)] == [0, 1]


def _gone(ctx):
    """A job whose module the ranks cannot import (a file deleted since, say)."""


_gone.__module__ = "no_such_module"


def test_a_job_the_ranks_cannot_import_fails_clearly(pool):
    with pytest.raises(JobError, match="ModuleNotFoundError"):
        pool.run(_gone)


@pytest.mark.parametrize("job", [train, bench])
def test_a_configuration_for_another_world_size_is_refused_by_the_pool(pool, job):
    # a 1-rank configuration in the 2-rank pool would train each rank on a whole global batch and call it one
    cfg = RunConfig(strategy="ddp", world_size=1, model="gpt2-tiny", global_batch=4, micro_batch=2, steps=1)
    with pytest.raises(ConfigError, match="configuration for world size 1 was sent to a pool of 2"):
        pool.run(job, {"cfg": cfg})


@pytest.mark.parametrize("job", [lambda ctx: None, RankPool.close, str.upper])
def test_a_job_ranks_cannot_import_by_name_is_refused(pool, job):
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(job)


@pytest.mark.slow  # a pool of its own (~3 s on 2 cores)
def test_close_leaves_no_process_behind():
    p = RankPool(2, "cpu")
    pids = _pids(p)
    procs = list(p._procs)
    p.close()
    assert not any(proc.is_alive() for proc in procs)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow  # a pool of its own (3 s on 2 cores): the slow tier, which CI runs too
def test_ranks_leave_at_once_when_closed_whatever_threads_a_job_left():
    """A rank ends as soon as its pipe closes: not after the threads and exit hooks a library left behind, which
    Python's exit would wait for until the pool's grace ran out and it killed the rank (a lane waited that long
    for each of its pools at the end of the GPU tier)."""
    from distbench.runtime.pool import _EXIT_GRACE_S

    p = RankPool(2, "cpu")
    p.run(rank_jobs.leave_a_thread_running)
    procs = list(p._procs)
    t0 = time.monotonic()
    p.close()
    took = time.monotonic() - t0
    assert [proc.exitcode for proc in procs] == [0, 0], "a rank was killed, not left on its own"
    assert took < _EXIT_GRACE_S / 2, f"closing took {took:.1f} s"


def test_more_ranks_than_gpus_is_refused_with_the_fix():
    with pytest.raises(ResourceError, match=r"world size 64 needs 64 CUDA devices.*--world-size"):
        PoolManager("cuda").check_world_size(64)


def test_ddp_close_syncs_the_group_only_on_a_clean_exit(monkeypatch):
    """DDP's close ends with a barrier so NCCL lets go of the last all-reduce's buckets (1.3 GiB on an H200),
    after the GPU finished and NCCL's watchdog had time to hand them to the group; while an exception unwinds
    it must not, or a rank whose peers died hangs instead of reporting."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from distbench.strategies import ddp

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(ddp.time, "sleep", lambda s: calls.append(f"sleep {s}"))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    trainer = SimpleNamespace(
        ctx=SimpleNamespace(is_cuda=True, device="cuda:0"), model="wrapper", module="bare module"
    )
    ddp.DDPTrainer.close(trainer)
    assert calls == ["synchronize", f"sleep {ddp.WATCHDOG_PERIODS_S}", "barrier"]
    assert trainer.model == "bare module" and ddp.WATCHDOG_PERIODS_S >= 0.2
    with pytest.raises(RuntimeError, match="a peer died"):
        try:
            raise RuntimeError("a peer died")
        finally:
            ddp.DDPTrainer.close(trainer)
    assert calls.count("barrier") == 1


@pytest.mark.slow
def test_ranks_spawned_on_one_thread_serve_another_and_outlive_it():
    """The session warms the exclusive tests' pools while the lanes end: their ranks are spawned on the
    session's thread and joined and used from a thread that then ends. A rank dies with the thread that
    spawned it (PR_SET_PDEATHSIG), which is why spawn() is apart from start()."""
    import threading

    spawned_here, spawned_there = RankPool(1, "cpu"), RankPool(1, "cpu")
    try:
        spawned_here.spawn()
        threads = [
            threading.Thread(target=spawned_here.run, args=(rank_jobs.whoami,)),
            threading.Thread(target=spawned_there.start),
        ]
        for t in threads:
            t.start()
            t.join(120)
        # the kernel's SIGKILL to the other pool's rank, however busy the host
        deadline = time.monotonic() + 30
        while spawned_there.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not spawned_there.alive, (
            "a rank outlived the thread that spawned it: spawn() need not be apart"
        )
        assert spawned_here.alive and spawned_here.run(rank_jobs.whoami)[0]["rank"] == 0
    finally:
        spawned_here.close()
        spawned_there.close()
