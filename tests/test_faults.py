"""Faults planted from outside the pool, at every phase of a rank's life, and the pool's own process killed:
each fault fails its job within a stated bound with every rank's story, the next job passes on a rebuilt
pool, and nothing is left behind (processes, distbench temp dirs, shared memory). Three of them also on two
GPUs over NCCL (`pytest -m "gpu and slow" tests/test_faults.py`): a rank killed inside an all-reduce, one that
stops answering, one that raises in the middle of a step; there nothing may be left on the GPUs either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

import rank_jobs
from distbench.runtime.pool import (
    STACK_WAIT_S,
    JobError,
    PoolManager,
    RankPool,
    _proc_state,
    cuda_device_count,
)
from leftovers import TAG_ENV, held_shm, new_tag, shm_entries, tagged_processes, wait_clean

pytestmark = pytest.mark.slow  # ranks killed and frozen at every phase: about a minute on 2 cores

TIMEOUT = 3.0  # of every faulted job, and so of a faulted start
JOIN_TIMEOUT = 8.0  # the join cases need the ranks to reach init_process_group first (imports)
GRACE = 1.0  # how long the other ranks get once one failed
MARGIN = STACK_WAIT_S + 4.0  # asking for stacks, closing the pool by SIGKILL, a loaded 2-core machine
REPLY_BYTES = 64 << 20


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory):
    """One PoolManager for every case (as a session has), its ranks tagged, its temp files in a private dir."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    tag = new_tag()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TAG_ENV, tag)
        mp.setenv("TMPDIR", str(tmp))
        mp.setattr(tempfile, "tempdir", None)
        pm = PoolManager("cpu", error_grace=GRACE)
        yield SimpleNamespace(pm=pm, tag=tag, tmp=tmp, shm=shm_entries())
        pm.close_all()


def _tracker() -> set[int]:
    """The stdlib's resource tracker lives as long as this process, whoever started it."""
    from multiprocessing import resource_tracker

    pid = resource_tracker._resource_tracker._pid
    return {pid} if pid else set()


def _when(pool: RankPool, ready: Callable[[], bool], act: Callable[[], None]) -> threading.Thread:
    def watch() -> None:
        end = time.monotonic() + 60
        while not ready() and time.monotonic() < end:
            time.sleep(0.001)
        act()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _kill(pool: RankPool, rank: int, sig: int) -> None:
    os.kill(pool._procs[rank].pid, sig)


def at_spawn(f, sig: int) -> dict:
    """The rank is signalled as soon as it exists: in the spawn bootstrap, before it joins the group."""
    pool = f.pm.pool_for(2)
    pool.close()
    t = _when(pool, lambda: len(pool._procs) > 1, lambda: _kill(pool, 1, sig))
    return {
        "start": lambda: f.pm.pool_for(2).run(rank_jobs.whoami, timeout=TIMEOUT),
        "thread": t,
        "victim": 1,
    }


def at_join(f, sig: int) -> dict:
    """Rank 1 is held stopped from its spawn; rank 0 is signalled once it wrote to the rendezvous store,
    i.e. while it waits inside init_process_group for rank 1."""
    pool = f.pm.pool_for(2)
    pool.close()

    def act() -> None:
        _kill(pool, 1, signal.SIGSTOP)
        end = time.monotonic() + 60
        while (pool._store is None or pool._store.num_keys() == 0) and time.monotonic() < end:
            time.sleep(0.005)
        _kill(pool, 0, sig)

    t = _when(pool, lambda: len(pool._procs) > 1, act)
    return {
        "start": lambda: f.pm.pool_for(2).run(rank_jobs.whoami, timeout=JOIN_TIMEOUT),
        "thread": t,
        "victim": 0,
        "timeout": JOIN_TIMEOUT,
    }


def mid_job(f, sig: int) -> dict:
    f.pm.pool_for(2).run(rank_jobs.whoami, timeout=60)  # a warm pool
    return {
        "start": lambda: f.pm.pool_for(2).run(
            rank_jobs.signal_self_in, {"rank": 1, "signum": sig}, timeout=TIMEOUT
        ),
        "victim": 1,
    }


def mid_reply(f, sig: int) -> dict:
    f.pm.pool_for(2).run(rank_jobs.whoami, timeout=60)
    kw = {"rank": 1, "signum": sig, "size": REPLY_BYTES}
    return {
        "start": lambda: f.pm.pool_for(2).run(rank_jobs.signal_self_mid_reply, kw, timeout=TIMEOUT),
        "victim": 1,
    }


def idle(f, sig: int) -> dict:
    """Between two jobs: the next job finds the rank dead or frozen."""
    pid = f.pm.pool_for(2).run(rank_jobs.whoami, timeout=60)[1]["pid"]
    os.kill(pid, sig)
    end = time.monotonic() + 10  # signals land asynchronously: wait until this one did
    while time.monotonic() < end and not (
        _proc_state(pid) == "T"
        if sig == signal.SIGSTOP
        else os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    ):
        time.sleep(0.005)
    return {"start": lambda: f.pm.pool_for(2).run(rank_jobs.whoami, timeout=TIMEOUT), "victim": 1}


KILLED = ("crashed", "code -9")
STOPPED = ("timeout", "is stopped")


#: Per submission every phase is faulted once or twice and each way (killed, frozen) at three phases or more; these
#: four repeat a phase with the other signal and run nightly.
NIGHTLY_FAULTS = {"at_spawn-frozen", "at_join-killed", "mid_reply-killed", "idle-frozen"}


@pytest.mark.parametrize(
    ("phase", "sig", "victim_story"),
    [
        pytest.param(
            phase,
            sig,
            story,
            id=f"{phase.__name__}-{how}",
            marks=[pytest.mark.nightly] if f"{phase.__name__}-{how}" in NIGHTLY_FAULTS else [],
        )
        for phase in (at_spawn, at_join, mid_job, mid_reply, idle)
        for sig, story, how in ((signal.SIGKILL, KILLED, "killed"), (signal.SIGSTOP, STOPPED, "frozen"))
    ],
)
def test_a_rank_killed_or_frozen_fails_its_job_in_time_and_the_next_passes(faults, phase, sig, victim_story):
    case = phase(faults, sig)
    t0 = time.monotonic()
    with pytest.raises(JobError) as info:
        case["start"]()
    took = time.monotonic() - t0
    if "thread" in case:
        case["thread"].join(5)
    bound = case.get("timeout", TIMEOUT) + MARGIN
    assert took < bound, f"the fault took {took:.1f}s to be reported (bound {bound:.0f}s)"
    err = info.value
    outcomes = {o.rank: o for o in err.outcomes}
    assert sorted(outcomes) == [0, 1], "every rank's story"
    status, text = victim_story
    victim = outcomes[case["victim"]]
    assert victim.status == status and text in victim.text, str(err)
    for o in err.outcomes:
        if o.status != "ok":
            assert o.text.strip(), f"rank {o.rank} ended {o.status} with no word on where or why:\n{err}"
    assert [r["rank"] for r in faults.pm.pool_for(2).run(rank_jobs.whoami, timeout=60)] == [0, 1]
    pool = faults.pm.pool_for(2)
    alive = {p.pid for p in pool._procs}
    assert faults.pm.pool_for(2).alive
    assert not held_shm(alive), "ranks on gloo need no shared memory: whatever they map can leak"
    left = wait_clean(faults.tag, faults.tmp, faults.shm, keep=alive | _tracker(), within=5.0)
    assert not left, f"left behind: {left}"


def test_a_frozen_rank_that_replaced_the_stack_signal_says_why_no_stack(faults):
    """A rank whose SIGUSR1 handler was replaced cannot be asked for its stack: the entry says so."""
    faults.pm.pool_for(2).run(rank_jobs.whoami, timeout=60)
    with pytest.raises(JobError) as info:
        faults.pm.pool_for(2).run(rank_jobs.replace_stack_handler_and_hang, {"rank": 1}, timeout=TIMEOUT)
    text = {o.rank: o.text for o in info.value.outcomes}
    assert "rank 1 did not answer the stack-dump signal" in text[1] and "handler" in text[1], text[1]
    assert "barrier" in text[0], text[0]


PARENT = """
from distbench.runtime.pool import RankPool
if __name__ == "__main__":
    pool = RankPool(2, "cpu")
    pool.start()
    print("ready", flush=True)
    pool.run(rank_jobs.hang_in, {"rank": 0}, timeout=600)
"""


def _rank_pids(tag: str) -> set[int]:
    return {pid for pid, cmd in tagged_processes(tag).items() if "spawn_main" in cmd}


@pytest.mark.parametrize("phase", ["spawn", "job"])
def test_ranks_do_not_outlive_a_killed_parent(tmp_path: Path, phase: str):
    """SIGKILL of the pool's process (no cleanup runs) while ranks spawn or run a job: they go too."""
    tag = new_tag()
    src = Path(__file__).parent
    env = {
        **os.environ,
        TAG_ENV: tag,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(src.parent / "src"), str(src), os.environ.get("PYTHONPATH", "")]),
    }
    shm = shm_entries()
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if phase == "spawn":
            end = time.monotonic() + 60
            while not _rank_pids(tag) and time.monotonic() < end:
                time.sleep(0.001)
        else:
            assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
            time.sleep(0.5)
        assert _rank_pids(tag), "no rank was started"
    finally:
        parent.kill()
        parent.wait()
    left = wait_clean(tag, tmp_path, shm, within=10.0)
    assert not left, f"left behind after the parent was killed during {phase}: {left}"


#: The job timeout of a faulted job on each device: a NCCL job also connects its communicator on first use.
DEVICE_TIMEOUT = {"cpu": TIMEOUT, "cuda": 30.0}
#: (job, its arguments, the victim's status and a phrase of its story): rank 1 is the victim.
IN_A_JOB = {
    "killed-inside-all-reduce": (rank_jobs.killed_inside_all_reduce, {"rank": 1}, KILLED),
    "stops-answering": (rank_jobs.signal_self_in, {"rank": 1, "signum": signal.SIGSTOP}, STOPPED),
    "raises-mid-step": (rank_jobs.raises_mid_step, {"rank": 1}, ("error", "planted failure in the middle")),
}


@pytest.fixture(scope="module")
def device_pools():
    """One PoolManager per device for the module, as a session has, closed at its end."""
    made: dict[str, PoolManager] = {}

    def pools(device: str) -> PoolManager:
        if device not in made:
            made[device] = PoolManager(device, error_grace=GRACE)
        return made[device]

    yield pools
    for pm in made.values():
        pm.close_all()


def gpu_pids() -> set[int] | None:
    """Processes holding a CUDA context on any GPU, as nvidia-smi lists them (None where it cannot)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {int(p) for p in out.split() if p.strip().isdigit()}


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.world_size(2)]),
    ],
)
@pytest.mark.parametrize("fault", list(IN_A_JOB))
def test_a_fault_in_a_job_fails_it_with_both_ranks_stories_and_the_next_job_runs(
    device_pools, fault, device, request
):
    """The test passes when the harness reports the planted fault: a JobError within the job timeout plus
    MARGIN (the stack signal, the kill, a loaded host), with the victim's story and its peer's from the
    collective it waits in; then a job on the rebuilt pool passes, the replaced ranks' processes are gone and
    hold no GPU, and, with no lane beside it, no more processes hold a GPU than the live pool's two ranks."""
    if device == "cuda" and cuda_device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    job, kwargs, (status, phrase) = IN_A_JOB[fault]
    pm, timeout = device_pools(device), DEVICE_TIMEOUT[device]
    # a warm pool: the fault, not a start, is timed
    before = {r["pid"] for r in pm.pool_for(2).run(rank_jobs.whoami, timeout=120)}
    t0 = time.monotonic()
    with pytest.raises(JobError) as info:
        pm.pool_for(2).run(job, kwargs, timeout=timeout)
    took = time.monotonic() - t0
    assert took < timeout + MARGIN, (
        f"the fault took {took:.1f}s to be reported (bound {timeout + MARGIN:.0f}s)"
    )
    outcomes = {o.rank: o for o in info.value.outcomes}
    assert sorted(outcomes) == [0, 1], "both ranks' stories"
    assert outcomes[1].status == status and phrase in outcomes[1].text, str(info.value)
    peer = outcomes[
        0
    ]  # its stack where it waited for rank 1, or gloo's error once rank 1's connection closed
    assert peer.status in ("timeout", "error"), str(info.value)
    assert any(w in peer.text for w in ("all_reduce", "barrier", "backward", "synchronize")), str(info.value)
    ranks = pm.pool_for(2).run(rank_jobs.whoami, timeout=120)
    assert [r["rank"] for r in ranks] == [0, 1]
    gone = before - {r["pid"] for r in ranks}
    assert gone, "the faulted pool's ranks were replaced"
    alive = [pid for pid in gone if Path(f"/proc/{pid}").exists()]  # a zombie too: nobody reaped it
    assert not alive, f"the faulted pool's ranks {alive} are still there"
    held = gpu_pids() if device == "cuda" else None
    if held is not None:
        assert not held & gone, f"replaced ranks still hold a GPU: {held & gone}"
        # counted too, where nothing runs beside this test: in a container nvidia-smi may list the host's
        # process ids, and lanes beside it hold GPUs of their own
        if not request.config.getoption("--distbench-lane"):
            assert len(held) <= len(ranks), f"GPU processes besides the live pool's {ranks}: {held}"
