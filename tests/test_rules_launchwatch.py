"""The launch watch's rules in this process (runtime/launchwatch.py; test_launchwatch.py runs them in real
ranks, slowly): which bound or signal makes a rank give up, the one line it says, what it leaves in the store,
and where it says it waited. The store is a stand-in and the exit is recorded, not taken."""

from __future__ import annotations

import io
import re
import sys
import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from distbench.runtime import launchwatch
from distbench.runtime.launchwatch import ABORT, REFUSED, RELEASED, Watch, where

#: the recorded exit ends the watch's thread with SystemExit, which pytest reports from a thread as a warning;
#: a watch that fails otherwise never records its exit, and its test fails waiting for it
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class Store:
    """The calls a Watch makes on torchrun's store, on a dict; `broken`: every call raises that message."""

    def __init__(self, broken: str | None = None) -> None:
        self.kv: dict[str, str] = {}
        self.order: list[str] = []  # the keys set, in the order they were set
        self.waited: list[tuple[list[str], timedelta]] = []
        self.broken = broken

    def _check_broken(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def check(self, keys: list[str]) -> bool:
        self._check_broken()
        return all(k in self.kv for k in keys)

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value
        self.order.append(key)

    def get(self, key: str) -> bytes:
        self._check_broken()
        value = self.kv[key]
        return value if isinstance(value, bytes) else value.encode()

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.waited.append((keys, timeout))


class Exits(list[int]):
    """The statuses a watch exited with, and an event set at the first."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Exits:
    """The statuses the watch exits with; its thread then ends instead of the process."""
    codes = Exits()

    def _exit(code: int) -> None:
        codes.append(code)
        codes.done.set()
        sys.exit()  # ends the watch's thread only

    monkeypatch.setattr(launchwatch.os, "_exit", _exit)
    monkeypatch.setattr(launchwatch, "_TICK_S", 0.01)
    return codes


def run_watch(store: Store, controller: bool, exits: Exits, setup: Any = None) -> Watch:
    watch = Watch(3, store, controller)
    if setup is not None:
        setup(watch)
    assert exits.done.wait(10), "the watch never gave up"
    return watch


def test_a_rank_past_its_deadline_says_so_once_leaves_its_stack_and_exits_1(exits, capfd) -> None:
    """Rank 0, stuck, also tells every follower that nothing more of the launch runs (abort, released)."""
    store = Store()
    run_watch(store, True, exits, lambda w: w.expect("job 8: train", 0.0, "waiting for rank 1's outcome"))
    err = capfd.readouterr().err
    assert (
        err
        == "distbench launch rank 3: job 8: train: gave up after 0s; waiting for rank 1's outcome; exiting 1\n"
    )
    assert exits == [1]
    assert store.kv[ABORT] == "1" and store.kv[RELEASED] == "1" and "stack/3" in store.kv
    assert "Thread" in store.kv["stack/3"]  # faulthandler's dump of every thread


def test_rank_0_giving_up_keeps_the_store_until_every_follower_has_said_its_line(exits, capfd) -> None:
    """torchrun's store lives on rank 0's node: once rank 0 exits, a follower's agent stops it, often before
    its next tick reads the abort. So rank 0 releases the followers and exits only once each left its stack
    (which a follower posts right after its line); rank 2 here posts it 0.3 s after the abort."""
    store = Store()

    def follower_2() -> None:
        while ABORT not in store.kv:
            threading.Event().wait(0.01)
        threading.Event().wait(0.3)
        store.set("stack/2", "Thread 0x1 (most recent call first):")

    threading.Thread(target=follower_2, daemon=True).start()
    store.kv["stack/1"] = "Thread 0x2 (most recent call first):"
    watch = Watch(0, store, True, followers=range(1, 3))
    watch.expect("job 8: train", 0.0, "waiting in a collective")
    assert exits.done.wait(10), "the watch never gave up"
    assert store.order == ["stack/0", ABORT, "stack/2", RELEASED], store.order
    assert capfd.readouterr().err.count("\n") == 1 and exits == [1]


def test_rank_0_giving_up_waits_a_bounded_time_for_a_follower_that_never_answers(exits, monkeypatch) -> None:
    """A follower that died leaves no stack: rank 0 still releases the others and exits, STACK_WAIT_S later."""
    monkeypatch.setattr(launchwatch, "STACK_WAIT_S", 0.2)
    store = Store()
    started = launchwatch.time.monotonic()
    watch = Watch(0, store, True, followers=[1])
    watch.expect("job 8: train", 0.0, "waiting in a collective")
    assert exits.done.wait(10), "the watch never gave up"
    assert 0.2 <= launchwatch.time.monotonic() - started < 5
    assert store.order == ["stack/0", ABORT, RELEASED]


class Clock:
    """launchwatch's `time` for stacks_left: sleeping moves the clock, and a stack may be set to arrive at
    a given time."""

    def __init__(self, store: Store, arrivals: dict[str, float]) -> None:
        self.now, self.store, self.arrivals = 0.0, store, arrivals

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for key, at in self.arrivals.items():
            if self.now >= at:
                self.store.kv.setdefault(key, f"{key} at {at}")


def test_stacks_left_polls_until_each_rank_left_its_stack_or_its_bound_passes(monkeypatch) -> None:
    """Polled every _TICK_S / 5 (0.125 s here); it returns at the poll that finds the last stack, or at the
    first poll at or past its bound with the stacks that came, by rank."""
    monkeypatch.setattr(launchwatch, "_TICK_S", 0.625)
    store = Store()
    store.kv["stack/1"] = b"one \xff"  # a stack need not be UTF-8 (a path's bytes)
    clock = Clock(store, {"stack/3": 0.3})
    monkeypatch.setattr(launchwatch, "time", clock)
    assert launchwatch.stacks_left(store, [3, 1], 1.0) == {1: "one \ufffd", 3: "stack/3 at 0.3"}  # type: ignore[arg-type]
    assert clock.now == 0.375
    clock.now = 0.0
    assert launchwatch.stacks_left(store, [2, 1], 1.0) == {1: "one \ufffd"}  # type: ignore[arg-type]
    assert clock.now == 1.0
    assert launchwatch.stacks_left(store, [], 60) == {}  # type: ignore[arg-type]
    assert clock.now == 1.0


def test_a_follower_that_rank_0_gave_up_on_waits_for_the_results_then_exits_1(exits, capfd) -> None:
    store = Store()
    store.kv[ABORT] = "1"
    run_watch(store, False, exits, lambda w: w.expect("job 2: bench", 1e6, "waiting in a collective"))
    assert capfd.readouterr().err == (
        "distbench launch rank 3: job 2: bench: rank 0 gave up on the launch's current job; waiting in a "
        "collective; exiting 1\n"
    )
    assert exits == [1] and ABORT in store.kv and RELEASED not in store.kv  # a follower posts neither
    assert store.waited == [([RELEASED], timedelta(seconds=launchwatch._RELEASE_WAIT_S))]
    assert "stack/3" in store.kv


def test_a_follower_between_jobs_says_so(exits, capfd) -> None:
    store = Store()
    store.kv[ABORT] = "1"
    run_watch(store, False, exits)
    assert "rank 3: between jobs: rank 0 gave up" in capfd.readouterr().err


def test_a_refusal_by_another_rank_stops_a_follower_silently(exits, capfd) -> None:
    store = Store()
    store.kv[REFUSED] = "rank 1 refused"
    run_watch(store, False, exits, lambda w: w.expect("job 1", 1e6, "x"))
    assert exits == [1] and capfd.readouterr().err == "" and "stack/3" not in store.kv


def test_rank_0_does_not_stop_for_a_refusal_or_its_own_abort(exits, capfd) -> None:
    """Rank 0 reads the refusal itself (cluster.py); only its deadline stops its watch."""
    store = Store()
    store.kv[REFUSED] = store.kv[ABORT] = "1"
    watch = Watch(0, store, True)
    assert not exits.done.wait(0.2)
    watch.expect("job 4", 0.0, "its own wait")
    assert exits.done.wait(10)
    assert "job 4: gave up after 0s; its own wait" in capfd.readouterr().err


def test_a_lost_store_is_said_with_its_first_line(exits, capfd) -> None:
    """A C++ error carries its frames on the next lines: the one line keeps the first; where the main
    thread stands follows."""
    run_watch(Store(broken="Connection reset by peer\n  frame 1\n  frame 2"), False, exits)
    err = capfd.readouterr().err
    assert err.startswith(
        "distbench launch rank 3: between jobs: lost torchrun's store (Connection reset by peer); waiting in "
    )
    assert err.endswith("; exiting 1\n") and err.count("\n") == 1 and exits == [1]


def test_a_stopped_watch_never_exits(exits) -> None:
    watch = Watch(1, Store(), False)
    watch.expect("job 1", 0.0, "x")
    watch.stop()
    assert not exits.done.wait(0.2)


def test_a_cleared_wait_has_no_deadline(exits) -> None:
    watch = Watch(1, Store(), True)
    watch.expect("job 1", 0.05, "x")
    watch.clear()
    assert not exits.done.wait(0.3)
    watch.stop()


def test_a_rank_says_one_line_whichever_bound_passes_first(capfd) -> None:
    watch = Watch(2, Store(), True)
    watch.stop()
    assert watch.say("job 1", "why", "what") is True
    assert watch.say("job 1", "again", "what") is False
    assert capfd.readouterr().err == "distbench launch rank 2: job 1: why; what; exiting 1\n"


def test_where_names_the_innermost_frame_outside_torch_distributed() -> None:
    def inner() -> tuple[str, int]:
        return where(sys._getframe()), sys._getframe().f_lineno

    said, line = inner()
    assert said == f"waiting in test_rules_launchwatch.py:{line} in inner"
    assert where(None) == "waiting with no Python frame"


def _frame(path: str, line: int, name: str) -> Any:
    import traceback

    return traceback.FrameSummary(path, line, name, lookup_line=False)


C10D = "/env/site-packages/torch/distributed/distributed_c10d.py"


@pytest.mark.parametrize(("stack", "said"), [
    (  # the user's last frame before torch.distributed, past DeepSpeed's and torch's wrappers; the innermost
       # c10d call named; a user path holding "deepspeed" and "comm/" is the user's
     [_frame("/home/u/train.py", 10, "main"), _frame("/home/u/lib.py", 20, "step"),
      _frame("/home/u/deepspeed_runs/comm/sync.py", 30, "sync"),
      _frame("/env/site-packages/deepspeed/comm/comm.py", 40, "all_reduce"),
      _frame("/env/site-packages/torch/distributed/c10d_logger.py", 50, "wrapper"),
      _frame(C10D, 60, "all_reduce"), _frame("/home/u/hook.py", 70, "hook"), _frame(C10D, 80, "_coalesced"),
      _frame(C10D, 90, "barrier"), _frame("/env/site-packages/torch/foo.py", 95, "inner")],
     "waiting in torch.distributed.barrier, called from sync.py:30 in sync"),
    ([_frame("/env/site-packages/torch/x.py", 1, "a"), _frame(C10D, 2, "barrier")],
     "waiting in torch.distributed.barrier"),  # nothing of the user's outside torch
    ([_frame("/home/u/train.py", 10, "main"), _frame("/home/u/lib.py", 20, "poll")],
     "waiting in lib.py:20 in poll"),  # not in torch.distributed: the innermost frame
])  # fmt: skip
def test_where_names_the_innermost_collective_and_the_users_call_into_it(monkeypatch, stack, said) -> None:
    monkeypatch.setattr(launchwatch.traceback, "extract_stack", lambda frame: stack)
    assert where(sys._getframe()) == said


def test_the_watch_runs_in_a_named_daemon_thread() -> None:
    """Named, so a rank's stack dump says which thread is the watch; a daemon, so it never holds a rank that
    has finished."""
    watch = Watch(1, Store(), True)
    try:
        (thread,) = [t for t in threading.enumerate() if t.name == "distbench-launch-watch" and t.is_alive()][
            -1:
        ]
        assert thread.daemon
    finally:
        watch.stop()


# ---- one tick at a time, on a clock the test sets -----------------------------------------------------------


class _OneTick:
    """Stands for a watch's stop event: its first wait is one tick that passes unstopped, the next ends the loop."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        return self.waits > 1

    def is_set(self) -> bool:
        return False


def at(now: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's clock (launchwatch's `time`, not the process's) reads `now`."""
    monkeypatch.setattr(launchwatch, "time", SimpleNamespace(monotonic=lambda: now))


class SteppedWatch(Watch):
    """A Watch whose loop runs one tick at a time in the test's thread, when the test asks (its own thread ends
    at once), on the clock `now` the test sets."""

    def _loop(self) -> None:
        pass

    def gives_up_at(self, now: float, monkeypatch: pytest.MonkeyPatch) -> bool:
        """Whether the tick at time `now` ends the rank (its exit recorded by the `exits` fixture)."""
        at(now, monkeypatch)
        self._done = _OneTick()  # type: ignore[assignment]
        try:
            Watch._loop(self)
        except SystemExit:
            return True
        return False


def test_a_wait_gives_up_exactly_when_its_seconds_from_its_start_have_passed(
    exits, capfd, monkeypatch
) -> None:
    """expect(job, 10 s) at t = 1000 holds the rank until t = 1010 and gives up at t = 1010 itself (the bound
    is inclusive), saying the seconds it was given."""
    at(1000.0, monkeypatch)
    watch = SteppedWatch(3, Store(), True)
    watch.expect("job 5: train", 10.0, "waiting for rank 1's outcome")
    assert not watch.gives_up_at(1000.0, monkeypatch)
    assert not watch.gives_up_at(1009.99, monkeypatch)
    assert exits == [] and capfd.readouterr().err == ""
    assert watch.gives_up_at(1010.0, monkeypatch)
    assert exits == [1]
    assert capfd.readouterr().err == (
        "distbench launch rank 3: job 5: train: gave up after 10s; waiting for rank 1's outcome; exiting 1\n"
    )


def test_a_cleared_wait_leaves_the_watch_keeping_the_next_one(exits, capfd, monkeypatch) -> None:
    """Between two waits (clear) the watch keeps ticking; the next expect's deadline still ends the rank."""
    at(0.0, monkeypatch)
    watch = SteppedWatch(3, Store(), True)
    watch.expect("job 1: train", 5.0, "waiting for rank 1's outcome")
    watch.clear()
    assert not watch.gives_up_at(100.0, monkeypatch)
    assert not watch.gives_up_at(200.0, monkeypatch)
    watch.expect("job 2: bench", 5.0, "waiting for rank 2's outcome")
    assert watch.gives_up_at(205.0, monkeypatch)
    assert capfd.readouterr().err == (
        "distbench launch rank 3: job 2: bench: gave up after 5s; waiting for rank 2's outcome; exiting 1\n"
    )


def test_a_store_lost_during_a_wait_names_that_wait_and_its_job(exits, capfd, monkeypatch) -> None:
    """Not "between jobs", nor where the main thread stands: the job and the known wait it was in."""
    watch = SteppedWatch(3, Store(broken="Connection refused\n  frame 1"), False)
    watch.expect("job 6: bench", 1e6, "waiting for the next job (job/7) from rank 0")
    assert watch.gives_up_at(0.0, monkeypatch)
    assert exits == [1]
    assert capfd.readouterr().err == (
        "distbench launch rank 3: job 6: bench: lost torchrun's store (Connection refused); waiting for the next "
        "job (job/7) from rank 0; exiting 1\n"
    )


def test_a_store_error_without_words_is_named_by_its_type(exits, capfd, monkeypatch) -> None:
    watch = SteppedWatch(3, Store(broken=""), False)
    assert watch.gives_up_at(0.0, monkeypatch)
    assert capfd.readouterr().err.startswith(
        "distbench launch rank 3: between jobs: lost torchrun's store (RuntimeError); "
    )


def test_the_stack_left_in_the_store_is_faulthandlers_whole_dump_of_every_thread(exits, monkeypatch) -> None:
    """From its first line (faulthandler's header of a thread) on; the thread that is stuck (here the test's
    own, which ticked the watch) among the threads dumped."""
    at(0.0, monkeypatch)
    watch = SteppedWatch(3, Store(), True)
    watch.expect("job 8: train", 0.0, "waiting for rank 1's outcome")
    assert watch.gives_up_at(0.0, monkeypatch)
    stack = watch.store.kv["stack/3"]
    assert re.match(r"(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n", stack), stack[:200]
    assert "test_the_stack_left_in_the_store_is_faulthandlers_whole_dump_of_every_thread" in stack


def test_the_ranks_line_is_out_before_it_exits_even_where_stderr_is_block_buffered(monkeypatch) -> None:
    """os._exit flushes nothing: a rank whose stderr a tee or a logger replaced with a buffered stream still
    gets its one line out, because say() flushes it."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", line_buffering=False))
    watch = Watch(4, Store(), True)
    watch.stop()
    assert watch.say("job 9: train", "gave up after 3s", "waiting in x.py:1 in f")
    assert (
        raw.getvalue()
        == b"distbench launch rank 4: job 9: train: gave up after 3s; waiting in x.py:1 in f; exiting 1\n"
    )
