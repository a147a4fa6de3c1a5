"""The bound on every wait of a `distbench launch` rank, and the one line it prints when a bound passes.

A rank of a launch waits for the next job from rank 0, inside a job (its collectives, a checkpoint's barriers),
and, on rank 0, for the other ranks' outcomes. Each wait has a deadline here; when one passes, or when rank 0
gave up on a job, the rank prints one line naming its rank, the job and its configuration, and what it waited
for (a known wait, or where its main thread stands: the collective it entered and who called it), leaves its
Python stack in the store for rank 0's record, and exits 1. Without this, zero2 across two nodes waited in a
collective for a rank that never came, silent, until a batch limit killed both agents.

Inside a job the deadline sits on the side of the backend's own bound that keeps the rank's story: gloo raises
a collective's timeout in the rank, so the job fails with every rank's traceback and the launch goes on, and
the watch comes later; NCCL's watchdog takes the whole process down at its timeout, with no word of the job,
so there the watch comes first and the job's process group times out later.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch.distributed as dist

#: The key a follower that refused a message posts its reason under: every rank then stops.
REFUSED = "refused"
#: Rank 0 posts these: it gave up on a job (every follower says so and exits once released), and it is done
#: writing (released).
ABORT, RELEASED = "abort", "released"
_RELEASE_WAIT_S = 120.0  # an aborted follower waits this long at most for the controller to finish writing
_REPLY_GRACE_S = 30.0
_TICK_S = 0.5
#: How long rank 0, giving up, waits for every follower's stack: a follower leaves it right after its line, and
#: torchrun's store (on rank 0's node) must outlive that, or the follower's agent stops it first, unheard.
STACK_WAIT_S = 5.0


def reply_grace(timeout: float) -> float:
    """How long past a job's timeout its ranks' outcomes may still arrive: ranks blocked in a collective when
    a peer failed report their own timeout error at the timeout."""
    return min(_REPLY_GRACE_S, timeout / 4)


def job_bounds(timeout: float, device_type: str) -> tuple[float, float]:
    """(the job's process-group timeout, when the rank gives up on its part of the job), in seconds from its
    start: the watch after gloo's bound, before NCCL's (see the module's docstring)."""
    if device_type == "cuda":
        return timeout + reply_grace(timeout), timeout
    return timeout, timeout + reply_grace(timeout)


def hand_out_bound(timeout: float) -> float:
    """How long a follower waits for the next job: rank 0's part of a job the follower sat out, with its
    grace, and what rank 0 does between two jobs (building the matrix, a parity check, writing a result),
    each within the launch's --timeout."""
    return 2 * timeout + reply_grace(timeout)


def stack_key(rank: int) -> str:
    """The store key under which `rank` leaves its Python stack when a launch gives up."""
    return f"stack/{rank}"


def stacks_left(store: dist.Store, ranks: Iterable[int], seconds: float) -> dict[int, str]:
    """The Python stacks that `ranks` leave in the store (`stack/<rank>`) within `seconds`, by rank."""
    deadline, pending, got = time.monotonic() + seconds, sorted(set(ranks)), {}
    while True:
        for r in pending:
            if store.check([stack_key(r)]):
                got[r] = store.get(stack_key(r)).decode(errors="replace")
        pending = [r for r in pending if r not in got]
        if not pending or time.monotonic() >= deadline:
            return got
        time.sleep(_TICK_S / 5)


def where(frame: FrameType | None) -> str:
    """Where a thread waits: the torch.distributed call it is inside and the code outside torch that made
    it, else its innermost frame."""
    if frame is None:
        return "waiting with no Python frame"
    stack = traceback.extract_stack(frame)

    def at(f: traceback.FrameSummary) -> str:
        return f"{Path(f.filename).name}:{f.lineno} in {f.name}"

    c10d = [i for i, f in enumerate(stack) if f.filename.endswith("distributed_c10d.py")]
    if not c10d:
        return f"waiting in {at(stack[-1])}"
    wrappers = (f"{os.sep}torch{os.sep}", os.path.join(f"{os.sep}deepspeed", f"comm{os.sep}"))
    callers = [f for f in stack[: c10d[0]] if not any(w in f.filename for w in wrappers)]
    called_from = f", called from {at(callers[-1])}" if callers else ""
    return f"waiting in torch.distributed.{stack[c10d[-1]].name}{called_from}"


@dataclass(frozen=True)
class _Wait:
    job: str  # "job 8: distbench.jobs.train:train (zero2 ws2 gpt2-124m) on 2 ranks", or the last one seen
    what: str | None  # a known wait; None: read where the main thread stands
    deadline: float
    seconds: float


class Watch:
    """One rank's watch over its current wait, in a daemon thread: its own deadline, rank 0's abort (followers)
    and a refusal by another rank (followers). `followers`: the ranks whose stacks a controller that gives up
    waits for before it exits."""

    def __init__(self, rank: int, store: dist.Store, controller: bool, followers: Iterable[int] = ()) -> None:
        self.rank, self.store, self.controller = rank, store, controller
        self.followers = tuple(followers)
        self._main = threading.main_thread().ident
        self._wait: _Wait | None = None
        self._done = threading.Event()
        self._said = threading.Lock()  # one line per rank, whichever bound passes first
        threading.Thread(target=self._loop, name="distbench-launch-watch", daemon=True).start()

    def expect(self, job: str, seconds: float, what: str | None = None) -> None:
        """From now the rank waits at most `seconds` (for `what`, or where its main thread will stand)."""
        self._wait = _Wait(job, what, time.monotonic() + seconds, seconds)

    def clear(self) -> None:
        self._wait = None

    def stop(self) -> None:
        """The rank returns its status itself from now on (the launch's end, or a refusal it posts)."""
        self._done.set()

    def say(self, job: str, why: str, what: str) -> bool:
        """Print this rank's one line (False, and nothing printed, when it already said one)."""
        if not self._said.acquire(blocking=False):
            return False
        print(
            f"distbench launch rank {self.rank}: {job}: {why}; {what}; exiting 1", file=sys.stderr, flush=True
        )
        return True

    def _what(self, wait: _Wait | None) -> str:
        if wait is not None and wait.what is not None:
            return wait.what
        return where(sys._current_frames().get(self._main or 0))

    def _leave_stack(self) -> None:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            self.store.set(stack_key(self.rank), f.read())

    def _loop(self) -> None:
        try:
            while not self._done.wait(_TICK_S):
                wait = self._wait
                if not self.controller and self.store.check([REFUSED]) and not self._done.is_set():
                    os._exit(1)  # the rank that refused said why
                if not self.controller and self.store.check([ABORT]):
                    job = wait.job if wait else "between jobs"
                    self._give_up(job, "rank 0 gave up on the launch's current job", self._what(wait))
                elif wait is not None and time.monotonic() >= wait.deadline:
                    self._give_up(wait.job, f"gave up after {wait.seconds:.0f}s", self._what(wait))
        except Exception as e:  # noqa: BLE001 - the store is gone: the launch is over
            if not self._done.is_set():
                wait = self._wait
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]  # C++ errors carry frames
                self.say(
                    wait.job if wait else "between jobs", f"lost torchrun's store ({first})", self._what(wait)
                )
                os._exit(1)

    def _give_up(self, job: str, why: str, what: str) -> None:
        """Say so, leave the stack for rank 0's record and exit 1; rank 0, whose main thread is stuck, first
        tells every follower that nothing more of the launch will run and waits until each has said so."""
        if self._done.is_set():
            return
        self.say(job, why, what)
        self._leave_stack()
        if self.controller:
            self.store.set(ABORT, "1")
            stacks_left(self.store, self.followers, STACK_WAIT_S)
            self.store.set(RELEASED, "1")
        else:  # leave once rank 0 has written its results: torchrun stops a node's ranks when one fails
            try:
                self.store.wait([RELEASED], timedelta(seconds=_RELEASE_WAIT_S))
            except Exception:  # noqa: BLE001 - not released in time, or the store is gone: leave anyway
                pass
        os._exit(1)
