"""Rules behind `distbench history`'s findings and the bisect it proposes: the asv grid's workload
(history/grid.py), which the dashboard's series measured and a proposed bisect must measure again, and what
the report calls a change and when it names a commit (history/report.py). Pure functions, no ranks."""

from __future__ import annotations

import numpy as np
import pytest

from distbench.config import RunConfig
from distbench.history import changepoints, grid, report
from distbench.history.changepoints import Change
from distbench.history.series import Point, Series
from extras import need

GOOD, BAD = "a" * 12 + "0" * 28, "b" * 12 + "1" * 28  # 40-hex commits whose first 10 and 11 characters differ


def grid_world_sizes(gpus: int) -> list[int]:
    """The world sizes the grid runs (benchmarks/bench_training.py, `distbench nightly`): 1, 2, 4 and 8 up to
    the GPUs; 1 and 2 on gloo without."""
    return [n for n in (1, 2, 4, 8) if n <= gpus] if gpus else [1, 2]


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 4, 5, 7, 8, 16])
def test_every_configuration_of_the_grid_is_one_run_would_take(gpus: int) -> None:
    """bench_training.py builds RunConfig(strategy, world_size, **workload) at each of the grid's world sizes:
    the workload's keys must be RunConfig's fields and its global batch divide into every world size's
    micro-steps, or a whole world size of the nightly grid fails to start."""
    w = grid.asv_workload(gpus)
    for ws in grid_world_sizes(gpus):
        cfg = RunConfig(strategy="ddp", world_size=ws, **w)
        assert cfg.global_batch == w["global_batch"]


@pytest.mark.parametrize(
    "gpus, global_batch", [(1, 8), (2, 16), (3, 16), (4, 32), (5, 32), (7, 32), (8, 64), (16, 64)]
)
def test_the_gpu_grid_scales_one_global_batch_over_its_world_sizes(gpus: int, global_batch: int) -> None:
    """Strong scaling: every world size of a machine trains the same global batch, micro-batch 8 times the
    largest world size the grid runs there (1, 2, 4, 8), so the largest takes one micro-batch per rank and
    the smaller accumulate."""
    w = grid.asv_workload(gpus)
    assert w["micro_batch"] == 8
    assert w["global_batch"] == global_batch and isinstance(w["global_batch"], int)
    assert RunConfig(strategy="ddp", world_size=max(grid_world_sizes(gpus)), **w).accum_steps == 1


def test_the_gpu_grid_is_the_documented_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/ci.md: DISTBENCH_ASV_MODEL names the GPU grid's model, gpt2-large by default; docs/measurement.md:
    one precision regime, bf16-amp, for every strategy; docs/reference-runs.md: the grid's 20 steps, 5
    warm-up steps before the first window; docs/asv-history.md: 5 timed windows, each a sample of asv's."""
    monkeypatch.delenv("DISTBENCH_ASV_MODEL", raising=False)
    w = grid.asv_workload(2)
    assert (w["model"], w["precision"]) == ("gpt2-large", "bf16-amp")
    assert (w["steps"], w["warmup"], w["windows"]) == (20, 5, 5)
    monkeypatch.setenv("DISTBENCH_ASV_MODEL", "gpt2-medium")
    assert grid.asv_workload(8)["model"] == "gpt2-medium"
    assert grid.asv_workload(0)["model"] == "gpt2-tiny"  # the CPU grid's model is not the GPU grid's choice


def test_the_cpu_grid_is_small_enough_for_a_quick_run() -> None:
    """Without GPUs (docs/asv-history.md): gpt2-tiny in fp32 on gloo, one timed step a window; the bisect a CPU
    series gets (below) holds the rest of its workload."""
    w = grid.asv_workload(0)
    assert (w["model"], w["precision"]) == ("gpt2-tiny", "fp32")
    assert w["windows"] == w["steps"] == 5


def found(
    config: dict | None = None,
    ratio: float = 1.02,
    interval: tuple[float, float] = (1.01, 1.03),
    *,
    metric: str = "step_time_s",
    same_commit: bool = False,
    negligible: bool = False,
    left_out: int = 0,
    ratio_series: bool = False,
) -> report.Found:
    """A change of a series found between GOOD and BAD (or two runs of GOOD), as analyse() would return it."""
    s = Series(
        metric, f"{metric} ddp ws2", config or {"strategy": "ddp", "world_size": 2}, ratio=ratio_series
    )
    c = Change(
        index=1, before=0.1, after=0.1 * ratio, ratio=ratio, low=interval[0], high=interval[1], p_value=0.004
    )
    bad = GOOD if same_commit else BAD
    return report.Found(s, c, Point(GOOD, 0.1), Point(bad, 0.1 * ratio), left_out, negligible)


def bisect_of(config: dict) -> list[str] | None:
    return report.bisect_argv(found(config), None, "o", [])


def test_an_asv_series_is_bisected_with_the_workload_its_grid_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """asv keeps only strategy and world size (and the machine): the bisect of its series reruns the grid's
    workload, the CPU grid's on gloo for a machine named `cpu` (docs/asv-history.md), the GPU grid's on CUDA
    for any other."""
    monkeypatch.delenv("DISTBENCH_ASV_MODEL", raising=False)
    head = ["distbench", "bisect", "--good", GOOD, "--bad", BAD]
    assert bisect_of({"strategy": "ddp", "world_size": 2, "machine": "cpu"}) == [
        *head, "-s", "ddp", "-n", "2", "-m", "gpt2-tiny", "--precision", "fp32", "--micro-batch", "2",
        "--steps", "5", "--warmup", "2", "--windows", "5", "--device", "cpu", "-o", "o",
    ]  # fmt: skip
    assert bisect_of({"strategy": "zero2", "world_size": 4, "machine": "h200x4"}) == [
        *head, "-s", "zero2", "-n", "4", "-m", "gpt2-large", "--precision", "bf16-amp", "--micro-batch", "8",
        "--steps", "20", "--warmup", "5", "--windows", "5", "--device", "cuda", "-o", "o",
    ]  # fmt: skip


def test_a_distbench_results_bisect_reruns_its_own_configuration() -> None:
    """A distbench result keeps its whole configuration: the bisect takes it as it is, each of sequence length,
    steps, warm-up and windows where the result has a value, and no device where it names none."""
    config = {"strategy": "fsdp_full", "world_size": 2, "model": "gpt2-small", "precision": "bf16",
              "micro_batch": 4, "seq_len": 256, "steps": 30, "warmup": None, "windows": 6, "machine": "cpu"}  # fmt: skip
    assert bisect_of(config)[6:] == [
        "-s", "fsdp_full", "-n", "2", "-m", "gpt2-small", "--precision", "bf16", "--micro-batch", "4",
        "--seq-len", "256", "--steps", "30", "--windows", "6", "-o", "o",
    ]  # fmt: skip


def test_a_change_is_negligible_only_when_its_whole_interval_lies_within_the_min_effect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Within +-min_effect either way, bounds included: 1 / (1 + e) <= low and high <= 1 + e (docs/history.md).
    An interval reaching past either bound is a change to act on."""
    e = 0.01
    lo, hi = 1 / (1 + e), 1 + e
    cases = {
        (lo, hi): True,
        (1.0, 1.005): True,
        (lo * 0.999, 1.005): False,
        (1 / (1.5 + e), 1.005): False,  # below the bound, if far above 1 / (2 + e)
        (1.0, hi * 1.001): False,
    }
    for (low, high), negligible in cases.items():
        change = Change(index=4, before=1.0, after=1.0, ratio=1.0, low=low, high=high, p_value=0.001)
        monkeypatch.setattr(report, "find_changes", lambda values, **kw: [change])  # noqa: B023
        s = Series("step_time_s", "x", {"strategy": "ddp", "world_size": 1})
        s.points = [Point(str(i), 1.0) for i in range(8)]
        (f,) = report.analyse([s], alpha=0.01, min_effect=e)
        assert f.negligible is negligible, (low, high)
        assert (f.last_good.commit, f.first_bad.commit) == ("3", "4")


def step(n_before: int, n_after: int, seed: int = 3, size: float = 0.012) -> Series:
    rng = np.random.default_rng(seed)
    values = np.r_[1 + rng.uniform(-0.01, 0.01, n_before), 1 + size + rng.uniform(-0.01, 0.01, n_after)]
    s = Series("step_time_s", f"step {n_before}+{n_after}", {"strategy": "ddp", "world_size": 2})
    s.points = [Point(f"{i:040x}", float(v)) for i, v in enumerate(values)]
    return s


def test_a_series_that_is_not_all_positive_or_too_short_is_passed_over_and_the_rest_analysed() -> None:
    """Changes are relative, of positive figures: a series holding a 0 (a metric that could not be measured) is
    skipped, not an error, and so is one with fewer than MIN_POINTS = 4 points; the series after either are
    analysed all the same."""
    need("ruptures")
    zero, short, s = step(10, 10, size=0.5), step(2, 1, size=0.5), step(10, 10, size=0.5)
    zero.points[3] = Point(zero.points[3].commit, 0.0)
    (f,) = report.analyse([zero, short, s], alpha=0.01)
    assert f.series is s and f.change.index == 10


def test_four_points_two_a_side_are_enough_to_look_for_a_change() -> None:
    """MIN_POINTS = 4 (two a side) is the least a series needs: four points at a lax alpha do show their step."""
    need("ruptures")
    s = Series("step_time_s", "x", {"strategy": "ddp", "world_size": 1})
    s.points = [Point(c, v) for c, v in zip("abcd", (1.0, 1.0001, 2.0, 2.0001), strict=True)]
    (f,) = report.analyse([s], alpha=0.5)
    assert (f.last_good.commit, f.first_bad.commit) == ("b", "c")
    assert report.analyse([Series(s.metric, "y", s.config, s.points[:3])], alpha=0.5) == []


def test_analyse_places_a_change_at_the_boundary_of_the_points_commits() -> None:
    """The points' commits go to the search: a change one run into commit b (its first run short of its
    level) is reported between a and b, and a series of one run per commit keeps the best split."""
    need("ruptures")
    from test_rules_changepoints import FIRST_RUN_SHORT

    values = [float(np.exp(v / 100)) for v in FIRST_RUN_SHORT]
    s = Series("step_time_s", "x", {"strategy": "ddp", "world_size": 1})
    s.points = [Point("a" if i < 6 else "b", v) for i, v in enumerate(values)]
    (f,) = report.analyse([s], alpha=0.01)
    assert (f.change.index, f.last_good.commit, f.first_bad.commit) == (6, "a", "b")
    s.points = [Point(f"c{i}", v) for i, v in enumerate(values)]
    (f,) = report.analyse([s], alpha=0.01)
    assert f.change.index == 7


def test_analyse_reports_the_detectors_changes_at_its_alpha_and_seed() -> None:
    """The p-values history.json reports are the permutation tests' at the alpha and seed asked for: a 1.2%
    step in 12 points is significant at 0.05 and not at 0.01 (p = 0.016 with seed 0), and seeds other than
    the default (0, find_changes' own) give their own p-values."""
    need("ruptures")
    s = step(6, 6)
    values, commits = [p.value for p in s.points], [p.commit for p in s.points]
    assert report.analyse([s], alpha=0.01) == []
    (f,) = report.analyse([s], alpha=0.05)
    assert f.change == changepoints.find_changes(values, alpha=0.05, groups=commits)[0]
    assert f.change.p_value == 0.016
    p = {seed: report.analyse([s], alpha=0.5, seed=seed)[0].change.p_value for seed in (0, 1, 7)}
    assert p == {seed: changepoints.find_changes(values, alpha=0.5, seed=seed)[0].p_value for seed in p}
    assert len(set(p.values())) == 3


def test_each_change_is_described_in_words_with_its_interval_and_why_it_gets_no_bisect() -> None:
    """What `distbench history` prints of a change: regression or improvement (by the metric's direction),
    the size with its interval in percent, the p-value, both commits to 10 characters, and the reason there is
    no bisect: both runs of one commit, too small, or (ratio series) that its bisect is side by side."""
    where = "(p = 0.004); last good aaaaaaaaaa, first bad bbbbbbbbbb"
    assert report.describe(found()) == f"regression: 0.1 s -> 0.102 s, +2.00% [+1.00%, +3.00%] {where}"
    faster = found(ratio=0.95, interval=(0.93, 0.97))
    assert report.describe(faster) == f"improvement: 0.1 s -> 0.095 s, -5.00% [-7.00%, -3.00%] {where}"
    assert report.describe(found(metric="tokens_per_s", ratio=0.95, interval=(0.93, 0.97))).startswith(
        "regression: 0.1 tokens/s -> 0.095 tokens/s, -5.00%"
    )
    same = report.describe(found(same_commit=True, left_out=2))
    assert same == (
        "regression: 0.1 s -> 0.102 s, +2.00% [+1.00%, +3.00%] (p = 0.004); last good aaaaaaaaaa, first bad "
        "aaaaaaaaaa; both runs of one commit: the machine or its environment moved, not the code; 2 flagged "
        "point(s) left out"
    )
    small = report.describe(found(interval=(1.001, 1.003), negligible=True))
    assert small == (
        f"regression: 0.1 s -> 0.102 s, +2.00% [+0.10%, +0.30%] {where}; its whole interval lies within "
        "--min-effect: too small to bisect"
    )
    side_by_side = "; a ratio against the frozen reference: its bisect compares the commits side by side"
    ratio = report.describe(found(ratio_series=True, left_out=1))
    assert ratio == (
        f"regression: 0.1 x reference -> 0.102 x reference, +2.00% [+1.00%, +3.00%] {where}{side_by_side}; "
        "1 flagged point(s) left out"
    )
    for no_bisect in (
        found(ratio_series=True, ratio=0.95, interval=(0.93, 0.97)),
        found(ratio_series=True, same_commit=True),
        found(ratio_series=True, negligible=True),
    ):
        assert side_by_side not in report.describe(no_bisect)


def test_history_json_holds_each_change_with_its_command() -> None:
    """history.json's record of a change, as scripts/history_gpu.sh and relative_nightly_summary.py read it;
    one command (or None) per change, never one short."""
    f = found({"strategy": "ddp", "world_size": 2, "machine": "cpu"}, left_out=1)
    argv = report.bisect_argv(f, None, "o", [])
    first, same = report.to_json([f, found(same_commit=True)], [argv, None])
    assert first == {
        "series": "step_time_s ddp ws2",
        "metric": "step_time_s",
        "unit": "s",
        "config": {"strategy": "ddp", "world_size": 2, "machine": "cpu"},
        "index": 1,
        "last_good": GOOD,
        "first_bad": BAD,
        "before": 0.1,
        "after": 0.1 * 1.02,
        "ratio": 1.02,
        "ratio_interval": [1.01, 1.03],
        "p_value": 0.004,
        "regression": True,
        "negligible": False,
        "flagged_left_out": 1,
        "bisect": report.command_text(argv),
    }
    assert (same["last_good"], same["first_bad"], same["bisect"]) == (GOOD, GOOD, None)
    assert report.command_text(argv).startswith(f"distbench bisect --good {GOOD} --bad {BAD} -s ddp -n 2")
    with pytest.raises(ValueError):
        report.to_json([f, f], [argv])
