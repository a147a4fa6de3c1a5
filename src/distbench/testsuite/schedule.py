"""Which tests of a session run where, so that every device of the machine is busy and no timing shares it.

A session's cases are split three ways (`plan`): cases skipped at collection run first in the pytest process
(there is nothing to place); the other cases are cut into units of work (one group's cases of one world size
and one test module) that lanes take one at a time, the costliest group first and each group's units one
after another, so a group (a strategy) finishes early and its session files can go (lanes.py); cases marked
`exclusive` (they measure time or memory of the machine) run last, alone, in the pytest process. On two or
more GPUs the one-rank exclusive cases are instead the `solo` unit: a lane of its own on one whole GPU, once
the lanes of several ranks are done, while the one-rank lanes go on on the other GPUs. Their figures are the
device's (its time, memory and kernels), which another GPU's work does not move; in the 2-GPU tier they were
45 s of the 214 s that ran alone after the lanes.

A lane is a child pytest process whose ranks sit on `world_size` distinct devices. Lanes may share devices:
each device has `seats` seats and a lane takes one seat on each of its devices, so on one GPU of 16 host
cores eight world-size-1 lanes run at once, and two world-size-2 lanes may share the same two GPUs (within one
NCCL communicator each rank has a GPU of its own; two communicators on the same GPUs are legal). How many
seats a device has comes from the cases' measured (or estimated) peak device memory per rank and the host's
cores (`seats_per_device`). Pure planning: no pytest and no processes here (lanes.py runs a plan).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

#: Host cores a rank keeps busy: its Python thread and autograd's device thread (small models' steps wait on
#: one host thread); also the seats' bound by cores. On one H200 (16 vCPUs) 8 lanes of world size
#: 1 kept 57% of the cores busy and the GPU 72%, and took 205 s; 10 lanes (1.5 cores a rank) kept 67% of the
#: cores and 52% of the GPU busy and took as long: the GPU's time slices, not the cores, bound them.
CORES_PER_RANK = 2
#: Host cores a seat counts per rank on two GPUs or more, where ranks of several-rank lanes also wait on each
#: other's collectives: on 2x H200 (32 vCPUs) 8 seats (CORES_PER_RANK) kept the host CPUs 44% busy, and 12 seats
#: took the lanes from 333 s to 284 s, no test failing. (Measured on 2 GPUs; 4 and 8 take it unmeasured.)
SEAT_CORES_PER_RANK_MULTI_GPU = 4 / 3
#: Share of a device's memory the lanes may plan to fill; the rest absorbs estimates that run short.
MEMORY_HEADROOM = 0.8
#: Seconds of lane work left (per running lane) at which the exclusive tests' pools start warming: their ranks'
#: start, imports, CUDA context and first kernels took about 15 s under the lanes' load on an H200. Started
#: once every unit was handed out, the warm-up outlasted the lanes by 14 s, the first exclusive test's wait.
WARM_UP_LEAD_S = 30.0
#: A unit of at least this share of its world size's phase is split into its tests, which start first
#: (long_units_first): list scheduling ends within the longest unit of the ideal only when the longest start
#: first, and no unit may be longer than the phase should be.
LONG_UNIT_SHARE = 1 / 3
#: Seconds a new lane takes before it asks for work under the lanes' load (its imports, collection and first
#: rank pool: 10-20 s on 2x H200); a lane is not started for less work than the busy lanes do in that time,
#: and wide lanes lend their seats to narrower ones once no more than that waits for them (starts_in_time).
LANE_START_S = 15.0
#: The group of the solo unit (Plan.solo): its cases' groups are mixed. It is not Unit.reads_any, so strategies'
#: shelved runs are removed while it runs: exclusive cases measure a configuration of their own and read no
#: strategy's shared run (one that did would compute it again). Held back for its 40-60 s, the removals ran
#: after it on 2x H200, and the exclusive tests waited about 20 s for them.
SOLO = "exclusive, one rank"


@dataclass(frozen=True)
class Case:
    """One collected test as the scheduler sees it."""

    nodeid: str
    world_size: int
    group: str  # a strategy, or a module: what a lane's cached runs and references are shared by
    exclusive: bool = False  # measures time or memory of the machine: runs alone, last
    #: exclusive, and needs a quiet host too (a launch-bound step's rate): never the solo, beside other lanes
    quiet_host: bool = False
    reads_any: bool = False  # its group is a module, not a strategy: it may read any strategy's shared runs
    inert: bool = False  # skipped at collection: runs first, here
    cost: float = 1.0  # expected seconds (the last session's, when known)
    device_type: str = "cpu"  # the tier: which rank pool its jobs run in

    @property
    def module(self) -> str:
        return self.nodeid.split("::")[0]


@dataclass
class Unit:
    """Cases a lane runs one after another without asking again: one group, world size and module."""

    world_size: int
    nodeids: list[str]
    cost: float
    group: str = ""
    reads_any: bool = False  # its cases may read any group's shared runs (Case.reads_any)
    device_type: str = "cpu"  # its cases' tier (Case.device_type)


@dataclass
class Plan:
    first: list[str]  # here, before any lane: skipped at collection
    units: list[Unit]  # taken by lanes, largest first
    alone: list[str]  # here, last, with nothing else running
    devices: int
    seats: int
    solo: Unit | None = None  # exclusive cases of one rank: one whole device, beside lanes on the others

    @property
    def lanes_at_once(self) -> int:
        """The most lanes that can run side by side on this plan's units (the solo's among them)."""
        per_ws: dict[int, int] = {}
        for u in [*self.units, *([self.solo] if self.solo else [])]:
            per_ws[u.world_size] = per_ws.get(u.world_size, 0) + 1
        return max(
            (min(n, (self.devices // ws) * self.seats) for ws, n in per_ws.items() if ws <= self.devices),
            default=0,
        )

    @property
    def worth_it(self) -> bool:
        """Lanes pay for their process starts only when at least two of them run at once."""
        return self.lanes_at_once >= 2


def plan(cases: Sequence[Case], devices: int, seats: int = 1, solo: bool = False) -> Plan:
    """Place `cases` on `devices` device slots of `seats` seats each. Units are one group's cases of one world
    size, module and tier, in collection order. Groups are ordered by their cost, largest first (a lane takes the
    next unit when it is done: the longest work starts first, so no lane is left with it at the end), and a
    group's units by theirs, so lanes share out one group before the next; long units are split into their
    tests, which lead, alternating with the rest (long_units_first). With `solo` (GPUs) and two devices
    or more, the one-rank exclusive cases make the plan's solo unit instead of running alone."""
    first = [c.nodeid for c in cases if c.inert]
    exclusive = sorted((c for c in cases if c.exclusive and not c.inert), key=lambda c: c.world_size)
    one_rank = (
        [c for c in exclusive if c.world_size == 1 and not c.quiet_host] if solo and devices >= 2 else []
    )
    alone = [c.nodeid for c in exclusive if c not in one_rank]
    solo_unit = (
        Unit(
            1,
            [c.nodeid for c in one_rank],
            sum(c.cost for c in one_rank),
            SOLO,
            False,
            one_rank[0].device_type,
        )
        if one_rank
        else None
    )
    units: dict[tuple[int, str, str, str], Unit] = {}
    for c in cases:
        if c.inert or c.exclusive:
            continue
        u = units.setdefault(
            (c.world_size, c.group, c.module, c.device_type),
            Unit(c.world_size, [], 0.0, c.group, c.reads_any, c.device_type),
        )
        u.nodeids.append(c.nodeid)
        u.cost += c.cost
    group_cost: dict[str, float] = {}
    for u in units.values():
        group_cost[u.group] = group_cost.get(u.group, 0.0) + u.cost
    # stable: ties keep collection order
    ordered = sorted(units.values(), key=lambda u: (-group_cost[u.group], u.group, -u.cost))
    costs = {c.nodeid: c.cost for c in cases}
    return Plan(first, long_units_first(ordered, costs, devices, seats), alone, devices, seats, solo_unit)


def long_units_first(units: list[Unit], cost: dict[str, float], devices: int, seats: int) -> list[Unit]:
    """`units` with the long ones leading, longest first, one in every two: those of at least LONG_UNIT_SHARE
    of their world size's phase (its units' seconds over the lanes that run them at once), each split into a
    unit per test (`cost`: seconds per test, every test of `units`), so that their tests run in lanes side by
    side. Group order keeps a strategy's units together so that its shelved runs go early; but a long unit of
    a cheap group (a module's three fault tests, 110 s) then started 170 s into the 2x H200 tier's 200-s
    world-size-2 phase and held both GPUs 60 s after the rest had ended, and the longest unit (five checkpoint
    tests of zero3, 180 s) set the phase's length by itself. The long tests alternate with the other units, so
    that half the first lanes start on them, not all: on 2x H200 the twelve longest, first in every lane, spent
    their first 50 s building, saving and loading checkpoints and computing references, training for 4-16 s of
    it, and both GPUs were 19-42% busy."""
    work = seconds_by_world_size(units)
    phase = {ws: w / max(1, (devices // ws) * seats) for ws, w in work.items()}
    long = [u for u in units if u.cost >= LONG_UNIT_SHARE * phase[u.world_size]]
    pieces = sorted(
        (
            Unit(u.world_size, [n], cost[n], u.group, u.reads_any, u.device_type)
            for u in long
            for n in u.nodeids
        ),
        key=lambda u: -u.cost,
    )
    promoted = {id(u) for u in long}
    rest = [u for u in units if id(u) not in promoted]
    out: list[Unit] = []
    for ws in sorted(work):  # lanes take units of their own world size only: alternate within each
        out += _alternate([u for u in pieces if u.world_size == ws], [u for u in rest if u.world_size == ws])
    return out


def _alternate(first: list[Unit], then: list[Unit]) -> list[Unit]:
    """`first` and `then` taken one from each in turn, `first` leading, the longer list's tail last."""
    out: list[Unit] = []
    for i in range(max(len(first), len(then))):
        out += first[i : i + 1] + then[i : i + 1]
    return out


@dataclass
class Seats:
    """Free seats per device: a lane of world size w takes one seat on each of w distinct devices."""

    free: list[int]
    taken: dict[int, int] = field(default_factory=dict)  # lanes holding a seat, per device
    #: devices no new lane may take a seat on, and those no new one-rank lane may (both: kept for the solo)
    closed: set[int] = field(default_factory=set)
    closed_to_one_rank: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, devices: int, seats: int) -> Seats:
        return cls([seats] * devices)

    def open_devices(self, world_size: int) -> list[int]:
        """Devices a new lane of `world_size` may take a seat on: a seat free, not closed (to it)."""
        shut = self.closed | (self.closed_to_one_rank if world_size == 1 else set())
        return [d for d, n in enumerate(self.free) if n > 0 and d not in shut]

    def take(self, world_size: int) -> list[int] | None:
        """The `world_size` open devices with the most free seats (lowest index first on ties), their seats
        taken; None when fewer devices than that are open."""
        open_ = sorted(self.open_devices(world_size), key=lambda d: (-self.free[d], d))
        if len(open_) < world_size:
            return None
        mine = sorted(open_[:world_size])
        for d in mine:
            self.free[d] -= 1
        return mine

    def take_whole(self, device: int, seats: int) -> bool:
        """All `seats` seats of `device` when no lane holds one (the solo unit's lane): whether it got them."""
        if self.free[device] != seats:
            return False
        self.free[device] = 0
        return True

    def give(self, devices: Iterable[int]) -> None:
        for d in devices:
            self.free[d] += 1


def next_world_size(
    pending: Sequence[Unit],
    running: dict[int, int],
    seats: Seats,
    serving: dict[int, int] | None = None,
) -> int | None:
    """The world size a new lane should serve: among those with more pending units than lanes still starting
    for them (`running`), the one with the most pending cost whose seats are free; None when no lane should
    start. Not one whose pending seconds the lanes already at work on it (`serving`) would take before a new
    lane could start (LANE_START_S each): on 2x H200, six more lanes started for the last one-rank units when
    the solo's GPU opened again, found none left once started, and the lanes' stage waited 26 s for them."""
    cost = seconds_by_world_size(pending)
    count = Counter(u.world_size for u in pending)
    for ws in sorted(cost, key=lambda w: -cost[w]):
        if (
            count[ws] > running.get(ws, 0)
            and starts_in_time(cost[ws], (serving or {}).get(ws, 0))
            and len(seats.open_devices(ws)) >= ws
        ):
            return ws
    return None


def starts_in_time(waiting_s: float, serving: int) -> bool:
    """Whether a lane of a world size started now would find work: more of it waits (`waiting_s`, seconds)
    than the `serving` lanes at work on it take in a lane's start (LANE_START_S each)."""
    return waiting_s > LANE_START_S * serving


def seconds_by_world_size(units: Iterable[Unit]) -> dict[int, float]:
    """The units' expected seconds, summed per world size."""
    out: dict[int, float] = {}
    for u in units:
        out[u.world_size] = out.get(u.world_size, 0.0) + u.cost
    return out


def runnable(unit: Unit, world_size: int, collected: Container[str] | None = None) -> bool:
    """Whether a lane of `world_size` that collected the tests in `collected` (None: any) can run `unit`. A lane
    collects only the tests pending when it started; the rest of a unit whose lane died is pending later."""
    return unit.world_size == world_size and (collected is None or all(n in collected for n in unit.nodeids))


def take_unit(
    pending: list[Unit],
    world_size: int,
    busy: dict[str, int] | None = None,
    cap: int = 0,
    collected: Container[str] | None = None,
    last_round: bool = False,
) -> Unit | None:
    """The next unit a lane of `world_size` runs, removed from `pending`: the first in plan order whose group
    fewer than `cap` lanes are running (`busy`: lanes per group), else the first, among those it can run
    (`runnable`). Most of a group's units wait on the group's one shared run (a session's shelf computes it
    once): more lanes on one group than `cap` mostly wait for it. In the `last_round` (no more units of the
    world size wait than lanes serve it) the costliest instead, so the round ends with its shortest units:
    on 2x H200 a module's 60-s unit handed out last kept a GPU 40 s after the world size's other units ended."""
    mine = [i for i, u in enumerate(pending) if runnable(u, world_size, collected)]
    if not mine:
        return None
    free = [i for i in mine if not cap or (busy or {}).get(pending[i].group, 0) < cap]
    pick = free or mine
    return pending.pop(max(pick, key=lambda i: pending[i].cost) if last_round else pick[0])


def warm_up_due(pending: Sequence[Unit], lanes_running: int, lead_s: float = WARM_UP_LEAD_S) -> bool:
    """Whether the work not yet handed out, shared by the lanes running, is within `lead_s` seconds: the
    exclusive tests' pools then warm while the lanes finish, not after them. (The units in the lanes' hands
    are not counted: the warm-up starts a little late rather than early, beside a full load.)"""
    return sum(u.cost for u in pending) <= lead_s * max(1, lanes_running)


def seats_per_device(
    devices: int,
    memory_bytes: int | None,
    rank_peak_bytes: float | None,
    cores: int,
    cores_per_rank: float | None = None,
) -> int:
    """How many lanes may share one device: as many ranks as fit in MEMORY_HEADROOM of its memory at the
    cases' peak per rank, and no more ranks on the whole machine than its cores can keep busy at
    `cores_per_rank` (by default CORES_PER_RANK on one device, SEAT_CORES_PER_RANK_MULTI_GPU on more). At
    least 1."""
    if cores_per_rank is None:
        cores_per_rank = CORES_PER_RANK if devices <= 1 else SEAT_CORES_PER_RANK_MULTI_GPU
    by_cores = int(cores // (cores_per_rank * max(1, devices)))
    by_memory = (
        math.floor(MEMORY_HEADROOM * memory_bytes / rank_peak_bytes)
        if memory_bytes and rank_peak_bytes
        else by_cores
    )
    return max(1, min(by_cores, by_memory))
