"""The lane side of lanes.py: a child pytest process runs the tests its parent gave it and tells it about each.

The parent writes the lane's test ids to `items.json` in the lane's directory and starts the child with
`--distbench-lane DIR`; the child runs exactly those, in that order, and appends one JSON line per event to
`events.jsonl` (a test starting, each of its reports through pytest's own report serialization hook, its
phase table so far, a test finishing, a collection error). The parent replays them into its own session.
A line is written whole and flushed before the next step, so a child killed at any moment leaves at most
one partial last line, which the parent ignores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .runtime.phases import PhaseLog

ITEMS = "items.json"
EVENTS = "events.jsonl"
OUTPUT = "output.log"


class LaneReporter:
    """Registered in a lane child: selects its tests, and writes its events for the parent."""

    def __init__(self, config: pytest.Config, lane_dir: Path, phases: PhaseLog) -> None:
        self.config = config
        self.nodeids: list[str] = json.loads((lane_dir / ITEMS).read_text())
        self.phases = phases
        self._sent: dict[str, dict[str, float]] = {}
        self._out = open(lane_dir / EVENTS, "a", encoding="utf-8")  # noqa: SIM115 (closed at unconfigure)

    def send(self, **event: Any) -> None:
        self._out.write(json.dumps(event, default=repr) + "\n")
        self._out.flush()

    def close(self) -> None:
        self._out.close()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Run exactly the lane's tests in the parent's order (the arguments named whole modules)."""
        order = {nodeid: i for i, nodeid in enumerate(self.nodeids)}
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid not in order])
        items[:] = sorted((it for it in items if it.nodeid in order), key=lambda it: order[it.nodeid])

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.send(event="collect", data=self._data(report))

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.send(event="start", nodeid=nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.send(event="report", data=self._data(report))

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        changed = {t: dict(p) for t, p in self.phases.by_test.items() if self._sent.get(t) != p}
        if changed:  # sent as it grows, so a later crash loses none of it
            self._sent.update(changed)
            self.send(event="phases", by_test=changed)
        self.send(event="finish", nodeid=nodeid)

    def _data(self, report: pytest.TestReport | pytest.CollectReport) -> dict[str, Any]:
        data: dict[str, Any] = self.config.hook.pytest_report_to_serializable(
            config=self.config, report=report
        )
        return data
