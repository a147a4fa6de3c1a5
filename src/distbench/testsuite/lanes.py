"""Run a session's plan (schedule.py): lanes as child pytest processes sharing the devices' seats, the rest here.

Each lane is `python -m pytest` on the modules it may be given, told its candidate tests and its directory with
`--distbench-lane` (lane_child.py), its devices with CUDA_VISIBLE_DEVICES (GPU slots) and its slots with
DISTBENCH_LANE. It asks for units of work and gets them through a pipe, costliest first, until none of its
world size is left; lanes start while seats are free and units wait. Its tests are replayed into this
session as they finish, through pytest's report serialization hooks (as pytest-xdist does), so the terminal,
-x/--maxfail, --junitxml, --durations, the exit status and the phase table read as if this process had run
them. A lane process that dies or outlives --lane-timeout on one test fails that test with its output, and
the rest of its work goes back to the queue. Every lane process is its own process group and session,
killed with its ranks on Ctrl-C or -x; the lanes' directory (test ids, events, output, the lane's basetemp)
is removed at the end. While lanes run, a unit is handed out only while the devices have memory to spare
(GpuWatch), and each test is charged the device memory its lane held (the next session's seats read it).
The plan's solo unit (one-rank exclusive tests) gets the last device whole: no one-rank lane takes a seat
there before the solo has run, and once no unit of several ranks waits no lane at all does. The solo lane
starts then, warms its pool beside the last lanes there, and is handed its unit once the device is empty;
it gives the device back when done.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..measure.hostspeed import cpu_stat, steal_share
from ..runtime.phases import PhaseLog
from ..runtime.pool import visible_devices
from ..runtime.worker import THREADS_ENV
from .lane_child import EVENTS, ITEMS, LANE_POOL_ENV, LANE_WARM_ENV, OUTPUT, WORK_FD_ENV
from .lane_watch import GpuWatch, Occupancy, dirty_bytes, session_of, sync_filesystem
from .schedule import (
    CORES_PER_RANK,
    Plan,
    Seats,
    Unit,
    next_world_size,
    runnable,
    seconds_by_world_size,
    starts_in_time,
    take_unit,
    warm_up_due,
)

LANE_ENV = "DISTBENCH_LANE"
#: lanes of one world size that may fail to start in a row (a passing cause, say memory another lane held)
_START_TRIES = 2
WHEN = ("setup", "call", "teardown")
_OUTPUT_TAIL = 6000  # characters of a dead lane's output quoted in each test it fails
_POLL_S = 0.05
_STACK_WAIT_S = 2.0  # for a hung lane to write its stack before it is killed
#: A unit waits while a device of the lane is fuller than this (another lane's peak may still come).
_MEMORY_TIGHT = 0.9


def _die_with_parent_and_bind(cpus: list[int] | None) -> Callable[[], None]:
    """A preexec for a lane process: SIGKILL when this process dies (its ranks follow it the same way), and
    its share of the CPUs when DISTBENCH_BIND_CPUS slices them per rank (slices of lanes must not overlap)."""

    def preexec() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if cpus:
            os.sched_setaffinity(0, cpus)

    return preexec


def lane_cpus(slices: Sequence[int], n_slices: int) -> list[int] | None:
    """This lane's share of the CPUs, `slices` of `n_slices` equal ones, when ranks are bound to CPUs;
    else None."""
    if not os.environ.get("DISTBENCH_BIND_CPUS") or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    per_slice = len(cpus) // n_slices
    if per_slice == 0:
        return None
    return [c for s in slices for c in cpus[s * per_slice : (s + 1) * per_slice]]


def lane_env(slots: Sequence[int], gpus: bool, shared: bool = False) -> dict[str, str]:
    """The environment of a lane process: its slots, on GPUs only its GPUs (renumbered from 0 for it), and
    when it shares them with other lanes, CORES_PER_RANK host threads per rank (torch's and OpenMP's pools,
    which DeepSpeed's CPU Adam uses, would otherwise each take every core)."""
    env = {**os.environ, LANE_ENV: ",".join(map(str, slots))}
    env.pop(
        "PYTEST_ADDOPTS", None
    )  # its reporting options (--junitxml=...) are the session's; forwarded_args
    # the folder that holds this distbench, whatever else is installed
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(slots)
    if shared:
        env[THREADS_ENV] = env["OMP_NUM_THREADS"] = str(CORES_PER_RANK)
    return env


def forwarded_args(config: pytest.Config) -> list[str]:
    """The parent's options a lane needs to collect and run the same tests: plugins (-p) and ini overrides (-o),
    from the command line and PYTEST_ADDOPTS, the distbench options and pytest-timeout's. Reporting options
    (-x, --junitxml, -v, ...) stay with the session."""
    out: list[str] = []
    args = shlex.split(os.environ.get("PYTEST_ADDOPTS", "")) + [str(a) for a in config.invocation_params.args]
    for i, a in enumerate(args):
        for short, long in (("-p", None), ("-o", "--override-ini")):
            if a in (short, long) and i + 1 < len(args):
                out += [short, args[i + 1]]
            elif a.startswith(short) and len(a) > 2 and not a.startswith("--"):
                out += [short, a[2:]]
            elif long and a.startswith(long + "="):
                out += [short, a[len(long) + 1 :]]
    for opt in (
        "--strategies",
        "--world-sizes",
        "--models",
        "--steps",
        "--job-timeout",
        "--results-dir",
        "--timeout",
    ):
        try:
            value = config.getoption(opt)
        except ValueError:  # pytest-timeout not installed
            continue
        if value is not None:
            out += [opt, str(value)]
    return out


@dataclass
class LaneRun:
    """One lane process: what it was given, what it has reported, and the test it is in."""

    world_size: int
    slots: list[int]
    cpu_slices: list[int]
    dir: Path
    proc: subprocess.Popen[bytes]
    work: Any  # the write end of the lane's work pipe (a text file)
    collected: frozenset[str]  # the tests it collected: it can run no other
    remaining: list[str] = field(default_factory=list)  # handed to it, not yet finished
    unit: Unit | None = None  # the unit it runs (a lane asks for the next only when this one is done)
    asked: bool = False  # it asked for work and waits for the answer
    started: bool = False  # it asked for work once: it imported, collected and started its first pool
    units: int = 0  # units handed to it so far
    current: str | None = None
    current_since: float = 0.0
    reports: list[pytest.TestReport] = field(default_factory=list)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    killed_why: str = ""
    told_to_end: float | None = None  # when it was told no work is left (time.monotonic())
    lent: bool = False  # its seats went to new lanes while it ran its last unit (LaneRunner._lend_last_seats)
    _offset: int = 0

    def hand(self, unit: Unit | None) -> None:
        """Answer the lane's request: a unit's test ids, or none left."""
        nodeids = unit.nodeids if unit else []
        self.unit = unit
        if unit:
            self.remaining += unit.nodeids
            self.units += 1
        else:
            self.told_to_end = time.monotonic()
        self.asked = False
        try:
            self.work.write(json.dumps(nodeids) + "\n")
            self.work.flush()
        except (BrokenPipeError, ValueError):  # it died meanwhile: _ended gives the unit back
            pass

    def events(self) -> list[dict[str, Any]]:
        """Whole event lines written since the last call (a partial last line waits for its end)."""
        path = self.dir / EVENTS
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def close_work(self) -> None:
        try:
            self.work.close()
        except (BrokenPipeError, OSError):
            pass

    def kill(self, why: str, stack: bool = False) -> None:
        """SIGKILL the lane's process group (the lane and its ranks); `why` goes into its failures. With
        `stack`, SIGABRT first: pytest's faulthandler writes every thread's Python stack into the output."""
        self.killed_why = self.killed_why or why
        try:
            if stack and self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGABRT)
                self.proc.wait(timeout=_STACK_WAIT_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its ranks too: they are in its process group
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel: reported as it is, never waited on forever
            pass

    def story(self, what: str) -> str:
        """Why the lane stopped, and the end of its output."""
        rc = self.proc.returncode
        how = self.killed_why or (
            f"was killed by signal {signal.Signals(-rc).name} {what}"
            if rc and rc < 0
            else f"exited with status {rc} {what}"
        )
        try:
            tail = (self.dir / OUTPUT).read_bytes()[-_OUTPUT_TAIL:].decode(errors="replace")
        except OSError:
            tail = ""
        return (
            f"lane process {self.proc.pid} (slots {','.join(map(str, self.slots))}) {how}\n"
            f"----- last output of the lane process -----\n{tail}"
        )


@dataclass
class LaneStats:
    """What the lanes did, for the session summary: the plan's shape and every lane started."""

    devices: int
    seats: int
    gpus: bool
    lanes_at_once: int = 1
    started: int = 0
    peak_bytes: dict[str, int] = field(default_factory=dict)  # test -> most device memory its lane held
    #: tests that ran out of device memory beside other lanes: rerun alone, and only that run is reported
    rerun_alone: list[str] = field(default_factory=list)
    #: the session's stages as (name, start, end) on time.monotonic(): skips, lanes, exclusive tests alone
    stages: list[tuple[str, float, float]] = field(default_factory=list)
    #: seconds each lane process took to exit once told no work was left (its pools' ranks leave, then it)
    exits: list[float] = field(default_factory=list)
    pool_closes: list[float] = field(default_factory=list)  # seconds each lane's rank pools took to close
    #: dirty page cache (bytes) when the lanes ended, and the seconds writing it out took before the exclusive
    #: tests; the share of the host's CPU time the hypervisor stole while they ran (their timings' noise)
    disk_flush: tuple[int | None, float] | None = None
    #: seconds from the lanes' end until the exclusive tests could start: the last shelved runs and lane
    #: directories removed, the exclusive pools' warm-up joined (about 20 s on 2x H200)
    before_alone_s: float | None = None
    alone_steal: float | None = None
    #: the solo unit's tests its lane did not run (it died, or never got them): they run alone, last
    solo_left: list[str] = field(default_factory=list)


def _out_of_memory(report: pytest.TestReport) -> bool:
    """Whether a lane's test failed for lack of device memory (a neighbour may have held it)."""
    return report.failed and any(
        needle in str(report.longrepr) for needle in ("OutOfMemoryError", "CUDA out of memory")
    )


class LaneRunner:
    """Runs a Plan: lanes on the devices' seats while units wait, then the rest of the session here."""

    def __init__(
        self,
        session: pytest.Session,
        plan: Plan,
        gpus: bool,
        lane_timeout: float,
        phases: PhaseLog,
        occupancy: Occupancy,
        watch: GpuWatch,
        env: dict[str, str],
        group_done: Callable[[str], None] = lambda group: None,
        warm_up: Callable[[], threading.Thread] | None = None,
    ) -> None:
        """`env`: what every lane's environment adds (the session's shared facts). `group_done(group)` is
        called, in a thread of its own, once every unit of a group has run, while no lane runs a unit of another
        kind of group (the session then removes that strategy's shelved runs; a unit named for its module may
        read any).
        `warm_up()` is called once the work left is within reach of the lanes' end (schedule.warm_up_due) and
        returns the thread it warms in; the exclusive tests wait for it."""
        self.session, self.config = session, session.config
        self.plan, self.gpus = plan, gpus
        self.lane_timeout = lane_timeout
        self.phases = phases
        self.occupancy = occupancy
        self.watch = watch
        self.env = env
        self.group_done = group_done
        #: groups whose shelved runs a thread removes (tens of GiB a session: 15 s in this loop on an H200)
        self._drops: queue.Queue[str | None] = queue.Queue()
        self._dropper = threading.Thread(target=self._drop_loop, name="distbench-shelf-drops", daemon=True)
        self.drop_errors: list[str] = []
        #: ended lanes' directories (their tests' tmp_path: checkpoints of GiB each), removed by a thread of
        #: their own as lanes end: removed all at once at the session's end, they were on its critical path
        self._dirs: queue.Queue[Path | None] = queue.Queue()
        self._dir_remover = threading.Thread(
            target=self._remove_dirs, name="distbench-lane-dirs", daemon=True
        )
        self.warm_up = warm_up
        self._warming: threading.Thread | None = None
        self.solo = plan.solo  # the solo unit until its lane is handed it
        self.solo_run: LaneRun | None = None
        self._solo_since = 0.0
        self.groups_left = Counter(u.group for u in [*plan.units, *([plan.solo] if plan.solo else [])])
        self.done_groups: list[str] = []  # every unit run, waiting for group_done
        #: lanes that may run one group's units at once: a quarter of them, so several groups go side by side
        #: and few lanes wait on one group's shared run
        self.group_cap = max(1, -(-plan.lanes_at_once // 4))
        self.stats = LaneStats(plan.devices, plan.seats, gpus, plan.lanes_at_once)
        self.items = {it.nodeid: it for it in session.items}
        self.pending = list(plan.units)
        self.seats = Seats.of(plan.devices, plan.seats)
        if plan.solo:  # no one-rank lane there meanwhile: its unit could keep the solo waiting for minutes
            self.seats.closed_to_one_rank.add(plan.devices - 1)
        self.free_slices = list(range(plan.devices * plan.seats))
        self.running: list[LaneRun] = []
        #: lanes of each world size that exited, one after another, before asking for work
        self.start_failures: Counter[int] = Counter()
        self._root = Path(tempfile.mkdtemp(prefix="distbench-lanes-"))
        watch.on_sample = self._charge_memory

    # --- the session -----------------------------------------------------------------------------------
    def run(self) -> None:
        nxt: dict[str, pytest.Item | None] = {n: None for n in self.plan.first}
        t0 = time.monotonic()
        try:
            self._run_here(self.plan.first, nxt)
            t1 = time.monotonic()
            self.stats.stages.append(("skipped", t0, t1))
            self._dropper.start()
            self._dir_remover.start()
            self._run_lanes()
            t2 = time.monotonic()
            self.stats.stages.append(("lanes", t1, t2))
            self._drops.put(None)
            self._dirs.put(None)
            self._dropper.join()  # no disk work beside the exclusive tests' timings
            self._dir_remover.join()
            for error in self.drop_errors:
                warnings.warn(f"distbench: shelved runs of {error} were not removed", stacklevel=1)
            if self._warming is not None:
                self._warming.join()
            self.stats.before_alone_s = time.monotonic() - t2
            self.watch.on_sample = None  # the exclusive tests run alone: no lane memory to charge
            dirty, t3 = dirty_bytes(), time.monotonic()
            sync_filesystem(self._root)  # the lanes' checkpoints, and the shelf's beside them (TMPDIR)
            self.stats.disk_flush = (dirty, time.monotonic() - t3)
            alone = self.stats.rerun_alone + self.stats.solo_left + self.plan.alone
            here = [self.items[n] for n in alone]
            nxt = {it.nodeid: (here[i + 1] if i + 1 < len(here) else None) for i, it in enumerate(here)}
            before = cpu_stat()
            self._run_here(alone, nxt)
            self.stats.alone_steal = steal_share(before, cpu_stat())
            self.stats.stages.append(("alone", t2, time.monotonic()))
        finally:
            self.watch.on_sample = None
            self._drops.put(None)
            self._dirs.put(None)
            for run in self.running:
                run.kill("was stopped")
                run.close_work()
            shutil.rmtree(self._root, ignore_errors=True)

    def _run_here(self, nodeids: list[str], nxt: dict[str, pytest.Item | None]) -> None:
        for nodeid in nodeids:
            item = self.items[nodeid]
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt[nodeid])
            self._check_stop()

    def _check_stop(self) -> None:
        if self.session.shouldfail:
            raise self.session.Failed(self.session.shouldfail)
        if self.session.shouldstop:
            raise self.session.Interrupted(self.session.shouldstop)

    # --- lanes ------------------------------------------------------------------------------------------
    def _run_lanes(self) -> None:
        while self.pending or self.running or self.solo is not None:
            self._place_solo()
            if (
                self.warm_up is not None
                and self._warming is None
                and warm_up_due(self.pending, len(self.running))
            ):
                self._warming = self.warm_up()
            self._lend_last_seats()
            waiting = Counter(r.world_size for r in self.running if r is not self.solo_run and r.units == 0)
            serving = Counter(r.world_size for r in self._serving())
            while (ws := next_world_size(self.pending, waiting, self.seats, serving)) is not None:
                self._start(ws)
                waiting[ws] += 1
            for run in list(self.running):
                ended = run.proc.poll() is not None  # before reading: every event it wrote is then on disk
                for event in run.events():
                    self._on_event(run, event)
                    self._check_stop()
                if run.asked and not ended and not self._memory_tight(run):
                    self._hand_out(run)
                if ended:
                    self._ended(run)
                    self._dirs.put(run.dir)
                elif run.current and time.monotonic() - run.current_since > self.lane_timeout:
                    run.kill(
                        f"was killed: this test ran longer than --lane-timeout {self.lane_timeout:.0f}s "
                        "(its Python stack, if it could write one, is below)",
                        stack=True,
                    )
            self._release_groups()
            time.sleep(_POLL_S)
        self._release_groups()

    def _unit_finished(self, unit: Unit) -> None:
        self.groups_left[unit.group] -= 1
        if self.groups_left[unit.group] == 0:
            self.done_groups.append(unit.group)

    def _lend_last_seats(self) -> None:
        """Lanes of several ranks lend their seats to lanes of fewer ranks once the work of their world size
        still waiting is within LANE_START_S of the lanes serving it (schedule.starts_in_time): the narrower
        lanes' start (rank pool, imports, collection: 15-20 s under the lanes' load) then overlaps the wide
        lanes' last units, which they still take. Lent only once no wide unit waited, on 2x H200 the one-rank
        lanes' first tests began 18 s after the last world-size-2 unit was handed out, and both GPUs were
        0-34% busy for 30 s."""
        serving = Counter(r.world_size for r in self._serving())
        waiting_s = seconds_by_world_size(self.pending)
        for run in self.running:
            if (
                run.world_size > 1
                and not run.lent
                and run is not self.solo_run
                and not starts_in_time(waiting_s.get(run.world_size, 0.0), serving[run.world_size])
            ):
                run.lent = True
                self.seats.give(run.slots)

    def _serving(self) -> list[LaneRun]:
        """The lanes at work on units (not starting, not told to end), the solo's lane aside."""
        return [r for r in self.running if r is not self.solo_run and r.units > 0 and r.told_to_end is None]

    def _place_solo(self) -> None:
        """Once no unit of several ranks waits, keep the last device for the solo unit (no new lane there) and
        start the solo's lane on it: its start and warm-up (LANE_WARM_ENV) overlap the last units there."""
        if self.solo is None or self.solo_run is not None:
            return
        device = self.plan.devices - 1
        if any(u.world_size > 1 for u in self.pending):  # (again: a lane that died gave its unit back)
            self.seats.closed.discard(device)
            return
        self.seats.closed.add(device)
        self.solo_run = self._launch(1, [device], self.solo, shared=False, extra={LANE_WARM_ENV: "1"})

    def _hand_solo(self, run: LaneRun) -> None:
        """The solo lane asked: its unit once no other lane holds its device (a lent seat is free, yet its lane
        still runs there), else no answer yet; after its unit, none."""
        if self.solo is None:
            run.hand(None)
            return
        device = run.slots[0]
        held = any(device in r.slots for r in self.running if r is not run)
        if not held and self.seats.take_whole(device, self.plan.seats):
            self._solo_since = time.monotonic()
            run.hand(self.solo)
            self.solo = None

    def _hand_out(self, run: LaneRun) -> None:
        """The lane's next unit (None: no work it can run is left, and it ends; a fresh lane takes what it did
        not collect). While shelved runs are being removed, no unit that may read any group's runs
        (Unit.reads_any) starts: the lane asks again. The solo lane gets the solo unit, then none; a lane on
        the device kept for the solo gets none."""
        if run is self.solo_run:
            self._hand_solo(run)
            return
        if self.seats.closed.intersection(run.slots):
            run.hand(None)
            return
        busy = Counter(r.unit.group for r in self.running if r.unit is not None)
        dropping = self._drops.unfinished_tasks > 0
        startable = [u for u in self.pending if not (dropping and u.reads_any)]
        serving = sum(r.world_size == run.world_size for r in self.running if r is not self.solo_run)
        last_round = sum(u.world_size == run.world_size for u in self.pending) <= serving
        unit = take_unit(startable, run.world_size, busy, self.group_cap, run.collected, last_round)
        if unit is None and any(runnable(u, run.world_size, run.collected) for u in self.pending):
            return
        self.pending = [u for u in self.pending if u is not unit]
        run.hand(unit)

    def _release_groups(self) -> None:
        """Queue group_done for the groups all of whose units ran, once no lane runs a unit that may read any
        group's runs (Unit.reads_any); the dropper thread calls it."""
        if not self.done_groups or any(r.unit is not None and r.unit.reads_any for r in self.running):
            return
        for group in self.done_groups:
            self._drops.put(group)
        self.done_groups = []

    def _drop_loop(self) -> None:
        """The dropper thread: group_done for each queued group, until None. A removal that fails is reported
        when the lanes end (the runs stay until the session's end removes its shelf) and stops no other."""
        while (group := self._drops.get()) is not None:
            try:
                self.group_done(group)
            except Exception as e:  # reported by run(), not lost with this thread
                self.drop_errors.append(f"{group}: {type(e).__name__}: {e}")
            finally:
                self._drops.task_done()

    def _remove_dirs(self) -> None:
        """The lane directories' remover thread: each queued directory, until None."""
        while (path := self._dirs.get()) is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _memory_tight(self, run: LaneRun) -> bool:
        """Whether one of the lane's GPUs is fuller than _MEMORY_TIGHT while other lanes run (they may free
        it); never when the lane is the only one running, which could wait for nothing."""
        if not self.watch.used_bytes or len(self.running) < 2:
            return False
        used, total = self.watch.used_bytes[-1], self.watch.total_bytes
        return any(used[d] > _MEMORY_TIGHT * total[d] for d in run.slots if d < len(used))

    def _start(self, world_size: int) -> None:
        slots = self.seats.take(world_size)
        assert slots is not None, "next_world_size chose a world size without free seats"
        first = next(u for u in self.pending if u.world_size == world_size)
        candidates = [n for u in self.pending if u.world_size == world_size for n in u.nodeids]
        self._launch(world_size, slots, Unit(world_size, candidates, 0.0, device_type=first.device_type))

    def _launch(
        self,
        world_size: int,
        slots: list[int],
        work: Unit,
        shared: bool | None = None,
        extra: dict[str, str] | None = None,
    ) -> LaneRun:
        """Start a lane process on `slots` that may be given the tests of `work` (its first pool is of
        `work`'s tier); `shared`: whether lanes share its devices (by default, whether devices have seats);
        `extra`: what its environment adds."""
        slices, self.free_slices = self.free_slices[:world_size], self.free_slices[world_size:]
        self.stats.started += 1
        d = self._root / f"lane{self.stats.started}"
        d.mkdir()
        candidates = work.nodeids
        (d / ITEMS).write_text(json.dumps(candidates))
        paths = list(dict.fromkeys(str(self.items[n].path) for n in candidates))
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "distbench.testsuite.plugin",
            *forwarded_args(self.config),
            "-m",
            "",
            "-q",
            "--no-header",
            "--capture=tee-sys",
            "--basetemp",
            str(d / "tmp"),
            "--rootdir",
            str(self.config.rootpath),
            *(["-c", str(self.config.inipath)] if self.config.inipath else []),
            "--lanes",
            "off",
            "--distbench-lane",
            str(d),
            *paths,
        ]
        read_end, write_end = os.pipe()
        env = {
            **lane_env(slots, self.gpus, shared=self.plan.seats > 1 if shared is None else shared),
            **self.env,
            WORK_FD_ENV: str(read_end),
            LANE_POOL_ENV: f"{work.device_type}:{world_size}",
            **(extra or {}),
        }
        try:
            with open(d / OUTPUT, "wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    cwd=self.config.invocation_params.dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    pass_fds=(read_end,),
                    start_new_session=True,  # Ctrl-C reaches this process, which kills it
                    preexec_fn=_die_with_parent_and_bind(
                        lane_cpus(slices, self.plan.devices * self.plan.seats)
                    ),
                )
        finally:
            os.close(read_end)
        run = LaneRun(
            world_size,
            slots,
            slices,
            d,
            proc,
            os.fdopen(write_end, "w", encoding="utf-8"),
            frozenset(candidates),
        )
        self.running.append(run)
        return run

    def _on_event(self, run: LaneRun, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "start":
            run.current, run.current_since, run.reports = event["nodeid"], time.monotonic(), []
            self.occupancy.start(event["nodeid"])
        elif kind == "report":
            run.reports.append(self._report(event["data"]))
        elif kind == "phases":
            run.phases.update(event["by_test"])
        elif kind == "finish":
            self.occupancy.finish(event["nodeid"])
            if self.plan.seats > 1 and any(_out_of_memory(r) for r in run.reports):
                self.stats.rerun_alone.append(event["nodeid"])  # beside others: its own run comes last
            else:
                self._replay(event["nodeid"], run.reports)
            run.remaining.remove(event["nodeid"])
            run.current, run.reports = None, []
            if run.unit is not None and not run.remaining:
                self._unit_finished(run.unit)
                run.unit = None
        elif kind == "want":
            run.asked = run.started = True
            self.start_failures[run.world_size] = 0
        elif kind == "closed":
            self.stats.pool_closes.append(event["seconds"])
        elif kind == "collect":
            self.config.hook.pytest_collectreport(report=self._report(event["data"]))

    def _ended(self, run: LaneRun) -> None:
        """Account for a lane process that exited: blame the test it was in, give the rest of its work back."""
        self.running.remove(run)
        if run.told_to_end is not None:
            self.stats.exits.append(time.monotonic() - run.told_to_end)
        run.close_work()
        if run is self.solo_run:  # the device is the lanes' again
            if run.units:
                self.seats.free[run.slots[0]] = self.plan.seats
                self.stats.stages.append(("solo", self._solo_since, time.monotonic()))
            self.seats.closed.clear()
            self.seats.closed_to_one_rank.clear()
        elif not run.lent:
            self.seats.give(run.slots)
        self.free_slices += run.cpu_slices
        for test, phases in run.phases.items():
            self.phases.add(test, phases)
        if run is self.solo_run and self.solo is not None:  # never handed its unit: it runs here, alone, last
            self.stats.solo_left += self.solo.nodeids
            self.solo = None
            return
        if not (run.started or run.told_to_end is not None or run.killed_why):
            self.start_failures[run.world_size] += 1
            if self.start_failures[run.world_size] >= _START_TRIES:
                self._failed_to_start(run)
            return
        rest = run.remaining
        if run.current is not None:
            self.occupancy.finish(run.current)
            done = {r.when for r in run.reports}
            when = next((w for w in WHEN if w not in done), None)
            reports = list(run.reports)
            if when is not None:
                reports.append(self._failure(run.current, when, run.story("during this test")))
            self._replay(run.current, reports)
            rest = [n for n in rest if n != run.current]
            if rest and run is self.solo_run:  # the rest of the solo runs here, alone, last
                self.stats.solo_left += rest
            elif (
                rest and run.unit is not None
            ):  # it died in a test it is blamed for: a fresh one runs the rest
                share = run.unit.cost / len(run.unit.nodeids)
                self.pending.insert(
                    0, Unit(run.world_size, rest, share * len(rest), run.unit.group, run.unit.reads_any)
                )
            elif run.unit is not None:
                self._unit_finished(run.unit)
            return
        if run.unit is not None:
            self._unit_finished(run.unit)
        if rest:  # it stopped between tests: nothing to blame, nothing to rerun
            self._fail_unrun(rest, run.story("before running this test"))

    def _failed_to_start(self, run: LaneRun) -> None:
        """Lanes of a world size that exited _START_TRIES times in a row before asking for work could not import,
        collect or start their first pool: their tests fail with the last one's output, instead of lanes started
        without end."""
        story = run.story("before it could run a test (its start: imports, collection, its first pool)")
        mine = [u for u in self.pending if u.world_size == run.world_size]
        self.pending = [u for u in self.pending if u.world_size != run.world_size]
        for unit in mine:
            self._unit_finished(unit)
            self._fail_unrun(unit.nodeids, story)

    def _fail_unrun(self, nodeids: list[str], story: str) -> None:
        """Fail each test at its setup with `story`: a lane ended before it ran them."""
        for nodeid in nodeids:
            self._replay(nodeid, [self._failure(nodeid, "setup", story)])
            self._check_stop()

    def _charge_memory(self, by_pid: dict[int, int]) -> None:
        """From GpuWatch's thread: charge each lane's device memory (its ranks' processes) to its test."""
        sessions = session_of(list(by_pid))
        for run in list(self.running):
            test = run.current
            if test is None:
                continue
            held = sum(b for pid, b in by_pid.items() if sessions.get(pid) == run.proc.pid)
            if held > self.stats.peak_bytes.get(test, 0):
                self.stats.peak_bytes[test] = held

    # --- reports ----------------------------------------------------------------------------------------
    def _report(self, data: dict[str, Any]) -> Any:
        rep = self.config.hook.pytest_report_from_serializable(config=self.config, data=data)
        for name in ("location", "longrepr"):  # JSON made these tuples lists (a skip's longrepr is one)
            if isinstance(getattr(rep, name, None), list):
                setattr(rep, name, tuple(getattr(rep, name)))
        if isinstance(rep, pytest.TestReport):
            rep.user_properties = [(str(k), v) for k, v in rep.user_properties]
            rep.sections = [(str(k), str(v)) for k, v in rep.sections]
        return rep

    def _failure(self, nodeid: str, when: str, text: str) -> pytest.TestReport:
        item = self.items[nodeid]
        return pytest.TestReport(nodeid, item.location, {k: 1 for k in item.keywords}, "failed", text, when)  # type: ignore[arg-type]

    def _replay(self, nodeid: str, reports: list[pytest.TestReport]) -> None:
        """One test of a lane, as this session would have logged it had it run the test itself."""
        hook, location = self.config.hook, self.items[nodeid].location
        hook.pytest_runtest_logstart(nodeid=nodeid, location=location)
        for rep in reports:
            hook.pytest_runtest_logreport(report=rep)
        hook.pytest_runtest_logfinish(nodeid=nodeid, location=location)
