"""The session summary's clock for what comes before its first hook (session_watch.process_age_s), and the
timeline it writes (the GPU tier's evidence of where a GPU sat idle)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from distbench.testsuite.session_watch import SessionWatch, process_age_s


def test_process_age_counts_from_the_interpreters_start():
    """A process that sleeps 0.5 s first is at least 0.5 s old when it asks, and no older than the parent's
    clock around it says, give or take the clock's tick (10 ms): the summary's "s of start" is the command's
    own, not the session's."""
    code = "import time; time.sleep(0.5); from distbench.testsuite.session_watch import process_age_s; print(process_age_s())"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    around = time.monotonic() - t0
    age = float(out.stdout)
    assert 0.5 <= age <= around + 0.01, (age, around)  # within the parent's clock around the child, one tick
    here = process_age_s()
    assert here is not None and here > age, "this test's process started before that child, and asks after it"


def test_the_timeline_puts_the_gpu_samples_on_the_tests_clock():
    """Samples and tests share one clock, from the first test's start: a sample taken 2 s after it reads t=2,
    whatever the epoch; each keeps its GPUs' utilization in device order and the host's share."""
    w = SessionWatch()
    w.spans = {"b.py::t": (1000.5, 1003.0), "a.py::t": (1000.0, 1001.0)}
    w.gpu.times = [1000.0, 1002.0]
    w.gpu.utilization = [[0.0, 0.5], [1.0, 0.25]]
    w.gpu.host_busy = [None, 0.4]
    w.gpu.in_lanes = [False, True]
    out = w.timeline()
    assert out["tests"] == {"a.py::t": [0.0, 1.0], "b.py::t": [0.5, 3.0]}
    assert out["samples"] == [
        {"t": 0.0, "gpu": [0.0, 0.5], "host": None, "lanes": False},
        {"t": 2.0, "gpu": [1.0, 0.25], "host": 0.4, "lanes": True},
    ]
