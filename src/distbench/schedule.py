"""Which tests of a session run where, so that every device of the machine is busy and no timing shares it.

A session's cases are split four ways (`plan`): cases skipped at collection run first in the pytest process
(there is nothing to place); cases of world size w smaller than the machine's N device slots are packed onto
floor(N/w) lanes, each a child pytest process on w slots of its own, lanes running side by side on disjoint
slots; cases that need every slot then run in the pytest process; cases marked `exclusive` (they measure
time or memory of the machine) run last, alone. Pure planning: no pytest and no processes here (lanes.py
runs a plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    """One collected test as the scheduler sees it."""

    nodeid: str
    world_size: int
    group: str  # cases of one group share one lane: the session's cached runs and references stay warm
    exclusive: bool = False  # measures time or memory of the machine: runs alone, last
    inert: bool = False  # skipped at collection: runs first, here


@dataclass
class Lane:
    """Cases run one after another by one child process on `world_size` slots of its own."""

    world_size: int
    nodeids: list[str] = field(default_factory=list)


@dataclass
class Plan:
    first: list[str]  # here, before any lane: skipped at collection
    lanes: list[Lane]  # child processes, side by side on disjoint slots, smaller world sizes first
    whole: list[str]  # here, after the lanes: cases that need every slot (or more)
    alone: list[str]  # here, last, with nothing else running

    @property
    def worth_it(self) -> bool:
        """Lanes pay for their process starts only when at least two of them exist."""
        return len(self.lanes) >= 2


def plan(cases: Sequence[Case], slots: int) -> Plan:
    """Place `cases` on a machine of `slots` device slots. Cases of one group and world size go to one lane;
    groups are spread over floor(slots / w) lanes by size, largest first (each to the emptiest lane); a lane
    runs its cases in collection order."""
    first = [c.nodeid for c in cases if c.inert]
    alone = [
        c.nodeid
        for c in sorted((c for c in cases if c.exclusive and not c.inert), key=lambda c: c.world_size)
    ]
    rest = [c for c in cases if not c.inert and not c.exclusive]
    whole = [c.nodeid for c in rest if c.world_size >= slots]
    lanes: list[Lane] = []
    for ws in sorted({c.world_size for c in rest if c.world_size < slots}):
        mine = [c for c in rest if c.world_size == ws]
        groups: dict[str, list[Case]] = {}
        for c in mine:
            groups.setdefault(c.group, []).append(c)
        bins: list[list[Case]] = [[] for _ in range(slots // ws)]
        for group in sorted(groups.values(), key=len, reverse=True):  # stable: ties keep collection order
            min(bins, key=len).extend(group)
        order = {c.nodeid: i for i, c in enumerate(mine)}
        lanes += [Lane(ws, sorted((c.nodeid for c in b), key=order.__getitem__)) for b in bins if b]
    return Plan(first, lanes, whole, alone)


def next_start(pending: Sequence[Lane], free: Sequence[int]) -> tuple[int, list[int]] | None:
    """The first pending lane that fits on the free slots, and the lowest free slots it gets; None when none
    fits. Later lanes may overtake one that waits for more slots than are free."""
    for i, lane in enumerate(pending):
        if lane.world_size <= len(free):
            return i, sorted(free)[: lane.world_size]
    return None
