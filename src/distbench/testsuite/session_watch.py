"""What a session did, for its summary: how many tests ran at once, its stages (start, skips, lanes, exclusive
tests), the GPUs' busy ratio and memory, the shelf's removals, leaks left in rank pools and undecided claims.
One SessionWatch per session; the pytest plugin registers it (it reads every test's reports, a lane's too)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from .claims import UNDECIDED_KEY
from .lane_watch import GpuWatch, Occupancy

#: user property of a test whose jobs left device memory allocated in their pool: the bytes
LEFT_KEY = "distbench_device_memory_left"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc): the interpreter's start, imports and collection
    come before the session's first hook can look at a clock. None where /proc cannot say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def undecided_of(report: Any) -> str | None:
    """The interval and reason of a claim the machine left undecided (claims.Undecided), from its report."""
    return next((str(v) for k, v in getattr(report, "user_properties", ()) if k == UNDECIDED_KEY), None)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class SessionWatch:
    """The session's occupancy (tests at once), its GPUs' busy ratio and memory, and what its lanes did."""

    def __init__(self) -> None:
        #: seconds from the command's start to the session's loop: the interpreter, imports, collection
        self.start_s = process_age_s()
        self.occupancy = Occupancy()
        self.gpu = GpuWatch()
        self.lanes: Any = None  # lanes.LaneStats when the session ran lanes
        self.durations: dict[str, float] = {}  # test -> seconds of setup, call and teardown
        self.spans: dict[str, tuple[float, float]] = {}  # test -> its first start and last stop (epoch s)
        self.left: dict[str, int] = {}  # test -> device bytes its jobs left allocated in their pool
        self.undecided: dict[str, str] = {}  # test -> its interval and reason
        self.shelf_freed = 0  # bytes of shelved runs removed as their strategies' tests finished
        self.shelf_drop_s = 0.0  # seconds the removals took (a thread beside the lanes' loop)
        self.shelf_left = 0  # bytes the shelf held once the lanes were done

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Every test's reports, whether this process or a lane ran it."""
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        for key, value in getattr(report, "user_properties", ()):
            if key == LEFT_KEY:
                self.left[report.nodeid] = int(value)
        a, b = self.spans.get(report.nodeid, (report.start, report.stop))
        self.spans[report.nodeid] = (min(a, report.start), max(b, report.stop))
        why = undecided_of(report)
        if why is not None:
            self.undecided[report.nodeid] = why

    def timeline(self) -> dict[str, Any]:
        """tests: each test's start and end, seconds from the first test's start, in order of start; samples:
        the GPU watch's samples on the same clock (t, each device's utilization, the host's busy CPU share,
        whether lanes ran), so a low busy ratio can be traced to the stage and tests that left a GPU idle."""
        if not self.spans:
            return {"tests": {}, "samples": []}
        t0 = min(a for a, _ in self.spans.values())
        g = self.gpu
        return {
            "tests": {
                t: [round(a - t0, 3), round(b - t0, 3)]
                for t, (a, b) in sorted(self.spans.items(), key=lambda x: x[1])
            },
            "samples": [
                {"t": round(t - t0, 2), "gpu": u, "host": None if h is None else round(h, 3), "lanes": on}
                for t, u, h, on in zip(g.times, g.utilization, g.host_busy, g.in_lanes, strict=True)
            ],
        }

    def _stage_lines(self) -> list[str]:
        """The session's stages and what ended the lanes' stage: the lanes' exits, the page cache written out,
        the CPU time stolen while the exclusive tests ran."""
        if self.lanes is None:
            return []
        stages = {name: (a, b) for name, a, b in self.lanes.stages}
        if "lanes" not in stages:
            return []
        out = []
        a, b = stages["lanes"]
        half = max(1, self.lanes.lanes_at_once // 2)
        start = f"{self.start_s:.0f} s of start (imports, collection), " if self.start_s is not None else ""
        line = (
            f"stages: {start}{stages['skipped'][1] - stages['skipped'][0]:.0f} s of skips, {b - a:.0f} s of lanes "
            f"(fewer than {half} tests at once for {self.occupancy.below(half, a, b):.0f} s of them)"
        )
        if "solo" in stages:
            line += (
                f", the one-rank exclusive tests {stages['solo'][0] - a:.0f}-{stages['solo'][1] - a:.0f} s into "
                "them on a device of their own"
            )
        if "alone" in stages:
            line += f", {stages['alone'][1] - stages['alone'][0]:.0f} s of exclusive tests alone"
        out.append(line)
        if self.lanes.disk_flush is not None:
            dirty, seconds = self.lanes.disk_flush
            line = "before the exclusive tests: "
            if self.lanes.before_alone_s is not None:
                line += f"{self.lanes.before_alone_s:.1f} s for the last removals and the warm-up, then "
            line += f"{_size(dirty)} of dirty page cache" if dirty is not None else "the page cache"
            line += f" written out in {seconds:.1f} s"
            if self.lanes.alone_steal is not None:
                line += f"; the hypervisor stole {self.lanes.alone_steal:.1%} of the host's CPU time while they ran"
            out.append(line)
        if self.lanes.exits:
            closes = self.lanes.pool_closes or [0.0]
            out.append(
                f"lane processes exited {min(self.lanes.exits):.1f}-{max(self.lanes.exits):.1f} s after being "
                f"told no work was left; closing their rank pools took {min(closes):.1f}-{max(closes):.1f} s"
            )
        return out

    def lines(self) -> list[str]:
        """The summary's lines; none for a session that ran no lanes and sampled no GPU."""
        if self.lanes is None and self.gpu.summary() is None and not self.left:
            return []
        out = []
        if self.lanes is not None:
            ls = self.lanes
            out.append(
                f"lanes: {ls.started} started on {ls.devices} {'GPU' if ls.gpus else 'slot'}(s), "
                f"up to {ls.seats} per device"
            )
        occ = self.occupancy.summary()
        if occ:
            out.append(
                f"tests at once: {occ['mean']:.1f} on average, {occ['max']:.0f} at most, over "
                f"{occ['span_s']:.0f} s of tests"
            )
        out += self._stage_lines()
        gpu = self.gpu.summary()
        if gpu:
            each = (
                f", {' and '.join(f'{b:.0%}' for b in gpu['per_device'])} by GPU"
                if len(gpu["per_device"]) > 1
                else ""
            )
            out.append(
                f"GPU busy {gpu['busy']:.0%} of the session ({gpu['samples']} NVML samples{each}); device memory "
                f"in use at most {gpu['peak_used_bytes'] / 2**30:.1f} of {gpu['total_bytes'] / 2**30:.1f} GiB"
            )
            if gpu["host_busy"] is not None:
                line = f"host CPUs busy {gpu['host_busy']:.0%} of the session"
                if self.lanes is not None and gpu["lanes_host_busy"] is not None:
                    line += f"; while lanes ran: host CPUs {gpu['lanes_host_busy']:.0%}, GPU {gpu['lanes_busy']:.0%}"
                out.append(line)
        if self.lanes is not None:
            out.append(
                f"shelved runs and checkpoints: {_size(self.shelf_freed)} removed as their strategies finished "
                f"(in {self.shelf_drop_s:.1f} s), {_size(self.shelf_left)} left when the lanes were done"
            )
        if self.lanes is not None and self.lanes.rerun_alone:
            out.append(
                f"ran out of device memory beside other lanes, so rerun alone: {', '.join(self.lanes.rerun_alone)}"
            )
        if self.left:
            worst = sorted(self.left.items(), key=lambda x: -x[1])
            out.append(
                f"device memory left allocated in a rank pool after {len(worst)} test(s) (a leak the pool's later "
                f"tests run beside): " + "; ".join(f"{b / 2**30:.2f} GiB after {t}" for t, b in worst[:5])
            )
        if self.lanes is not None and self.lanes.peak_bytes:
            test, b = max(self.lanes.peak_bytes.items(), key=lambda x: x[1])
            out.append(f"most device memory a lane held: {b / 2**30:.1f} GiB, in {test}")
        return out
