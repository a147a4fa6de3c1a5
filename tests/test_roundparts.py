"""measure/roundparts.py: each part of a round's time is read where it happened, so that an undecided claim
names its noise's source. Each test plants one source (CPU work, a blocking wait, another thread's work, a
competitor for the same core) and finds it in its own part; the collector's part is the fidelity rounds'
(tests/test_fidelity.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cpu_work import spin
from distbench.measure.roundparts import Readings, explain, timed_parts
from distbench.runtime.context import RankContext

CPU = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def test_cpu_work_is_issuing_on_a_core():
    parts = timed_parts(CPU, lambda: spin(0.03))
    assert parts["cpu_s"] >= 0.03
    assert parts["s"] >= parts["issue_s"] >= parts["cpu_s"] - 0.001  # two clocks: a tick apart


def test_a_blocking_wait_is_issuing_off_a_core():
    parts = timed_parts(CPU, lambda: time.sleep(0.05))
    assert parts["issue_s"] >= 0.05
    assert parts["cpu_s"] < 0.02  # asleep, not on a core


def test_another_threads_work_is_the_ranks_other_threads():
    def work() -> None:
        t = threading.Thread(target=spin, args=(0.03,))
        t.start()
        t.join()

    parts = timed_parts(CPU, work)
    assert parts["others_cpu_s"] >= 0.025  # the thread's 30 ms, less what it ran before the first reading
    assert parts["cpu_s"] < 0.02


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="needs Linux's schedstat")
def test_a_competitor_for_the_same_core_is_waiting_for_a_core():
    """This thread and a CPU-bound process pinned to one core: the scheduler shares it, and the round's
    thread waits on the run queue for the time the other holds it."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    rival = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.3)  # the rival is pinned and spinning
        os.sched_setaffinity(0, {cpu})
        try:
            parts = timed_parts(CPU, lambda: spin(0.1))
        finally:
            os.sched_setaffinity(0, before)
    finally:
        rival.kill()
        rival.wait()
    assert parts["runq_s"] >= 0.03  # fair sharing gives the rival about as long as the spin's 100 ms
    assert parts["s"] >= parts["cpu_s"] + parts["runq_s"] * 0.9


def test_readings_on_cpu_give_the_hosts_busy_share_and_no_device():
    readings = Readings(CPU)
    readings.start()
    spin(0.05)
    out = readings.stop()
    assert set(out) == {"host_busy"}
    assert 0 < out["host_busy"] <= 1


def test_explain_names_each_parts_extremes():
    rounds = [
        {
            "bare_s": 0.40,
            "bare_issue_s": 0.40,
            "bare_cpu_s": 0.22,
            "bare_runq_s": 0.001,
            "bare_others_cpu_s": 0.002,
            "bare_gc_s": 0.0,
            "host_busy": 0.07,
            "sm_clock_mhz": 1965,
        },
        {
            "bare_s": 0.44,
            "bare_issue_s": 0.44,
            "bare_cpu_s": 0.27,
            "bare_runq_s": 0.012,
            "bare_others_cpu_s": 0.004,
            "bare_gc_s": 0.003,
            "host_busy": 0.31,
            "sm_clock_mhz": 1860,
        },
    ]
    text = explain(rounds, ["bare"])
    assert "bare 420 ms (spread 6.7%): host issuing 100% of it on 220-270 ms of CPU" in text
    assert "waiting for a core up to 12 ms" in text
    assert "the rank's other threads up to 4 ms of CPU, the collector up to 3 ms" in text
    assert "host CPUs busy 7%-31%" in text
    assert "sm_clock 1860-1965 MHz" in text
