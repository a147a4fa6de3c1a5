"""The lane side of lanes.py: a child pytest process runs the tests its parent hands it and tells it about each.

The parent writes the test ids the lane may be given to `items.json` in the lane's directory and starts the
child with `--distbench-lane DIR` and the read end of a pipe (its descriptor in DISTBENCH_LANE_FD). The child
asks for work (a `want` event) and reads the answer from the pipe: the next unit's test ids, or an empty list
when there is no more work for it; it asks again once a unit is done, keeping its session's fixtures (the
Suite and its rank pools) from one unit to the next. It appends one JSON line per event to `events.jsonl` (a test starting, each of its reports through pytest's own
report serialization hook, its phase table so far, a test finishing, a collection error, a request for work).
The parent replays them into its own session. A line is written whole and flushed before the next step, so a
child killed at any moment leaves at most one partial last line, which the parent ignores.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from ..runtime.phases import PhaseLog

ITEMS = "items.json"
EVENTS = "events.jsonl"
OUTPUT = "output.log"
WORK_FD_ENV = "DISTBENCH_LANE_FD"
#: "device_type:world_size" of the rank pool the lane's first unit runs in: the child spawns it before it
#: collects, so the ranks' start (imports, CUDA context, NCCL) overlaps the collection, each lane's first ~9 s
LANE_POOL_ENV = "DISTBENCH_LANE_POOL"
#: Set: the lane runs a short benchmark in that pool before it first asks for work (the solo lane, whose first
#: test times the device and is handed out only once the device is its own: the warm-up overlaps that wait)
LANE_WARM_ENV = "DISTBENCH_LANE_WARM"


class LaneReporter:
    """Registered in a lane child: selects its tests, and writes its events for the parent."""

    def __init__(
        self, config: pytest.Config, lane_dir: Path, phases: PhaseLog, on_end: Callable[[], None]
    ) -> None:
        """`on_end()` closes what the lane's tests opened (its rank pools) once no work is left."""
        self.config = config
        self.on_end = on_end
        self.nodeids: list[str] = json.loads((lane_dir / ITEMS).read_text())
        self.phases = phases
        self._sent: dict[str, dict[str, float]] = {}
        self._out = open(lane_dir / EVENTS, "a", encoding="utf-8")  # noqa: SIM115 (closed at unconfigure)
        self._work = os.fdopen(int(os.environ[WORK_FD_ENV]), "r", encoding="utf-8")
        self._items: dict[str, pytest.Item] = {}
        self.exitstatus = int(pytest.ExitCode.INTERNAL_ERROR)  # until the session finishes
        self.warm: Callable[[], None] | None = None  # run before the first request for work (LANE_WARM_ENV)

    def send(self, **event: Any) -> None:
        self._out.write(json.dumps(event, default=repr) + "\n")
        self._out.flush()

    def close(self) -> None:
        """The lane's last cleanup (config.add_cleanup): its events are complete, its pools closed and its
        report written, so it leaves at once with the session's status. Python's own exit (tearing down torch,
        transformers and DeepSpeed's modules) took a lane 3-5 s on an H200, at the end of the lanes' stage."""
        self._out.close()
        self._work.close()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
        os._exit(self.exitstatus)

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self.exitstatus = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Keep the tests the lane may be given (the arguments named whole modules)."""
        mine = set(self.nodeids)
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid not in mine])
        items[:] = [it for it in items if it.nodeid in mine]
        self._items = {it.nodeid: it for it in items}

    def _request(self) -> list[str]:
        """The next unit's test ids from the parent; [] when it has no more work for this lane (or is gone)."""
        self.send(event="want")
        line = self._work.readline()
        return [n for n in json.loads(line) if n in self._items] if line.strip() else []

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        """Run units as the parent hands them out, until it has none left. After a unit's last test pytest is
        told the session comes next, so module fixtures are torn down and session ones (the Suite and its
        rank pools) are kept for the next unit; pytest's session finish tears those down."""
        if self.warm is not None:
            self.warm()
        while unit := self._request():
            for i, nodeid in enumerate(unit):
                nextitem = self._items[unit[i + 1]] if i + 1 < len(unit) else cast(pytest.Item, session)
                self._items[nodeid].config.hook.pytest_runtest_protocol(
                    item=self._items[nodeid], nextitem=nextitem
                )
                if session.shouldfail or session.shouldstop:
                    return True
        t0 = time.monotonic()
        self.on_end()  # no test is left for its pools; timed for the session's summary
        self.send(event="closed", seconds=time.monotonic() - t0)
        return True

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
