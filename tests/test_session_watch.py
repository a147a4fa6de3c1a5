"""The session summary's clock for what comes before its first hook (session_watch.process_age_s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from distbench.testsuite.session_watch import process_age_s


def test_process_age_counts_from_the_interpreters_start():
    """A process that sleeps 0.5 s first is 0.5 s old when it asks, give or take the interpreter's start and
    the clock's tick (10 ms): the summary's "s of start" is the command's own, not the session's."""
    code = "import time; time.sleep(0.5); from distbench.testsuite.session_watch import process_age_s; print(process_age_s())"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    age = float(out.stdout)
    assert 0.5 <= age < 0.5 + 5.0
    here = process_age_s()
    assert here is not None and here > age, "this test's process started before that child, and asks after it"
