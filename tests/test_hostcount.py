"""The host counters (measure/hostcount.py) and the per-step host figures a result carries.

The machines this tier runs on (CI, virtual machines) usually expose no hardware counters, so the
perf_event_open plumbing is checked with a software event of the same group read, the thread's task clock,
against an independent clock (CLOCK_THREAD_CPUTIME_ID through time.thread_time); where hardware counters
exist, the instructions of a known loop are checked too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpu_work import spin
from distbench.config import RunConfig
from distbench.measure import hostcount
from distbench.measure.timing import time_window
from distbench.results import summarize_bench
from distbench.runtime.context import RankContext
from distbench.testsuite.claims import decide, settle

CPU = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def test_task_clock_counts_this_threads_cpu_time():
    """The counter group's task clock advances with this thread's CPU time, to within 2% over 20 ms spins
    (repeated until the interval of the ratio decides, claims.decide: on a loaded 2-core VM one spin read
    0.59 ms off a 0.5 ms tolerance), and not with another thread's."""
    counters = hostcount.open_counters(hostcount.SOFTWARE)
    try:

        def ratio() -> float:
            (a,), t0 = counters.read(), time.thread_time()
            spin(0.02)
            (b,), t1 = counters.read(), time.thread_time()
            return (b - a) * 1e-9 / (t1 - t0)

        d = decide(ratio, low=0.98, high=1.02, first=4, most=30, budget_s=10)
        settle(d.verdict, "task clock / thread CPU time", d.interval, "the host is too loaded to tell")
        # another thread's work is not this thread's: the group counts its own thread only
        other = threading.Thread(target=spin, args=(0.05,))
        (c,) = counters.read()
        other.start()
        other.join()
        (d2,) = counters.read()
        assert (d2 - c) * 1e-9 < 0.01, "the counters counted another thread"
    finally:
        counters.close()


def assert_window_counts_each_step(measure: Callable[..., Any]) -> None:
    """Each step's task clock is that step's spin (4, 12 and 8 ms: a count shifted by a step, merged with
    the next, or taking the final sync would be off by half or more): the worst step's relative error, over
    repeated windows, is under 10% (claims.decide); host wall time per step is never below its CPU time."""
    lengths = [0.004, 0.012, 0.008]
    counters = hostcount.open_counters(hostcount.SOFTWARE)
    try:

        def worst_error() -> float:
            w = measure(CPU, "events", [lambda s=s: spin(s) for s in lengths], counters)
            got = [n * 1e-9 for n in w.counts["task_clock_ns"]]
            assert len(got) == len(w.host_s) == len(w.host_cpu_s) == len(lengths)
            assert all(h >= c * 0.99 for h, c in zip(w.host_s, got, strict=True)), (w.host_s, got)
            return max(abs(g - want) / want for g, want in zip(got, lengths, strict=True))

        d = decide(worst_error, high=0.1, first=4, most=30, budget_s=10)
    finally:
        counters.close()
    settle(d.verdict, "the worst step's relative error", d.interval, "the host is too loaded to tell")


def test_time_window_counts_each_step_and_not_the_final_sync():
    assert_window_counts_each_step(time_window)


def _shifted(*args: Any, **kwargs: Any) -> Any:
    """A time window whose counts are charged to the step after the one that ran them."""
    w = time_window(*args, **kwargs)
    c = w.counts["task_clock_ns"]
    w.counts["task_clock_ns"] = c[-1:] + c[:-1]
    return w


def _with_the_final_sync(*args: Any, **kwargs: Any) -> Any:
    """A time window that charges a 10 ms final sync to the last step."""
    w = time_window(*args, **kwargs)
    w.counts["task_clock_ns"][-1] += int(0.01e9)
    w.host_s[-1] += 0.01
    return w


@pytest.mark.parametrize("defect", [_shifted, _with_the_final_sync])
def test_step_count_check_catches_misplaced_counts(defect: Callable[..., Any]) -> None:
    with pytest.raises(AssertionError):  # the step errors, or host time below the CPU time it holds
        assert_window_counts_each_step(defect)


def test_unavailable_counters_say_why_and_measure_nothing():
    counters, why = hostcount.try_open_counters({"bogus": (0x7FFF0000, 0)})  # no such event type
    assert counters is None and why and "perf_event_open" in why
    w = time_window(CPU, "events", [lambda: None], None)
    assert w.counts == {}


def test_hardware_instructions_of_a_known_loop():
    counters, why = hostcount.try_open_counters()
    if counters is None:
        pytest.skip(f"no hardware counters here: {why}")
    try:

        def loop(n: int) -> None:
            for _ in range(n):
                pass

        loop(1000)
        deltas = []
        for n in (100_000, 200_000):
            a = counters.read()
            loop(n)
            b = counters.read()
            deltas.append(b[0] - a[0])
    finally:
        counters.close()
    assert 1.7 < deltas[1] / deltas[0] < 2.3, f"instructions do not scale with the loop: {deltas}"


def _reply(rank: int, counts: dict[str, list[int]], missing: str | None = None) -> dict:
    steps = len(next(iter(counts.values()))) if counts else 3
    return {
        "rank": rank,
        "device_type": "cpu",
        "device_name": None,
        "peak_dtype": "fp32",
        "optimizer_impl": "foreach",
        "seq_len": 32,
        "n_params": 10,
        "flops": {"flops_per_token": 60.0},
        "step_times_s": [0.01] * steps,
        "warmup_step_times_s": [],
        "windows": [
            {
                "wall_s": 0.03,
                "steps": steps,
                "host_cpu_s": [0.01] * steps,
                "host_s": [0.01 + 0.001 * rank] * steps,
                "counts": counts,
            }
        ],
        "counters": {"missing": missing, "multiplexed": False},
        "device_time": None,
        "losses": [1.0] * steps,
        "memory": {
            "mem_allocated_peak_bytes": None,
            "mem_reserved_peak_bytes": None,
            "nvml_mem_used_peak_bytes": None,
        },
        "nvml": None,
        "gc": None,
    }


def test_a_result_carries_the_slowest_ranks_host_figures_per_step():
    cfg = RunConfig.from_dict(
        {"strategy": "ddp", "world_size": 2, "model": "gpt2-tiny", "global_batch": 4, "micro_batch": 2}
    )
    r0 = _reply(0, {"instructions": [100, 300, 200], "cycles": [50, 60, 70]})
    r1 = _reply(1, {"instructions": [150, 250, 210], "cycles": [40, 80, 60]})
    res = summarize_bench(cfg, [r0, r1])
    host = res["host"]
    assert host["instructions"] == [150, 300, 210] and host["cycles"] == [50, 80, 70]
    assert host["host_s"] == pytest.approx([0.011] * 3)
    assert res["metrics"]["host_instructions"] == 210 and res["metrics"]["host_cycles"] == 70
    # a machine without counters: no counter metric at all, and the reason in the result
    bare = summarize_bench(cfg, [_reply(0, {}, "no PMU"), _reply(1, {}, "no PMU")])
    assert "host_instructions" not in bare["metrics"] and bare["host"]["counters_missing"] == "no PMU"
    assert bare["metrics"]["host_cpu_s"] == pytest.approx(0.01)
