"""Where the suite's own time goes, by phase, so the next slowdown of the suite itself is visible.

Rank jobs time their phases with a PhaseClock (build and wrap, checkpoint load and save, training steps,
gathering full state, the reference run) and return them; the pytest process adds what only it sees (starting
the rank pool, and the rest of the job's wall clock: moving the job and its results between processes), the time
a test waits for and reads shared runs (SHARED), and at the end the rest of each test's time (OWN). A PhaseLog
keeps them per test and prints the session's table at the end (`pytest_terminal_summary`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

POOL_START = "pool start"
TRANSFER = "transfer and rest"
#: a test waiting for a shared run another process computes, and reading it from the shelf
SHARED = "shared runs: wait and read"
#: the rest of a test's time: its own process's comparisons, fixtures and imports
OWN = "the test's own process"


class PhaseClock:
    """Seconds per named phase inside one rank's job."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def job_phases(outputs: list[object], wall_s: float, start_s: float) -> dict[str, float] | None:
    """A job's phases as the pytest process saw them: each phase's slowest rank, the pool's start, and the
    rest of the wall clock; None when the job reports no phases."""
    per_rank = [o["phases"] for o in outputs if isinstance(o, dict) and isinstance(o.get("phases"), dict)]
    if not per_rank:
        return None
    phases = {name: max(p.get(name, 0.0) for p in per_rank) for name in per_rank[0]}
    if start_s:
        phases[POOL_START] = start_s
    phases[TRANSFER] = max(0.0, wall_s - sum(phases.values()))
    return phases


@dataclass
class PhaseLog:
    """Phase seconds per test of a session."""

    by_test: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, test: str, phases: dict[str, float]) -> None:
        mine = self.by_test.setdefault(test, {})
        for name, s in phases.items():
            mine[name] = mine.get(name, 0.0) + s

    def add_remainders(self, durations: dict[str, float]) -> None:
        """Charge each test's time outside its jobs and shared-run waits (`durations`: its setup, call and
        teardown seconds) to OWN, so the table accounts for the tests' whole time."""
        for test, seconds in durations.items():
            rest = seconds - sum(self.by_test.get(test, {}).values())
            if rest > 0:
                self.add(test, {OWN: rest})

    def table(self, slowest: int = 5) -> list[str]:
        """The session's seconds per phase, largest first, then the tests that spent the most."""
        if not self.by_test:
            return []
        totals: dict[str, float] = {}
        for phases in self.by_test.values():
            for name, s in phases.items():
                totals[name] = totals.get(name, 0.0) + s
        whole = sum(totals.values()) or 1.0
        w = max(map(len, ["phase", *totals]))
        lines = [f"{'phase':<{w}} {'seconds':>9} {'share':>6}"]
        lines += [
            f"{name:<{w}} {s:9.1f} {s / whole:6.1%}"
            for name, s in sorted(totals.items(), key=lambda x: -x[1])
        ]
        top = sorted(self.by_test.items(), key=lambda x: -sum(x[1].values()))[:slowest]
        lines += ["", f"slowest {len(top)} test(s):"]
        for test, phases in top:
            parts = ", ".join(f"{n} {s:.1f}" for n, s in sorted(phases.items(), key=lambda x: -x[1])[:3])
            lines.append(f"{sum(phases.values()):7.1f}s {test} ({parts})")
        return lines
