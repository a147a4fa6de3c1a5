"""The bound on a launch rank's waits (runtime/launchwatch.py): where each backend's own bound stands against the
rank's, and a rank whose wait outlasts its bound printing its one line, leaving its stack and exiting 1."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distbench.runtime.launchwatch import hand_out_bound, job_bounds, reply_grace

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("timeout", [8.0, 60.0, 1800.0])
def test_the_rank_gives_up_after_gloo_raises_and_before_nccl_takes_the_process(timeout):
    group, own = job_bounds(timeout, "cpu")
    assert group == timeout < own == timeout + reply_grace(timeout)  # gloo's timeout fails the job first
    group, own = job_bounds(timeout, "cuda")
    assert own == timeout < group  # NCCL's watchdog would end the process with no word of the job
    assert 0 < reply_grace(timeout) <= 30
    assert hand_out_bound(timeout) > timeout + reply_grace(timeout)  # a job sat out, then rank 0's own work


RANK = """
import time
import torch.distributed as dist
from distbench.runtime.launchwatch import Watch

store = dist.HashStore()
store.set("released", "1")  # rank 0 has written its results: a follower leaves at once
watch = Watch(rank={rank}, store=store, controller={controller})
watch.expect("job 3: train (zero2 ws2 m) on 2 ranks", 0.5, {what})

def planted_wait():
    time.sleep(60)

try:
    planted_wait()
finally:
    print("stack left:", store.check(["stack/{rank}"]), "abort:", store.check(["abort"]), flush=True)
"""


def _rank(rank: int, controller: bool, what: str | None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(RANK).format(rank=rank, controller=controller, what=repr(what))
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # a Python process that imports torch: ~4 s on 2 cores
def test_a_rank_past_its_bound_says_where_it_waited_in_one_line_and_exits_1():
    got = _rank(0, True, None)
    assert got.returncode == 1, got.stderr[-2000:]
    lines = [ln for ln in got.stderr.splitlines() if ln.startswith("distbench launch rank 0:")]
    assert lines == [
        "distbench launch rank 0: job 3: train (zero2 ws2 m) on 2 ranks: gave up after 0s; waiting in "
        f"<string>:{RANK.splitlines().index('    time.sleep(60)') + 1} in planted_wait; exiting 1"
    ], got.stderr[-2000:]
    assert "stack left" not in got.stdout  # os._exit: no cleanup of the stuck main thread runs


@pytest.mark.slow  # a Python process that imports torch: ~4 s on 2 cores
def test_a_follower_past_its_bound_names_the_wait_it_was_given():
    got = _rank(1, False, "waiting for the next job (job/4) from rank 0")
    assert got.returncode == 1, got.stderr[-2000:]
    assert (
        "distbench launch rank 1: job 3: train (zero2 ws2 m) on 2 ranks: gave up after 0s; waiting for the "
        "next job (job/4) from rank 0; exiting 1"
    ) in got.stderr.splitlines(), got.stderr[-2000:]
