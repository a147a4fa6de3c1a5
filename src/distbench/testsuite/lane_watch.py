"""What a session did with the machine: how many tests ran at once, how busy the GPUs were, how much device
memory each lane held.

`Occupancy` keeps the intervals in which tests ran (in lanes or in the session's own process) and gives the
time-weighted number of tests running at once. `GpuWatch` samples NVML in a thread of the pytest process: each
device's utilization (the share of the last sample period in which a kernel ran) and memory, and the memory
of every process on it, which the lanes' runner attributes to a lane by its process session (a lane and its
ranks share one). It also samples the host's busy CPU share (/proc/stat), so a summary says which of the two
the lanes waited on. Without NVML or GPUs it samples nothing and reports None, never raising.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..machine import nvml
from ..measure.hostspeed import busy_share, host_jiffies

SAMPLE_S = 0.5


@dataclass
class Occupancy:
    """Intervals in which tests ran; `running` tests at once, weighted by time."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    _open: dict[str, float] = field(default_factory=dict)

    def start(self, key: str, at: float | None = None) -> None:
        self._open[key] = time.monotonic() if at is None else at

    def finish(self, key: str, at: float | None = None) -> None:
        t0 = self._open.pop(key, None)
        if t0 is not None:
            self.intervals.append((t0, time.monotonic() if at is None else at))

    def summary(self) -> dict[str, float] | None:
        """mean: tests running at once, averaged over the time any ran; max: the most at once; span_s: the
        time any ran."""
        if not self.intervals:
            return None
        edges = sorted([(a, 1) for a, _ in self.intervals] + [(b, -1) for _, b in self.intervals])
        running, last, busy, weighted, most = 0, edges[0][0], 0.0, 0.0, 0
        for t, delta in edges:
            if running:
                busy += t - last
                weighted += running * (t - last)
            running += delta
            most = max(most, running)
            last = t
        return {"mean": weighted / busy if busy else 0.0, "max": float(most), "span_s": busy}

    def below(self, count: int, start: float, end: float) -> float:
        """Seconds between `start` and `end` in which fewer than `count` tests ran (lanes left idle)."""
        edges = sorted(
            [(max(a, start), 1) for a, b in self.intervals if b > start and a < end]
            + [(min(b, end), -1) for a, b in self.intervals if b > start and a < end]
        )
        running, last, idle = 0, start, 0.0
        for t, delta in edges:
            if running < count:
                idle += t - last
            running += delta
            last = t
        return idle + (end - last if running < count else 0.0)


def dirty_bytes() -> int | None:
    """Bytes of page cache written but not yet on disk (/proc/meminfo's Dirty and Writeback); None off Linux."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if v.strip()}
    return 1024 * (kib.get("Dirty", 0) + kib.get("Writeback", 0))


def sync_filesystem(path: str | Path) -> None:
    """Write out the dirty pages of the filesystem holding `path` (syncfs; sync where libc lacks it), so that
    the kernel's writeback of the lanes' checkpoints does not run beside the exclusive tests' timings."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).syncfs(fd) != 0:
            os.sync()
    except (OSError, AttributeError):
        os.sync()
    finally:
        os.close(fd)


def visible_handles(nv: Any) -> list[Any]:
    """NVML handles of the GPUs this process may use, in CUDA's order (CUDA_VISIBLE_DEVICES: indices or
    UUIDs); [] when they cannot be matched."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if visible is None:
            return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return [
            nv.nvmlDeviceGetHandleByIndex(int(v)) if v.isdigit() else nv.nvmlDeviceGetHandleByUUID(v)
            for v in ids
        ]
    except Exception:
        return []


@dataclass
class GpuWatch:
    """NVML samples of the session's GPUs; `on_sample(process bytes by pid)` lets the lanes' runner charge
    each sample's process memory to the lane and test that held it."""

    on_sample: Callable[[dict[int, int]], None] | None = None
    period_s: float = SAMPLE_S
    #: no samples while set: an exclusive test measures the machine, and each NVML query is a call into the
    #: driver beside its timed steps
    paused: bool = False
    times: list[float] = field(default_factory=list)  # per sample: when (epoch seconds, as test reports)
    utilization: list[list[float]] = field(default_factory=list)  # per sample, per device, 0..1
    host_busy: list[float | None] = field(default_factory=list)  # per sample: the host's busy CPU share
    in_lanes: list[bool] = field(default_factory=list)  # per sample: whether lanes ran (on_sample set)
    used_bytes: list[list[int]] = field(default_factory=list)
    total_bytes: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _handles: list[Any] = field(default_factory=list)

    def start(self) -> GpuWatch:
        nv = nvml()
        if nv is None:
            return self
        self._handles = visible_handles(nv)
        if not self._handles:
            return self
        try:
            self.total_bytes = [int(nv.nvmlDeviceGetMemoryInfo(h).total) for h in self._handles]
        except Exception:
            self._handles = []
            return self
        self._thread = threading.Thread(
            target=self._loop, args=(nv,), name="distbench-gpu-watch", daemon=True
        )
        self._thread.start()
        return self

    def _loop(self, nv: Any) -> None:
        host = host_jiffies()
        while not self._stop.wait(self.period_s):
            if self.paused:
                host = None  # the next sample's host share starts after the pause
                continue
            on_sample = self.on_sample  # processes are read only while someone charges them (lanes run)
            try:
                util = [nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0 for h in self._handles]
                used = [int(nv.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles]
                procs: dict[int, int] = {}
                for h in self._handles if on_sample is not None else ():
                    for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                        procs[p.pid] = procs.get(p.pid, 0) + int(p.usedGpuMemory or 0)
            except Exception:
                continue  # a device read failed this once: skip the sample
            now = host_jiffies()
            self.times.append(time.time())
            self.host_busy.append(busy_share(host, now))
            host = now
            self.in_lanes.append(on_sample is not None)
            self.utilization.append(util)
            self.used_bytes.append(used)
            if on_sample is not None:
                on_sample(procs)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self) -> dict[str, Any] | None:
        """busy: mean utilization over the samples and devices (the GPUs' busy ratio), per_device: each
        device's; host_busy: the host's mean busy CPU share; both also over the samples taken while lanes ran
        (lanes_busy, lanes_host_busy), None without such samples; peak_used_bytes: the fullest device's most
        memory in use; None without samples."""
        if not self.utilization:
            return None
        gpu = [statistics.fmean(u) for u in self.utilization]

        def mean(xs: Sequence[float | None]) -> float | None:
            known = [x for x in xs if x is not None]
            return statistics.fmean(known) if known else None

        lanes = [i for i, on in enumerate(self.in_lanes) if on]
        return {
            "samples": len(self.utilization),
            "busy": statistics.fmean(gpu),
            "per_device": [statistics.fmean(col) for col in zip(*self.utilization, strict=True)],
            "host_busy": mean(self.host_busy),
            "lanes_busy": mean([gpu[i] for i in lanes]),
            "lanes_host_busy": mean([self.host_busy[i] for i in lanes]),
            "peak_used_bytes": max(max(u) for u in self.used_bytes),
            "total_bytes": max(self.total_bytes),
        }


def session_of(pids: Sequence[int]) -> dict[int, int]:
    """pid -> its process session id, for the pids that still exist (a lane and its ranks share the lane's)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = os.getsid(pid)
        except OSError:
            continue
    return out
