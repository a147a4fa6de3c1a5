"""The session's watch (lane_watch.py): the host's busy CPU share and the split of samples by phase, which the
summary's "while lanes ran" line rests on."""

from __future__ import annotations

import os
import sys
import time

import pytest

from distbench.measure.hostspeed import busy_share, host_jiffies
from distbench.testsuite.lane_watch import GpuWatch, Occupancy, dirty_bytes, sync_filesystem


def test_busy_share_is_the_busy_part_of_the_elapsed_cpu_time():
    assert busy_share((100, 1000), (150, 1100)) == pytest.approx(0.5)
    assert busy_share(None, (1, 2)) is None
    assert busy_share((5, 10), (5, 10)) is None  # no time passed: no share


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_host_jiffies_count_a_spinning_thread_as_busy():
    """A spin of 0.3 s on this host shows as at least half that much busy CPU time (in clock ticks)."""
    before = host_jiffies()
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:
        pass
    after = host_jiffies()
    assert before is not None and after is not None
    assert after[0] - before[0] >= 0.5 * 0.3 * os.sysconf("SC_CLK_TCK")
    share = busy_share(before, after)
    assert share is not None and 0 < share <= 1


def test_below_counts_the_time_too_few_tests_ran_within_a_window():
    """The summary's idle-lanes figure: 2 tests at once at most from 6 s on, 1 at most after 10 s."""
    occ = Occupancy(intervals=[(0, 10), (0, 4), (2, 6), (8, 12)])
    assert occ.below(2, 0, 12) == 4.0  # 6-8 and 10-12
    assert occ.below(2, 1, 11) == 3.0  # the window clips both ends
    assert occ.below(1, 0, 14) == 2.0  # nothing ran after 12 s
    assert occ.below(3, 0, 12) == 10.0  # three at once only from 2 to 4 s


def test_summary_splits_the_samples_taken_while_lanes_ran():
    w = GpuWatch(total_bytes=[100, 100])
    w.utilization = [[0.2, 0.0], [0.6, 0.2], [1.0, 0.4]]
    w.host_busy = [0.1, 0.9, None]
    w.in_lanes = [False, True, True]
    w.used_bytes = [[10, 0], [50, 5], [30, 5]]
    s = w.summary()
    assert s is not None
    assert s["per_device"] == pytest.approx([0.6, 0.2])  # each GPU's own, not the pooled mean
    assert s["busy"] == pytest.approx(0.4)
    assert s["host_busy"] == pytest.approx(0.5)  # the unknown sample is left out
    assert s["lanes_busy"] == pytest.approx(0.55)
    assert s["lanes_host_busy"] == pytest.approx(0.9)
    assert s["peak_used_bytes"] == 50


def test_the_watch_takes_no_samples_while_paused():
    """An exclusive test runs with the watch paused: no NVML query beside its timed steps."""
    import threading
    from types import SimpleNamespace

    calls: list[str] = []

    class FakeNvml:
        def nvmlDeviceGetUtilizationRates(self, h):
            calls.append("util")
            return SimpleNamespace(gpu=50)

        def nvmlDeviceGetMemoryInfo(self, h):
            calls.append("mem")
            return SimpleNamespace(used=1, total=2)

    w = GpuWatch(period_s=0.005, paused=True)
    w._handles = ["gpu0"]
    t = threading.Thread(target=w._loop, args=(FakeNvml(),), daemon=True)
    t.start()
    try:
        time.sleep(0.1)
        assert calls == [] and w.utilization == []
        w.paused = False
        deadline = time.monotonic() + 5
        while not w.utilization and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.utilization and w.utilization[0] == [0.5]
    finally:
        w.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo and syncfs are Linux's")
def test_a_file_written_shows_as_dirty_page_cache_until_its_filesystem_is_synced(tmp_path):
    """The lanes write tens of GiB of checkpoints; what the kernel has not yet written out is synced before the
    exclusive tests, so that its writeback does not run beside their timings."""
    before = dirty_bytes()
    assert before is not None
    (tmp_path / "blob").write_bytes(os.urandom(64 * 2**20))
    sync_filesystem(tmp_path)
    after = dirty_bytes()
    assert after is not None
    with open(tmp_path / "blob", "rb") as f:  # written out: the file's pages are clean and readable
        assert len(f.read()) == 64 * 2**20
    assert after < before + 32 * 2**20, "the 64 MiB written is still dirty after the sync"
