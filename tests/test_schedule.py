"""The lane plan (distbench.testsuite.schedule): units of work, largest first; seats that let lanes share devices, sized
by memory and host cores; exclusive cases alone and last, skipped ones first. Pure planning, for any number of
devices and world sizes: what `pytest -m gpu` does on N GPUs is shown here without them. And the lanes' rules
(lanes.py's LaneRunner) with fake lanes and units of several tests: which unit a lane may take, what a lane that
dies in a unit gives back, and when lanes that fail to start are given up."""

from __future__ import annotations

import io
import os
import queue
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

from distbench.testsuite.schedule import (
    Case,
    Plan,
    Seats,
    Unit,
    next_world_size,
    plan,
    runnable,
    seats_per_device,
    take_unit,
    warm_up_due,
)

if TYPE_CHECKING:
    from distbench.testsuite.lanes import LaneRun

GIB = 2**30


def cases(group: str, ws: int, n: int, module: str = "t.py", cost: float = 1.0, **kw: bool) -> list[Case]:
    return [Case(f"{module}::{group}{i}-ws{ws}", ws, group, cost=cost, **kw) for i in range(n)]


def test_a_unit_is_one_groups_cases_of_one_world_size_and_module_and_the_costliest_go_first(monkeypatch):
    """Without the long units' rule (its own test below): on 4 lanes each of these units is long."""
    from distbench.testsuite import schedule

    monkeypatch.setattr(schedule, "LONG_UNIT_SHARE", float("inf"))
    p = plan(
        cases("ddp", 1, 3)
        + cases("zero3", 1, 2, cost=5.0)
        + cases("zero3", 1, 1, module="u.py", cost=5.0)
        + cases("ddp", 2, 2),
        devices=2,
        seats=2,
    )
    assert [(u.world_size, len(u.nodeids), u.cost) for u in p.units] == [
        (1, 2, 10.0),
        (1, 1, 5.0),
        (1, 3, 3.0),
        (2, 2, 2.0),
    ]
    assert p.units[0].nodeids == ["t.py::zero30-ws1", "t.py::zero31-ws1"]  # collection order within a unit


def test_exclusive_cases_run_alone_last_and_skipped_ones_first():
    p = plan(
        [
            Case("b::ws2", 2, "g", exclusive=True),
            Case("b::ws1", 1, "g", exclusive=True),
            Case("s::skip", 1, "g", inert=True),
            *cases("ddp", 1, 2),
        ],
        devices=1,
        seats=4,
    )
    assert p.alone == ["b::ws1", "b::ws2"]  # world size 1 first: each world size's pool is built once
    assert p.first == ["s::skip"]
    assert all("b::" not in n and "s::" not in n for u in p.units for n in u.nodeids)


def test_lanes_at_once_count_seats_and_world_sizes():
    two_units = cases("ddp", 1, 1) + cases("zero3", 1, 1)
    assert plan(two_units, devices=1, seats=1).lanes_at_once == 1
    assert not plan(two_units, devices=1, seats=1).worth_it  # one GPU, one seat: run it here
    assert plan(two_units, devices=1, seats=8).lanes_at_once == 2  # no more lanes than units
    assert plan(two_units, devices=1, seats=8).worth_it
    ws2 = cases("ddp", 2, 1) + cases("zero3", 2, 1) + cases("fsdp", 2, 1)
    assert plan(ws2, devices=2, seats=2).lanes_at_once == 2  # two world-size-2 lanes on the same two GPUs
    assert plan(ws2, devices=4, seats=1).lanes_at_once == 2
    assert plan(cases("ddp", 4, 3), devices=2, seats=8).lanes_at_once == 0  # needs more GPUs than there are


def test_seats_spread_lanes_over_the_emptiest_devices_and_world_size_2_takes_two_distinct_ones():
    s = Seats.of(devices=2, seats=2)
    assert s.take(1) == [0] and s.take(1) == [1]  # the emptiest device first
    assert s.take(2) == [0, 1]  # one seat on each of two distinct devices
    assert s.take(2) is None and s.take(1) is None
    s.give([0, 1])
    assert s.take(2) == [0, 1]


def test_next_world_size_starts_lanes_while_seats_are_free_and_units_wait():
    pending = [Unit(1, ["a"], 5.0), Unit(2, ["b"], 3.0), Unit(1, ["c"], 1.0)]
    seats = Seats.of(devices=2, seats=1)
    assert next_world_size(pending, {}, seats) == 1  # the most pending cost first
    assert next_world_size(pending, {1: 2}, seats) == 2  # two ws1 lanes already wait for the two ws1 units
    seats.take(1)
    assert next_world_size(pending, {1: 2}, seats) is None  # ws2 needs two devices with a free seat
    assert take_unit(pending, 1) == Unit(1, ["a"], 5.0) and take_unit(pending, 4) is None


def test_no_lane_starts_for_less_work_than_the_busy_lanes_do_while_it_starts():
    """A GPU given back (the solo's, done) frees seats while the last units wait: twelve busy lanes take 20 s
    of them before a new lane could ask (LANE_START_S each), so none starts; with none busy, or more work than
    they take meanwhile, one does."""
    from distbench.testsuite.schedule import LANE_START_S

    pending = [Unit(1, [f"t{i}"], 2.0) for i in range(10)]
    seats = Seats.of(devices=2, seats=12)
    assert next_world_size(pending, {}, seats, serving={1: 12}) is None
    assert next_world_size(pending, {}, seats, serving={}) == 1
    assert next_world_size(pending, {}, seats, serving={1: 1}) == 1  # 20 s against one lane's 15 s
    many = pending * int(12 * LANE_START_S / 20 + 1)
    assert next_world_size(many, {}, seats, serving={1: 12}) == 1


def test_seats_per_device_is_bounded_by_memory_and_by_host_cores():
    # one H200 (141 GiB) of 16 host cores: GPT-2 124M ranks (~5 GiB) fit 22 times, the cores allow 8
    assert seats_per_device(1, 141 * GIB, 5 * GIB, cores=16) == 8
    # GPT-2 XL ranks (~38 GiB): memory allows 2 on an H200, 1 on an H100 (80 GiB)
    assert seats_per_device(1, 141 * GIB, 38 * GIB, cores=16) == 2
    assert seats_per_device(1, 80 * GIB, 38 * GIB, cores=16) == 1
    # two GPUs or more count 4/3 cores a rank: 2x H200 (32 vCPUs) gets the 12 seats measured faster than 8
    assert seats_per_device(2, 141 * GIB, 5 * GIB, cores=32) == 12
    assert seats_per_device(8, 141 * GIB, 5 * GIB, cores=128) == 12
    assert seats_per_device(2, 80 * GIB, 5 * GIB, cores=32) == 12  # an H100 runner: memory allows 12 too
    assert seats_per_device(1, 141 * GIB, 5 * GIB, cores=16, cores_per_rank=1.5) == 10
    assert seats_per_device(2, None, None, cores=2) == 1  # never below one


def _simulate(p: Plan, durations: dict[str, float]) -> tuple[float, int]:
    """Makespan and the most lanes at once when lanes take units as lanes.py hands them out."""
    pending, seats, t, running = list(p.units), Seats.of(p.devices, p.seats), 0.0, []
    most = 0
    while pending or running:
        while (ws := next_world_size(pending, {}, seats)) is not None:
            unit = take_unit(pending, ws)
            assert unit is not None
            running.append((t + sum(durations[n] for n in unit.nodeids), seats.take(ws), unit))
        most = max(most, len(running))
        running.sort(key=lambda r: r[0])
        t, slots, _ = running.pop(0)
        seats.give(slots)
    return t, most


def test_a_plan_keeps_every_seat_busy_and_finishes_near_the_ideal():
    rng = random.Random(0)
    cs = [
        c
        for g in range(12)
        for c in cases(f"s{g}", 1, rng.randint(5, 20), module=f"m{g % 4}.py", cost=rng.uniform(0.5, 3))
    ]
    durations = {c.nodeid: c.cost for c in cs}
    p = plan(cs, devices=1, seats=8)
    makespan, most = _simulate(p, durations)
    ideal = sum(durations.values()) / 8
    longest = max(u.cost for u in p.units)
    assert most == 8
    assert makespan <= ideal + longest  # list scheduling's bound, largest units first
    # N GPUs, world sizes 1 and 2 sharing them: every case runs once, within the same bound
    cs2 = cs + [c for g in range(4) for c in cases(f"w{g}", 2, 5, cost=2.0)]
    p2 = plan(cs2, devices=2, seats=4)
    makespan2, most2 = _simulate(p2, {c.nodeid: c.cost for c in cs2})
    assert sorted(n for u in p2.units for n in u.nodeids) == sorted(c.nodeid for c in cs2)
    assert most2 == 8 and makespan2 <= sum(c.cost for c in cs2) / 4 + max(u.cost for u in p2.units)


def test_a_long_unit_is_split_into_its_tests_which_start_first_and_the_plan_ends_near_the_ideal():
    """Two strategies of eight 10-s units each, and one module's three fault tests (20 + 15 + 5 s), on 4 lanes:
    in group order that unit comes last and runs alone after the rest (80 s); split and first, its tests run
    beside the rest, and the plan ends within one short unit of the ideal 50 s."""
    cs = [
        *[c for i in range(8) for c in cases("zero3", 2, 1, module=f"z{i}.py", cost=10.0)],
        *[c for i in range(8) for c in cases("ddp", 2, 1, module=f"d{i}.py", cost=10.0)],
        *[Case(f"faults.py::t{i}", 2, "faults.py", cost=cost) for i, cost in enumerate((20.0, 15.0, 5.0))],
    ]
    p = plan(cs, devices=2, seats=4)
    long = [(u.nodeids, u.cost, u.group) for u in p.units if u.group == "faults.py"]
    assert long == [
        (["faults.py::t0"], 20.0, "faults.py"),
        (["faults.py::t1"], 15.0, "faults.py"),
        (["faults.py::t2"], 5.0, "faults.py"),
    ]
    assert [u.group for u in p.units[:6]] == ["faults.py", "ddp"] * 3, (
        "the long tests lead one in two: lanes that start at once do not all start host-bound tests"
    )
    rest = [u.group for u in p.units if u.group != "faults.py"]
    assert rest == ["ddp"] * 8 + ["zero3"] * 8, "the rest keep their group order"
    makespan, _ = _simulate(p, {c.nodeid: c.cost for c in cs})
    assert makespan <= 200 / 4 + 10


def test_long_tests_alternate_with_the_rest_within_each_world_size():
    """A lane takes units of its own world size only: the one-rank long test leads the one-rank units, and the
    two-rank long tests alternate with the two-rank units (not with one-rank units those lanes skip)."""
    cs = [
        *[c for i in range(6) for c in cases("ddp", 2, 1, module=f"d{i}.py", cost=10.0)],
        *[c for i in range(6) for c in cases("ddp", 1, 1, module=f"s{i}.py", cost=10.0)],
        *[Case(f"ck.py::t{i}[ws2]", 2, "ck.py", cost=40.0 - i) for i in range(3)],
        Case("ck.py::one[ws1]", 1, "ck.py", cost=50.0),
    ]
    p = plan(cs, devices=2, seats=2)
    for ws in (1, 2):
        mine = [u.group for u in p.units if u.world_size == ws]
        n_long = mine.count("ck.py")
        assert mine[: 2 * n_long] == ["ck.py", "ddp"] * n_long, (ws, mine)


def test_a_lane_takes_another_groups_unit_when_enough_lanes_run_one_group():
    pending = [Unit(1, ["a"], 5.0, "zero3"), Unit(1, ["b"], 4.0, "zero3"), Unit(1, ["c"], 3.0, "ddp")]
    assert take_unit(list(pending), 1, {"zero3": 2}, cap=2).group == "ddp"
    assert take_unit(list(pending), 1, {"zero3": 1}, cap=2).nodeids == ["a"]
    assert take_unit(list(pending[:2]), 1, {"zero3": 2}, cap=2).nodeids == [
        "a"
    ]  # nothing else: it waits less


def test_the_last_round_of_a_world_size_hands_out_its_costliest_unit_first(tmp_path):
    """Once no more units of a world size wait than lanes serve it, a lane takes the costliest: the round then
    ends with short units, not with a long one handed out last (a GPU held for a minute after the rest)."""
    pending = [Unit(2, ["a"], 5.0, "ddp"), Unit(2, ["c"], 3.0, "zero3"), Unit(2, ["faults"], 60.0, "f.py")]
    assert take_unit(list(pending), 2).nodeids == ["a"]  # plan order while more units wait
    assert take_unit(list(pending), 2, last_round=True).nodeids == ["faults"]
    assert take_unit(list(pending), 2, {"f.py": 1}, cap=1, last_round=True).nodeids == ["a"]  # the cap first
    lanes = FakeLanes(pending, tmp_path)
    first = lanes.lane(2)
    assert lanes.ask(first).nodeids == ["a"], "one lane for three units: not yet the last round"
    lanes.lane(2)
    assert lanes.ask(lanes.lane(2)).nodeids == ["faults"], "three lanes for two units: the costliest first"


def test_the_exclusive_pools_warm_once_the_work_left_is_within_the_lead_of_the_lanes_end():
    """Not at the lanes' start (the warm-up's ranks would compete with a full load) and not once every unit is
    handed out (the lanes' last units are then shorter than the warm-up, which the first exclusive test waits
    for): when the pending work, shared by the running lanes, is within WARM_UP_LEAD_S."""
    pending = [Unit(1, [f"t{i}"], 20.0) for i in range(12)]  # 240 s of work
    assert not warm_up_due(pending, lanes_running=4, lead_s=30.0)  # 60 s each
    assert warm_up_due(pending, lanes_running=8, lead_s=30.0)  # 30 s each
    assert not warm_up_due(pending[:2], lanes_running=0, lead_s=30.0), "no lane yet: 40 s for one"
    assert warm_up_due([], lanes_running=0, lead_s=30.0)


def test_a_module_units_cases_keep_every_groups_shared_runs_until_it_ends():
    """A unit grouped by module (no strategy parameter) may read any strategy's shelved runs: a finished
    strategy's runs go only once no such unit runs (LaneRunner._release_groups); the solo unit is not one."""
    from types import SimpleNamespace

    from distbench.testsuite.lanes import LaneRunner

    p = plan([Case("m.py::t", 1, "m.py", reads_any=True), Case("s.py::t[zero3]", 1, "zero3")], devices=1)
    by_group = {u.group: u for u in p.units}
    assert by_group["m.py"].reads_any and not by_group["zero3"].reads_any

    runner = object.__new__(LaneRunner)
    runner._drops = queue.Queue()
    runner.done_groups = ["zero3"]
    runner.running = [SimpleNamespace(unit=by_group["m.py"])]
    runner._release_groups()
    assert runner._drops.empty(), (
        "zero3's runs were queued for removal while a module's unit that may read them ran"
    )
    runner.running = [SimpleNamespace(unit=None)]
    runner._release_groups()
    assert runner._drops.get_nowait() == "zero3"
    # the solo's exclusive cases (a module's among them) read no strategy's runs: removals go on beside it
    solo = plan([Case("m.py::x", 1, "m.py", exclusive=True, reads_any=True)], devices=2, solo=True).solo
    runner.done_groups, runner.running = ["ddp"], [SimpleNamespace(unit=solo)]
    runner._release_groups()
    assert runner._drops.get_nowait() == "ddp", "the solo held back a finished strategy's removal"


def test_no_unit_that_may_read_any_groups_runs_starts_while_shelved_runs_are_removed():
    """The removals run in a thread beside the lanes' loop (LaneRunner._drop_loop): while one is under way, a
    lane is handed only units of one strategy; a module's unit waits (the lane is not told to end), and starts
    once the removal is done."""
    from types import SimpleNamespace

    from distbench.testsuite.lanes import LaneRunner

    module_unit, strategy_unit = (
        Unit(1, ["m.py::t"], 9.0, "m.py", reads_any=True),
        Unit(1, ["s.py::t"], 1.0, "ddp"),
    )
    runner = object.__new__(LaneRunner)
    runner._drops, runner.running, runner.group_cap = queue.Queue(), [], 2
    runner.pending = [module_unit, strategy_unit]
    runner.solo_run, runner.seats = None, Seats.of(1, 2)
    handed: list[Unit | None] = []
    lane = SimpleNamespace(
        world_size=1, slots=[0], hand=handed.append, collected=frozenset({"m.py::t", "s.py::t"})
    )

    runner._drops.put("zero3")  # a removal under way
    runner._hand_out(lane)
    assert handed == [strategy_unit]
    runner._hand_out(lane)
    assert handed == [strategy_unit], (
        "the module's unit started, or the lane was told to end, during a removal"
    )
    runner._drops.get_nowait()
    runner._drops.task_done()
    runner._hand_out(lane)
    runner._hand_out(lane)
    assert handed == [strategy_unit, module_unit, None] and runner.pending == []
    # work pending that this lane did not collect: it is told to end, and a fresh lane collects it
    runner.pending = [Unit(1, ["late.py::t"], 1.0, "ddp")]
    runner._hand_out(lane)
    assert handed[-1] is None and len(runner.pending) == 1


def test_a_unit_holds_one_tier_so_its_lane_can_start_that_pool_first():
    """The CPU and GPU cases of one test and world size are two units: a lane spawns its first unit's rank
    pool (gloo or NCCL) before it collects (lane_child.LANE_POOL_ENV), which one pool kind per unit allows."""
    p = plan(
        [Case("t.py::p[ddp-ws2]", 2, "ddp"), Case("t.py::p[ddp-ws2-gpu]", 2, "ddp", device_type="cuda")],
        devices=2,
    )
    assert sorted((u.device_type, u.nodeids[0]) for u in p.units) == [
        ("cpu", "t.py::p[ddp-ws2]"),
        ("cuda", "t.py::p[ddp-ws2-gpu]"),
    ]


def test_a_lane_never_takes_a_unit_with_a_test_it_did_not_collect():
    """The rest of a unit whose lane died is pending again after other lanes started: a lane that collected
    only what was pending when it started cannot run it (it would end 'before running this test')."""
    rest = Unit(1, ["t.py::after_hang"], 1.0, "g")
    pending = [rest, Unit(1, ["t.py::b"], 2.0, "g")]
    assert take_unit(list(pending), 1, collected={"t.py::b"}).nodeids == ["t.py::b"]
    assert take_unit(list(pending), 1, collected={"t.py::c"}) is None
    assert take_unit(list(pending), 1, collected={"t.py::after_hang", "t.py::b"}) is rest
    assert take_unit(list(pending), 1) is rest  # no record of what it collected: any of its world size


def test_a_lane_imports_the_distbench_its_session_runs():
    """A lane is a fresh interpreter started with `-p distbench.testsuite.plugin`, before any ini pythonpath
    applies: its PYTHONPATH must lead to this distbench, also where it is not installed (a checkout run with
    `pythonpath = src`). It pointed into the package itself once, and every lane died at its start."""
    from importlib.machinery import PathFinder

    import distbench
    from distbench.testsuite.lanes import lane_env

    first = lane_env([0], gpus=False)["PYTHONPATH"].split(os.pathsep)[0]
    spec = PathFinder.find_spec("distbench", [first])
    assert spec is not None and spec.origin == distbench.__file__, first


# --- the lanes' rules over units of several tests, with fake lanes (LaneRunner's decisions, no processes) ------
# A unit of one test cannot tell "every test collected" from "one collected", nor "the rest of a unit" from "all
# of it": these units hold several, and lanes collect part of them, die in their middle, or fail to start.


def test_a_lane_takes_a_unit_only_when_it_collected_every_one_of_its_tests():
    unit = Unit(1, ["t.py::a", "t.py::b", "t.py::c"], 3.0, "g")
    assert not runnable(unit, 1, {"t.py::a", "t.py::b"}), "a lane that collected 2 of its 3 tests took it"
    assert runnable(unit, 1, {"t.py::a", "t.py::b", "t.py::c", "u.py::x"})
    assert not runnable(unit, 2, None)
    later = Unit(1, ["u.py::x", "u.py::y"], 1.0, "g")
    assert take_unit([unit, later], 1, collected={"t.py::a", "u.py::x", "u.py::y"}) is later
    assert take_unit([unit, later], 1, collected={"t.py::c", "u.py::y"}) is None


class FakeLanes:
    """A LaneRunner without a session or processes: lanes are LaneRuns of fake processes, the tests they run are
    told to it as a lane's events would, and what it would report is recorded in `reported`."""

    def __init__(self, units: list[Unit], tmp_path: Path) -> None:
        from distbench.testsuite.lanes import LaneRunner

        r = self.runner = object.__new__(LaneRunner)
        r.pending, r.running, r.done_groups = list(units), [], []
        r.groups_left = Counter(u.group for u in units)
        r.start_failures = Counter()
        r.seats, r.free_slices, r.group_cap = Seats.of(2, 2), [], 1
        r.plan = SimpleNamespace(seats=2, devices=2, solo=None)
        r.solo = r.solo_run = None
        r.stats = SimpleNamespace(exits=[], rerun_alone=[], solo_left=[], stages=[])
        r.phases = r.occupancy = SimpleNamespace(
            add=lambda *a: None, start=lambda n: None, finish=lambda n: None
        )
        r._drops = queue.Queue()
        r.session = SimpleNamespace(shouldfail=False, shouldstop=False)
        r.items = {n: SimpleNamespace(location=(n, 0, n), keywords={}) for u in units for n in u.nodeids}
        self.reported: dict[str, list[tuple[str, str]]] = {}
        self.why: dict[str, str] = {}  # a failed test's text

        def replay(nodeid: str, reports: list[pytest.TestReport]) -> None:
            self.reported.setdefault(nodeid, []).extend((rep.when, rep.outcome) for rep in reports)
            for rep in (rep for rep in reports if rep.failed):
                self.why[nodeid] = str(rep.longrepr)

        r._replay = replay
        self.tmp_path, self.lanes = tmp_path, 0

    def lane(
        self, world_size: int, slots: list[int] | None = None, collected: list[str] | None = None
    ) -> LaneRun:
        """A lane started now on `slots` (by default the first `world_size`): it collected `collected`, by
        default the tests of its world size pending now (as LaneRunner._start)."""
        from distbench.testsuite.lanes import LaneRun

        self.lanes += 1
        d = self.tmp_path / f"lane{self.lanes}"
        d.mkdir()
        if collected is None:
            collected = [n for u in self.runner.pending if u.world_size == world_size for n in u.nodeids]
        proc = SimpleNamespace(pid=1000 + self.lanes, returncode=None)
        slots = [0, 1][:world_size] if slots is None else slots
        run = LaneRun(world_size, slots, [], d, proc, io.StringIO(), frozenset(collected))  # type: ignore[arg-type]
        self.runner.running.append(run)
        return run

    def ask(self, run: LaneRun) -> Unit | None:
        """The lane asks for work (its first ask: it started) and is handed what LaneRunner hands it."""
        self.runner._on_event(run, {"event": "want"})
        self.runner._hand_out(run)
        return run.unit

    def passes(self, run: LaneRun, nodeid: str) -> None:
        self.runner._on_event(run, {"event": "start", "nodeid": nodeid})
        self.runner._on_event(run, {"event": "finish", "nodeid": nodeid})
        self.reported.setdefault(nodeid, []).append(("call", "passed"))

    def exits(self, run: LaneRun, status: int = 1) -> None:
        run.proc.returncode = status
        self.runner._ended(run)


def test_a_lane_that_dies_in_a_unit_fails_that_test_and_only_a_lane_that_collected_the_rest_runs_it(tmp_path):
    """A lane dies in the 2nd of a unit's 4 tests: that test fails with the lane's story, the 1st stays passed,
    and the 3rd and 4th (only they) are pending again, first. A lane started after that collected them and takes
    them; one that started before the unit was planned (it collected other tests) does not."""
    unit = Unit(1, ["t.py::a", "t.py::b", "t.py::c", "t.py::d"], 4.0, "g")
    lanes = FakeLanes([unit, Unit(1, ["t.py::z"], 1.0, "h")], tmp_path)
    first = lanes.lane(1)
    assert lanes.ask(first) is unit
    lanes.passes(first, "t.py::a")
    lanes.runner._on_event(first, {"event": "start", "nodeid": "t.py::b"})
    lanes.exits(first, status=-9)
    assert lanes.reported["t.py::a"] == [("call", "passed")]
    assert lanes.reported["t.py::b"] == [("setup", "failed")]
    assert "lane process 1001 (slots 0) was killed by signal SIGKILL during this test" in lanes.why["t.py::b"]
    assert [u.nodeids for u in lanes.runner.pending] == [["t.py::c", "t.py::d"], ["t.py::z"]]
    assert lanes.runner.groups_left["g"] == 1, "the unit counted as run while its rest is pending"
    stale = lanes.lane(1)
    stale.collected = frozenset({"t.py::z"})  # it started when only z was pending
    assert lanes.ask(stale).nodeids == ["t.py::z"]
    fresh = lanes.lane(1)
    assert lanes.ask(fresh).nodeids == ["t.py::c", "t.py::d"]
    lanes.passes(fresh, "t.py::c")
    lanes.passes(fresh, "t.py::d")
    assert lanes.runner.groups_left["g"] == 0 and lanes.runner.done_groups == ["g"]


def test_lanes_of_a_world_size_are_given_up_after_failing_to_start_twice_in_a_row_only(tmp_path):
    """A lane that exits before asking for work failed to start (imports, collection, its first pool). One such
    exit is tried again (a passing cause: memory another lane held); a lane of that world size that starts
    clears the count; two in a row fail every pending test of that world size, each with the last lane's story,
    and leave the other world sizes' units pending."""
    two = [Unit(2, ["w.py::p", "w.py::q"], 2.0, "g"), Unit(2, ["w.py::r", "w.py::s"], 2.0, "h")]
    one = Unit(1, ["o.py::x"], 1.0, "g")
    lanes = FakeLanes([*two, one], tmp_path)
    lanes.exits(lanes.lane(2))  # fails to start
    assert lanes.reported == {} and len(lanes.runner.pending) == 3, "given up after one failed start"
    started = lanes.lane(2)
    assert lanes.ask(started) is two[0]
    lanes.passes(started, "w.py::p")
    lanes.passes(started, "w.py::q")
    lanes.exits(started, status=0)
    lanes.exits(lanes.lane(2))  # fails to start again, after one started
    assert "w.py::r" not in lanes.reported, (
        "given up on a failed start after a lane of its world size started"
    )
    assert lanes.runner.pending == [two[1], one]
    lanes.exits(lanes.lane(2))  # and again: twice in a row
    assert lanes.reported["w.py::r"] == lanes.reported["w.py::s"] == [("setup", "failed")]
    assert (
        "lane process 1004 (slots 0,1) exited with status 1 before it could run a test"
        in lanes.why["w.py::s"]
    )
    assert lanes.runner.pending == [one] and lanes.runner.groups_left["h"] == 0
    assert "o.py::x" not in lanes.reported, "a world size whose lanes could start was given up too"


def test_one_rank_exclusive_cases_make_the_solo_unit_on_two_devices_or_more():
    """On 2+ GPUs the one-rank exclusive cases run in a lane of their own (Plan.solo); those of several ranks
    still run alone, last; on one GPU, or without `solo`, all of them do."""
    mixed = [
        Case("b::ws2", 2, "g", exclusive=True),
        Case("b::ws1", 1, "g", exclusive=True, cost=3.0),
        Case("c::ws1", 1, "h", exclusive=True, cost=2.0),
        Case("s::skip", 1, "g", exclusive=True, inert=True),
        *cases("ddp", 1, 2),
    ]
    p = plan(mixed, devices=2, seats=4, solo=True)
    assert p.solo is not None and p.solo.nodeids == ["b::ws1", "c::ws1"] and p.solo.world_size == 1
    assert p.solo.cost == 5.0 and not p.solo.reads_any, "strategies' shelved runs are not held for the solo"
    assert p.alone == ["b::ws2"] and p.first == ["s::skip"]
    assert all(n not in p.solo.nodeids for u in p.units for n in u.nodeids)
    assert plan(mixed, devices=1, seats=4, solo=True).solo is None
    lone = [Case("b::ws1", 1, "g", exclusive=True), *cases("ddp", 1, 1)]
    assert plan(lone, devices=2, seats=1, solo=True).worth_it, "the solo beside one lane is two at once"
    assert not plan(lone, devices=2, seats=1).worth_it
    assert plan(mixed, devices=2, seats=4).alone == ["b::ws1", "c::ws1", "b::ws2"]
    # a one-rank case that needs a quiet host (exclusive(quiet_host=True): an MFU truth, whose launch-bound
    # step read 0.59 of the matmuls' rate beside the other GPU's lanes) runs alone, never in the solo
    quiet = [*mixed, Case("m::mfu", 1, "m", exclusive=True, quiet_host=True)]
    p = plan(quiet, devices=2, seats=4, solo=True)
    assert p.solo is not None and "m::mfu" not in p.solo.nodeids and p.alone == ["m::mfu", "b::ws2"]


def test_the_solo_gets_the_last_device_whole_once_no_unit_of_several_ranks_waits(tmp_path):
    """While a world-size-2 unit waits the last device stays open. Then no new lane takes a seat there, a
    one-rank lane there is told to end at its next ask, and the solo's lane starts at once (its start and
    warm-up overlap the last units there) but is handed its unit only once no other lane is on the device,
    lent seat or not, while a lane on the other device goes on. When the solo's lane ends the device is the
    lanes' again."""
    solo = Unit(1, ["b.py::spin", "b.py::mfu"], 5.0, "exclusive, one rank")
    wide, narrow = Unit(2, ["w.py::p"], 2.0, "g"), Unit(1, ["o.py::x", "o.py::y"], 2.0, "h")
    lanes = FakeLanes([wide, narrow], tmp_path)
    r = lanes.runner
    r.plan.solo = r.solo = solo
    r.groups_left[solo.group] = 1
    launched: list[tuple[list[int], dict[str, str]]] = []

    def launch(ws: int, slots: list[int], work: Unit, shared: bool | None = None, extra=None) -> LaneRun:
        launched.append((slots, extra or {}))
        return lanes.lane(ws, slots, work.nodeids)

    r._launch = launch
    on_last = lanes.lane(1, [1])
    assert r.seats.take(1) == [0] and r.seats.take(1) == [1]  # seats of the lanes on 0 and on 1
    r._place_solo()
    assert not r.seats.closed and not launched, "the device was kept while a world-size-2 unit waited"
    wide_lane = lanes.lane(2)
    assert r.seats.take(2) == [0, 1] and lanes.ask(wide_lane) is wide
    r._place_solo()
    assert r.seats.closed == {1} and launched == [([1], {"DISTBENCH_LANE_WARM": "1"})]
    solo_lane = r.solo_run
    assert r.seats.take(1) is None, "a new lane took a seat on the device kept for the solo"
    assert lanes.ask(solo_lane) is None and solo_lane.told_to_end is None, "handed, or told to end, too soon"
    assert lanes.ask(on_last) is None and on_last.told_to_end is not None
    lanes.exits(on_last, status=0)
    r._lend_last_seats()  # the world-size-2 lane runs its last unit: its seats are lent ...
    assert wide_lane.lent and r.seats.free == [1, 2]
    r._place_solo()
    assert lanes.ask(solo_lane) is None, "the solo began beside a lane of two ranks on its last unit"
    lanes.passes(wide_lane, "w.py::p")
    lanes.exits(wide_lane, status=0)
    assert r.seats.free == [1, 2], "a lent lane's seats were given back twice"
    assert lanes.ask(solo_lane) is solo and r.seats.free[1] == 0 and r.solo is None
    other = lanes.lane(1, [0])
    assert lanes.ask(other) is narrow, "a lane on the other device stopped getting work"
    lanes.passes(solo_lane, "b.py::spin")
    lanes.passes(solo_lane, "b.py::mfu")
    assert lanes.ask(solo_lane) is None, "the solo lane got other work"
    lanes.exits(solo_lane, status=0)
    assert r.seats.free[1] == 2 and not r.seats.closed and r.groups_left[solo.group] == 0
    assert [name for name, *_ in r.stats.stages] == ["solo"] and len(launched) == 1


def test_a_wide_unit_given_back_opens_the_kept_device_and_a_dead_solos_rest_runs_alone(tmp_path):
    solo = Unit(1, ["b.py::spin", "b.py::mfu", "b.py::sweep"], 5.0, "exclusive, one rank")
    lanes = FakeLanes([solo], tmp_path)  # (it knows the solo's tests)
    r = lanes.runner
    r.plan.solo = r.solo = solo
    r.seats.closed.add(1)
    r.pending = [Unit(2, ["w.py::q"], 1.0, "g")]  # the rest of a unit whose lane died
    r._place_solo()
    assert not r.seats.closed and r.solo_run is None, (
        "a world-size-2 unit given back waits on the kept device"
    )
    r.pending = []
    r._launch = lambda ws, slots, work, shared=None, extra=None: lanes.lane(ws, slots, work.nodeids)
    r._place_solo()
    run = r.solo_run
    assert lanes.ask(run) is solo
    lanes.passes(run, "b.py::spin")
    r._on_event(run, {"event": "start", "nodeid": "b.py::mfu"})
    lanes.exits(run, status=-9)
    assert lanes.reported["b.py::mfu"] == [("setup", "failed")]
    assert r.stats.solo_left == ["b.py::sweep"] and r.pending == [], "the solo's rest went to a shared lane"
    (tmp_path / "never").mkdir()
    never = FakeLanes([solo], tmp_path / "never")
    nr = never.runner
    nr.plan.solo, nr.solo, nr.pending = solo, solo, []
    nr._launch = lambda ws, slots, work, shared=None, extra=None: never.lane(ws, slots, work.nodeids)
    nr._place_solo()
    never.runner._on_event(nr.solo_run, {"event": "want"})  # it started and waits for its device ...
    never.exits(nr.solo_run)  # ... and died there: its tests run here, where their errors show
    assert nr.stats.solo_left == solo.nodeids and not never.reported and nr.solo is None
    assert nr.seats.free == [2, 2], "a solo that never had its device gave seats back"


def test_a_wide_lane_lends_its_seats_to_narrower_lanes_once_its_work_left_is_within_a_lanes_start(tmp_path):
    """Once the world-size-2 work still waiting is within LANE_START_S of the lanes serving it, a world-size-2
    lane's seats go to one-rank lanes, whose start then overlaps its last units, which it still takes; while
    more waits, they do not; one-rank lanes never lend."""
    wide = [Unit(2, ["w.py::p"], 2.0, "g"), Unit(2, ["w.py::q"], 10.0, "g"), Unit(2, ["w.py::r"], 9.0, "g")]
    lanes = FakeLanes([*wide, Unit(1, ["o.py::x"], 1.0, "h")], tmp_path)
    r = lanes.runner
    first, narrow = lanes.lane(2), lanes.lane(1, [0])
    assert r.seats.take(2) == [0, 1] and r.seats.take(1) == [0] and lanes.ask(first) is wide[0]
    r._lend_last_seats()
    assert not first.lent and r.seats.free == [0, 1], (
        "seats lent while 19 s of two-rank work waited for a lane"
    )
    lanes.passes(first, "w.py::p")
    assert lanes.ask(first) is wide[1]  # 9 s of two-rank work left: less than a lane's start
    r._lend_last_seats()
    r._lend_last_seats()
    assert first.lent and not narrow.lent and r.seats.free == [1, 2]
    serving = Counter(lane.world_size for lane in r._serving())
    assert serving == {2: 1}
    assert next_world_size(r.pending, {}, r.seats, serving) == 1, "a one-rank lane starts on the lent seats"
    lanes.passes(first, "w.py::q")
    assert lanes.ask(first) is wide[2], "the lent lane still takes its world size's last unit"


def test_a_device_kept_for_the_solo_seats_wider_lanes_but_no_one_rank_lane():
    """Before the solo runs, its device takes world-size-2 lanes (they need it) but no one-rank lane, whose
    unit (minutes of one strategy's cases) would keep the solo waiting once the wide lanes are done."""
    s = Seats.of(devices=2, seats=2)
    s.closed_to_one_rank.add(1)
    assert s.take(1) == [0] and s.take(1) == [0] and s.take(1) is None
    assert next_world_size([Unit(1, ["a"], 1.0)], {}, s) is None
    s.give([0])
    assert s.take(2) == [0, 1]


# --- single rules of the plan and the seats, each with hand-computed expectations -------------------------------


def test_a_device_seats_one_lane_unless_told_otherwise():
    """`plan`'s seats default to 1: two units on one device without a seat count run one at a time."""
    p = plan(cases("ddp", 1, 1) + cases("zero3", 1, 1), devices=1)
    assert p.seats == 1 and p.lanes_at_once == 1 and not p.worth_it


def test_groups_go_in_order_of_their_whole_cost_not_of_their_last_unit(monkeypatch):
    """A group's place is the sum of its units' seconds: three 2-s units of one strategy (6 s, in three modules)
    go before another strategy's single 5-s unit, though each of them is shorter."""
    from distbench.testsuite import schedule

    monkeypatch.setattr(schedule, "LONG_UNIT_SHARE", float("inf"))  # no unit split: the group order alone
    cs = [
        Case("a.py::t[many]", 1, "many", cost=2.0),
        Case("b.py::t[many]", 1, "many", cost=2.0),
        Case("c.py::t[many]", 1, "many", cost=2.0),
        Case("d.py::t[one]", 1, "one", cost=5.0),
    ]
    assert [u.group for u in plan(cs, devices=1).units] == ["many", "many", "many", "one"]


@pytest.mark.parametrize(("devices", "ws"), [(1, 1), (3, 2)])
def test_with_one_lane_at_a_time_a_unit_is_long_from_a_third_of_all_its_world_sizes_work(devices, ws):
    """A world size's phase is its work over the lanes of it that fit at once: on one device with one seat, or
    for two ranks on three devices (a second two-rank lane would need a fourth), that is one lane, and the phase
    is all 12 s. Unit `a` (6 s) is long and split; `b` (3 s, a quarter) is not, though it is a third of half
    the work or of 12 s over 1.5 lanes."""
    cs = (
        [Case(f"a.py::t{i}", ws, "a", cost=3.0) for i in range(2)]
        + [Case(f"b.py::t{i}", ws, "b", cost=1.5) for i in range(2)]
        + [Case(f"{g}.py::t", ws, g, cost=1.0) for g in "cde"]
    )
    p = plan(cs, devices=devices, seats=1)
    assert [u.nodeids for u in p.units] == [
        ["a.py::t0"],
        ["b.py::t0", "b.py::t1"],
        ["a.py::t1"],
        ["c.py::t"],
        ["d.py::t"],
        ["e.py::t"],
    ]


def test_a_unit_of_exactly_a_third_of_its_phase_is_long():
    """LONG_UNIT_SHARE is inclusive: a 3-s unit of 9 s of work on one lane is split, its tests leading."""
    cs = [Case(f"a.py::t{i}", 1, "a", cost=1.5) for i in range(2)] + [
        Case(f"{g}.py::t", 1, g, cost=2.0) for g in "bcd"
    ]
    assert [u.nodeids for u in plan(cs, devices=1).units] == [
        ["a.py::t0"],
        ["b.py::t"],
        ["a.py::t1"],
        ["c.py::t"],
        ["d.py::t"],
    ]


def test_the_solo_unit_is_named_as_the_solo_and_runs_in_its_cases_tier():
    """The solo's group is SOLO (the lanes count it apart from the strategies'), and its lane starts the rank
    pool of its cases' tier, as any unit's does."""
    from distbench.testsuite.schedule import SOLO

    cs = [Case("b.py::spin", 1, "b.py", exclusive=True, device_type="cuda"), *cases("ddp", 1, 1)]
    solo = plan(cs, devices=2, seats=2, solo=True).solo
    assert solo is not None and solo.group == SOLO and solo.device_type == "cuda"


def test_the_solo_takes_a_device_whole_only_when_no_lane_holds_a_seat_there():
    s = Seats.of(devices=2, seats=2)
    assert s.take(1) == [0]
    assert not s.take_whole(0, 2) and s.free == [1, 2], "took a device a lane still sits on"
    assert s.take_whole(1, 2) and s.free == [1, 0]


def test_without_a_cap_the_lanes_on_a_group_do_not_turn_a_lane_away_from_it():
    """cap=0 (the default) is no cap: the first unit in plan order, however many lanes run its group."""
    pending = [Unit(1, ["a"], 5.0, "zero3"), Unit(1, ["c"], 3.0, "ddp")]
    assert take_unit(list(pending), 1, {"zero3": 3}).nodeids == ["a"]


def test_without_a_memory_figure_the_host_cores_alone_bound_the_seats():
    """An unknown device memory or rank peak (None, as a CPU tier has) leaves the cores' bound: 16 cores at 2 a
    rank on one device seat 8 lanes."""
    assert seats_per_device(1, None, 5 * GIB, cores=16) == 8
    assert seats_per_device(1, 141 * GIB, None, cores=16) == 8
    assert seats_per_device(1, 0, 5 * GIB, cores=16) == 8
