"""CPU work of a known length for the tests of what measures the host."""

from __future__ import annotations

import time


def spin(seconds: float) -> None:
    """Busy this thread for `seconds` of its own CPU time (not wall time: a loaded host stretches the wall)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
