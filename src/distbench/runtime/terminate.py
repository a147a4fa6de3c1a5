"""SIGTERM ends a run the way Ctrl-C does.

A batch system's cancel or time limit (Slurm's scancel, `timeout`, a CI runner's cancel after its SIGINT) sends
SIGTERM, whose default ends the process at once: its ranks die with it (PR_SET_PDEATHSIG), but no `finally`
runs, so the session's shelf of checkpoints, the lanes' directory and a run's partial output stay on the
machine. Raised as KeyboardInterrupt instead, the same cleanup as Ctrl-C runs, and the run ends non-zero as an interrupted one does.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread was: everything that cleans up after Ctrl-C runs."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"terminated by signal {signum} (SIGTERM)")


def install() -> Any:
    """Route SIGTERM to Terminated when nobody else handles it and we are on the main thread; the previous
    handler, for restore(), or None where nothing was installed. Not in a torchrun worker: its agent sends
    SIGTERM to stop the other ranks once one failed, and they must stop at once, not run their cleanup."""
    if threading.current_thread() is not threading.main_thread() or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None  # an embedding program's own handler wins
    return signal.signal(signal.SIGTERM, _raise)


def restore(previous: Any) -> None:
    if previous is not None and signal.getsignal(signal.SIGTERM) is _raise:
        signal.signal(signal.SIGTERM, previous)
