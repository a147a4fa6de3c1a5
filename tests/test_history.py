"""`distbench history`: change points on generated series (where the truth is known), the two stores it reads,
and the bisect commands it proposes and runs. Each detector check is also run against a planted defect."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distbench.cli import main
from distbench.history import changepoints, report
from distbench.history.series import Point, Series, from_asv, from_results
from distbench.results import make_result, save_result
from extras import need


@pytest.fixture(autouse=True, scope="module")
def history_extra() -> None:
    """The change-point search is ruptures' and the asv store is read with asv's code: both from the history
    extra, which the README's `.[test]` brings."""
    need("ruptures")
    need("asv")


def noisy(rng: np.random.Generator, n: int, level: float) -> np.ndarray:
    """n figures within +-1% of `level`."""
    return level * (1 + rng.uniform(-0.01, 0.01, n))


def step_series(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.r_[noisy(rng, 30, 1.0), noisy(rng, 30, 1.02)]


def check_step_found_at_its_commit() -> None:
    changes = changepoints.find_changes(step_series())
    assert [c.index for c in changes] == [30], changes
    c = changes[0]
    assert c.low < 1.02 < c.high and c.low > 1, c  # its interval holds the true 2% and excludes none
    assert c.before == pytest.approx(1.0, abs=0.005) and c.after == pytest.approx(1.02, abs=0.005)


def check_noise_has_no_change_point() -> None:
    """Seed 19's noise has a split the search proposes (before point 183); the permutation test rejects it."""
    x = noisy(np.random.default_rng(19), 200, 1.0)
    assert changepoints.candidates(np.log(x)) == [183]
    assert changepoints.find_changes(x) == []


def check_two_steps_both_found() -> None:
    rng = np.random.default_rng(2)
    series = np.r_[noisy(rng, 40, 1.0), noisy(rng, 40, 1.02), noisy(rng, 40, 1.04)]
    changes = changepoints.find_changes(series)
    assert [c.index for c in changes] == [40, 80], changes
    assert all(c.low > 1 for c in changes)


def test_a_2pct_step_in_1pct_noise_is_found_at_its_commit():
    check_step_found_at_its_commit()


def test_200_commits_of_noise_have_no_change_point():
    check_noise_has_no_change_point()


def test_two_steps_in_one_series_are_both_found():
    check_two_steps_both_found()


def test_the_checks_fail_on_planted_defects(monkeypatch):
    """Each check above against a broken detector: an off-by-one in where a change is placed, a significance
    test ten times too lenient, and a search that keeps only its first candidate."""
    with monkeypatch.context() as m:
        best = changepoints.best_split
        m.setattr(changepoints, "best_split", lambda y, groups=None: best(y, groups) + 1)
        with pytest.raises(AssertionError):
            check_step_found_at_its_commit()
    with monkeypatch.context() as m:
        p_value = changepoints.split_p_value
        m.setattr(changepoints, "split_p_value", lambda y, rng: p_value(y, rng) / 10)
        with pytest.raises(AssertionError):
            check_noise_has_no_change_point()
    with monkeypatch.context() as m:
        search = changepoints.candidates
        m.setattr(changepoints, "candidates", lambda x: search(x)[:1])
        with pytest.raises(AssertionError):
            check_two_steps_both_found()


def test_a_change_needs_enough_points_a_side_to_be_significant():
    """The permutation test's floor: 5 runs and 4 of a 2% slowdown (0.3% noise), perfectly apart, reach
    p ~ 0.03, significant at 0.05 and not at 0.01; 8 and 6 reach 0.002."""
    rng = np.random.default_rng(3)
    small = np.r_[rng.normal(1, 0.003, 5), rng.normal(1.02, 0.003, 4)]
    assert changepoints.find_changes(small, alpha=0.01) == []
    assert [c.index for c in changepoints.find_changes(small, alpha=0.05)] == [5]
    larger = np.r_[rng.normal(1, 0.003, 8), rng.normal(1.02, 0.003, 6)]
    assert [c.index for c in changepoints.find_changes(larger, alpha=0.01)] == [8]


def commits(n: int) -> list[str]:
    return [f"{i:04x}" * 10 for i in range(1, n + 1)]  # asv names a results file by the first 8


#: step times (ms) of 8 runs of one commit and 6 of a later one with a planted +5% of device work, one H200
#: (results/history-h200-2026-11-28): one slow run of the first commit, and the second's first run faster
#: than it, so on ranks the split fell one run into the second commit; on the runs' values it does not
H200_RUNS = [221.0, 221.4, 221.4, 232.8, 221.7, 222.0, 223.6, 222.7, 232.2, 235.0, 236.2, 235.2, 234.9, 234.6]


def test_a_change_between_commits_is_placed_at_their_boundary():
    commits = ["a"] * 8 + ["b"] * 6
    assert [c.index for c in changepoints.find_changes(H200_RUNS)] == [8]
    assert [c.index for c in changepoints.find_changes(H200_RUNS, groups=commits)] == [8]
    s = Series("step_time_s", "step_time_s ddp ws1", {"strategy": "ddp", "world_size": 1})
    s.points = [Point(c, v / 1000) for c, v in zip(commits, H200_RUNS, strict=True)]
    (f,) = report.analyse([s], alpha=0.01)
    assert (f.last_good.commit, f.first_bad.commit) == ("a", "b")


def test_a_step_after_a_long_history_is_placed_at_its_commit():
    """A nightly sees a regression with many nights before it and few after: a 3% step after 30 nights of
    +-1% noise, 4 nights after it, is placed at its first night in every seed (on ranks, one night early in
    57 of 200 seeds: the search's gain favours the segment's middle, and ranks keep no size)."""
    for seed in range(12):
        rng = np.random.default_rng(seed)
        values = np.r_[noisy(rng, 30, 1.0), noisy(rng, 4, 1.03)]
        assert [c.index for c in changepoints.find_changes(values, alpha=0.05, seed=seed)] == [30], seed


def test_a_machine_that_moved_within_one_commit_keeps_its_change_there():
    rng = np.random.default_rng(3)
    values = np.r_[noisy(rng, 6, 1.0), noisy(rng, 10, 1.05)]
    commits = ["a"] * 12 + ["b"] * 4  # the step is at run 6 of commit a, far from the boundary at 12
    assert [c.index for c in changepoints.find_changes(values, groups=commits)] == [6]


def test_the_report_names_the_last_good_and_first_bad_commit_and_the_bisect():
    values = step_series()
    s = Series(
        "step_time_s",
        "step_time_s ddp ws2",
        {
            "strategy": "ddp",
            "world_size": 2,
            "model": "gpt2-tiny",
            "precision": "fp32",
            "micro_batch": 2,
            "device": "cpu",
        },
    )
    s.points = [Point(c, float(v)) for c, v in zip(commits(60), values, strict=True)]
    (f,) = report.analyse([s], alpha=0.01)
    assert (f.last_good.commit, f.first_bad.commit) == (commits(60)[29], commits(60)[30]) and f.worse
    argv = report.bisect_argv(f, "/repo", "out/bisect-1", ["--max-pairs", "6"])
    assert argv == [
        "distbench", "bisect", "--good", commits(60)[29], "--bad", commits(60)[30], "--repo", "/repo",
        "-s", "ddp", "-n", "2", "-m", "gpt2-tiny", "--precision", "fp32", "--micro-batch", "2",
        "--device", "cpu", "--max-pairs", "6", "-o", "out/bisect-1",
    ]  # fmt: skip
    s.points = [Point(commits(60)[0], p.value) for p in s.points]  # all runs of one commit: nothing to bisect
    (same,) = report.analyse([s], alpha=0.01)
    assert same.same_commit and report.bisect_argv(same, None, "o", []) is None
    assert "not the code" in report.describe(same)
    s.points = [Point(p.commit, 1 / p.value) for p in s.points]  # a faster step: an improvement, no bisect
    assert report.analyse([s], alpha=0.01)[0].worse is False


def test_a_real_change_too_small_to_matter_is_negligible_not_a_regression(tmp_path, capsys):
    """A noise-free figure (a memory peak) that moves by 4 KiB in 1.2 GB is a real change point, and no reason
    to bisect or fail the night; the same series moving by 2% is a regression. --min-effect 0 asks for every
    change."""
    s = Series(
        "mem_allocated_peak_bytes", "mem_allocated_peak_bytes ddp ws2", {"strategy": "ddp", "world_size": 2}
    )
    for step, negligible in ((4096.0, True), (0.02 * 1.2e9, False)):
        s.points = [Point(c, 1.2e9 + (step if i >= 10 else 0.0)) for i, c in enumerate(commits(20))]
        (f,) = report.analyse([s], alpha=0.01)
        assert f.worse and f.negligible is negligible and f.actionable is not negligible
        assert (report.bisect_argv(f, None, "o", []) is None) is negligible
    s.points = [Point(c, 1.2e9 + (4096.0 if i >= 10 else 0.0)) for i, c in enumerate(commits(20))]
    assert report.analyse([s], alpha=0.01, min_effect=0.0)[0].actionable
    assert "within --min-effect" in report.describe(report.analyse([s], alpha=0.01)[0])
    rng = np.random.default_rng(5)  # through the command: a 4 KiB step exits 0, at --min-effect 0 it exits 1
    values = list(np.r_[rng.normal(0.1, 0.0003, 8), rng.normal(0.1, 0.0003, 6)])
    write_results(tmp_path / "r", values, ["a" * 40] * 8 + ["b" * 40] * 6, memory_step=4096)
    args = ["history", str(tmp_path / "r"), "--metric", "mem_allocated_peak_bytes", "-o", str(tmp_path / "o")]
    assert main(args) == 0 and "negligible" in capsys.readouterr().out
    assert main([*args, "--min-effect", "0"]) == 1


def test_flagged_points_are_left_out_unless_asked():
    values = step_series()
    s = Series("step_time_s", "x", {"strategy": "ddp", "world_size": 1})
    s.points = [
        Point(c, float(v), flagged=i >= 30) for i, (c, v) in enumerate(zip(commits(60), values, strict=True))
    ]
    assert report.analyse([s], alpha=0.01) == []
    (f,) = report.analyse([s], alpha=0.01, include_flagged=True)
    assert f.change.index == 30


def write_asv_history(root: Path, values: list[float], flagged: set[int] = frozenset()) -> list[str]:
    """An asv results directory written by asv's own Results code: one commit a point, ddp at world sizes 1
    and 2, the step time (ws 2 takes `values`, ws 1 stays flat) with five samples each, and the flags."""
    results, runner = need("asv.results"), need("asv.runner")

    shas = commits(len(values))
    params = [["'ddp'"], ["1", "2"]]
    for i, (sha, v) in enumerate(zip(shas, values, strict=True)):
        r = results.Results(
            {"machine": "h200x2"}, {}, sha, 1_700_000_000_000 + i * 86_400_000, "3.11", "e", {}
        )
        step = runner.BenchmarkResult(
            result=[True, True],
            samples=[[0.5 * f for f in (0.99, 1, 1.01, 1, 1)], [v * f for f in (0.99, 1, 1.01, 1, 1)]],
            number=[1, 1], errcode=0, stderr="", profile=None,
        )  # fmt: skip
        flags = runner.BenchmarkResult(
            result=[0, int(i in flagged)],
            samples=[None, None],
            number=[None, None],
            errcode=0,
            stderr="",
            profile=None,
        )
        for name, res in (("StepTime.track_step_time", step), ("Plausibility.track_warnings", flags)):
            bm = {"name": f"bench_training.{name}", "params": params, "version": "1"}
            r.add_result(bm, res)
        r.save(str(root))
    (root / "h200x2" / "machine.json").write_text(
        '{"machine": "h200x2", "version": 1}'
    )  # `asv machine` writes it
    return shas


def test_an_asv_history_is_read_with_its_intervals_and_flags(tmp_path):
    values = list(step_series()[20:40])  # 10 points a side
    shas = write_asv_history(tmp_path, values, flagged={3})
    series = {s.label: s for s in from_asv(tmp_path)}
    ws2 = series["StepTime.track_step_time ddp 2 [h200x2]"]
    assert [p.commit for p in ws2.points] == shas and ws2.config == {"strategy": "ddp", "world_size": 2,
                                                                     "machine": "h200x2"}  # fmt: skip
    assert [p.flagged for p in ws2.points] == [i == 3 for i in range(20)]
    assert all(p.low < p.value < p.high for p in ws2.points)
    (f,) = report.analyse(list(series.values()), alpha=0.01)
    assert (
        f.series is ws2
        and (f.last_good.commit, f.first_bad.commit) == (shas[9], shas[10])
        and f.left_out == 1
    )
    argv = report.bisect_argv(f, None, "o", [])
    assert argv[argv.index("-m") + 1] == "gpt2-large" and argv[argv.index("--device") + 1] == "cuda"
    collective = Series(
        "busbw_gbps", "x", {"op": "all_reduce", "world_size": 2, "machine": "h200x2"}, asv_form=True
    )
    collective.points = ws2.points
    (c,) = report.analyse([collective], alpha=0.01)
    assert (
        c.worse and report.bisect_argv(c, None, "o", []) is None
    )  # `distbench bisect` follows training only


def write_results(
    root: Path, values: list[float], shas: list[str], warned: set[int] = frozenset(), memory_step: float = 0.0
) -> None:
    """One result per value, of the commit beside it; the memory peak 1e9 bytes, plus `memory_step` from the
    second commit on."""
    for i, (v, sha) in enumerate(zip(values, shas, strict=True)):
        memory = 1e9 + (memory_step if sha != shas[0] else 0.0)
        r = make_result(
            {"strategy": "ddp", "world_size": 1, "model": "gpt2-tiny", "precision": "fp32", "seq_len": 32,
             "global_batch": 4, "micro_batch": 2, "steps": 5, "warmup": 2, "windows": 5, "device": "cpu"},
            metrics={"step_time_s": v, "tokens_per_s": 128 / v, "mem_allocated_peak_bytes": memory},
            step_time_s={"median": v, "p10": v, "p90": v, "windows": [v * 0.99, v, v * 1.01, v, v]},
            env={"git_commit": sha},
        )  # fmt: skip
        r["created"] = f"2026-11-01T00:{i:02d}:00+00:00"
        r["warnings"] = ["a contended host"] if i in warned else []
        save_result(r, root)


def test_distbench_results_are_read_by_commit_and_run(tmp_path):
    """Repeats of a commit are points of their own, ordered by when they ran."""
    shas = ["a" * 40] * 8 + ["b" * 40] * 6
    rng = np.random.default_rng(4)
    values = list(np.r_[rng.normal(0.1, 0.0003, 8), rng.normal(0.102, 0.0003, 6)])
    write_results(tmp_path, values, shas, warned={2})
    (step,) = [s for s in from_results([tmp_path]) if s.metric == "step_time_s"]
    assert [p.commit for p in step.points] == shas and [p.value for p in step.points] == pytest.approx(values)
    assert step.points[0].low == pytest.approx(values[0] * 0.99) and step.points[2].flagged
    assert step.config["model"] == "gpt2-tiny" and step.config["windows"] == 5


def test_the_command_prints_each_change_and_runs_its_bisect_through_distbench_bisect(
    tmp_path, monkeypatch, capsys
):
    shas = ["a" * 40] * 8 + ["b" * 40] * 6
    rng = np.random.default_rng(5)
    write_results(tmp_path / "r", list(np.r_[rng.normal(0.1, 0.0003, 8), rng.normal(0.102, 0.0003, 6)]), shas)
    out = tmp_path / "out"
    assert main(["history", str(tmp_path / "r"), "--repo", str(tmp_path), "-o", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"last good {'a' * 10}, first bad {'b' * 10}" in text and "regression" in text
    saved = json.loads((out / "history.json").read_text())
    (step,) = [c for c in saved if c["metric"] == "step_time_s"]
    assert step["bisect"].startswith(f"distbench bisect --good {'a' * 40} --bad {'b' * 40} --repo {tmp_path}")
    assert 1.01 < step["ratio_interval"][0] < step["ratio"] < step["ratio_interval"][1] < 1.03
    assert (out / "series-1.png").read_bytes().startswith(b"\x89PNG")  # the series with its intervals drawn

    from distbench.commands import bisect

    seen = []
    monkeypatch.setattr(bisect, "run", lambda args: seen.append(args) or 1)
    assert main(["history", str(tmp_path / "r"), "--repo", str(tmp_path), "-o", str(out), "--bisect",
                 "--metric", "step_time_s", "--bisect-flags", "--max-pairs 4"]) == 1  # fmt: skip
    (args,) = seen  # the bisect command's own parser read the proposed command line
    assert (args.good, args.bad, args.strategy, args.world_size, args.max_pairs) == (
        "a" * 40,
        "b" * 40,
        ["ddp"],
        1,
        4,
    )
    assert args.output == out / "bisect-1"
    monkeypatch.setattr(bisect, "run", lambda args: 2)  # a bisect that could not run is no quiet success
    assert main(["history", str(tmp_path / "r"), "-o", str(out), "--bisect", "--metric", "step_time_s"]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["history"], "give distbench result files"),
        (["history", "--asv", "nowhere"], "--asv nowhere: no asv results"),
        (["history", "--asv", "."], "--asv .: no asv results"),
        (["history", "x.json", "--alpha", "2"], "--alpha must lie between 0 and 1"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, message, capsys):
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow  # 12 runs of gpt2-tiny and a 3-revision bisect on gloo: 704 s on the shared 2 cores
@pytest.mark.nightly  # the per-submission tier keeps the detector's and the bisect line's tests (test_history)
def test_the_gpu_script_finds_and_bisects_a_plant_on_cpu(tmp_path):
    """scripts/history_gpu.sh's logic on CPU: 6 + 6 runs with a host-side plant in revision 1 (a 3 s sleep a
    step: on the project's shared 2-core machine gpt2-tiny's step ran 0.03-2 s), which the nights skip; the history finds the change between revisions 0 and 2, and its
    bisect names revision 1 (the script's table says so and its exit status is 0)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "GOOD_RUNS": "6",
        "BAD_RUNS": "6",
        "PLANT": "host-sleep-fixed",  # a fixed sleep: a shared CPU's contention cannot stretch or hide it
        "DISTBENCH_PLANT_SLEEP_S": "3",
        "CONFIG": "-s ddp -n 1 -m gpt2-tiny --precision fp32 --micro-batch 2 --global-batch 2 --steps 2 "
        "--windows 2 --warmup 2 --device cpu",
        "HISTORY": "--alpha 0.05 --include-flagged",  # a shared CPU flags most runs
        "BISECT": "--min-pairs 3 --look-every 1 --max-pairs 8",  # a shared CPU: 4 pairs left the first probe open
    }
    run = subprocess.run(
        ["bash", "scripts/history_gpu.sh", str(tmp_path)], cwd=root, env=env, capture_output=True, text=True
    )
    table = run.stdout[-1500:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert table.split("planted revision 1 named")[1].split()[0] == "yes", table
    assert "revision 0: this checkout's src -> revision 2" in table
    saved = json.loads((tmp_path / "history" / "history.json").read_text())
    assert [c["metric"] for c in saved] == ["step_time_s"] and saved[0]["regression"]


ASV_COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a", "stats_ci_99_b"]


def write_asv_file(mdir: Path, name: str, sha: str, date: int, results: dict[str, list]) -> None:
    """One asv results file as asv writes it (each benchmark a row of ASV_COLUMNS, trailing empty columns
    dropped), in a machine folder with its machine.json."""
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "machine.json").write_text(json.dumps({"machine": mdir.name, "version": 1}))
    data = {"commit_hash": sha, "date": date, "result_columns": ASV_COLUMNS, "version": 2}
    data["results"] = {f"bench_training.{k}": v for k, v in results.items()}
    (mdir / name).write_text(json.dumps(data))


STRATEGIES = [["'ddp'", "'fsdp'"], ["1"]]


def test_an_asv_history_is_read_by_date_skipping_what_asv_could_not_measure(tmp_path):
    """Two results files whose names sort against their dates: points follow the dates. A combination asv
    could not measure (null, or NaN) and a benchmark without a result are skipped, the rest of the file
    still read; a column shorter than the combinations, or dropped, is no interval; flags count only where
    they were taken over the same combinations (the newer file's, over ddp alone, flag its ratio); a bus bandwidth series is named by its collective and a
    ratio track is a ratio series of its registry metric."""
    older, newer, m = "b" * 40, "a" * 40, tmp_path / "m1"
    write_asv_file(m, "bbbbbbbb-env.json", older, 1000, {
        "StepTime.track_step_time": [[None, 0.50], STRATEGIES, "1", 0, 1, [None], [None]],
        "Plausibility.track_warnings": [[0, 1], STRATEGIES],
        "Memory.track_peak_mem_allocated": [None, STRATEGIES],
        "Relative.track_step_time_s": [[1.02], [["'ddp'"], ["1"]]],
        "BusBandwidth.track_ms_per_bus_gb": [[5.0], [["'all_reduce'"], ["2"]], "1", 0, 1, [4.9], [5.1]],
    })  # fmt: skip
    write_asv_file(m, "aaaaaaaa-env.json", newer, 2000, {
        "StepTime.track_step_time": [[0.40, 0.52], STRATEGIES],
        "Plausibility.track_warnings": [[1], [["'ddp'"], ["1"]]],
        "Memory.track_peak_mem_allocated": [[float("nan"), 100.0], STRATEGIES],
        "Relative.track_step_time_s": [[1.03], [["'ddp'"], ["1"]]],
    })  # fmt: skip
    got = {
        s.label: (s.metric, s.config, s.asv_form, s.ratio, [(p.commit, p.value, p.low, p.high, p.flagged) for p in s.points])
        for s in from_asv(tmp_path, machine="m1")
    }  # fmt: skip
    training = {"world_size": 1, "machine": "m1"}
    assert got == {
        "StepTime.track_step_time ddp 1 [m1]": ("step_time_s", {"strategy": "ddp", **training}, True, False,
                                                [(newer, 0.40, None, None, False)]),
        "StepTime.track_step_time fsdp 1 [m1]": ("step_time_s", {"strategy": "fsdp", **training}, True, False,
                                                 [(older, 0.50, None, None, True), (newer, 0.52, None, None, False)]),
        "Memory.track_peak_mem_allocated fsdp 1 [m1]": ("mem_allocated_peak_bytes", {"strategy": "fsdp", **training},
                                                        True, False, [(newer, 100.0, None, None, False)]),
        "Relative.track_step_time_s ddp 1 [m1]": ("step_time_s", {"strategy": "ddp", **training}, False, True,
                                                  [(older, 1.02, None, None, False), (newer, 1.03, None, None, True)]),
        "BusBandwidth.track_ms_per_bus_gb all_reduce 2 [m1]": ("busbw_gbps", {"op": "all_reduce", "world_size": 2, "machine": "m1"},
                                                               True, False, [(older, 5.0, 4.9, 5.1, False)]),
    }  # fmt: skip


def test_an_asv_results_file_is_read_as_utf_8_whatever_the_locale(tmp_path, ascii_locale):
    """JSON's bytes are UTF-8 (RFC 8259) under any locale: a results file that holds a non-ASCII character as
    itself (a tool other than asv wrote it, in the environment's name) reads as written where the locale's own
    encoding is ASCII, its point and all, not refused as a file asv did not write."""
    m = tmp_path / "m1"
    write_asv_file(
        m, "aaaaaaaa-env.json", "a" * 40, 1000, {"StepTime.track_step_time": [[0.5], [["'ddp'"], ["1"]]]}
    )
    f = m / "aaaaaaaa-env.json"
    data = json.loads(f.read_text(encoding="utf-8"))
    data["env_name"] = "conda-py3.11-caf\u00e9"
    f.write_bytes(json.dumps(data, ensure_ascii=False).encode("utf-8"))
    got = [(s.label, [(p.commit, p.value) for p in s.points]) for s in from_asv(tmp_path)]
    assert got == [("StepTime.track_step_time ddp 1 [m1]", [("a" * 40, 0.5)])]


def test_an_asv_directory_that_is_not_one_is_refused_naming_what_was_looked_for(tmp_path):
    """No machine folder, no folder of the machine asked for, a file asv did not write: one ConfigError
    each, naming the directory, the machine and the file."""
    import re

    from distbench.errors import ConfigError

    shape = " (a directory with a folder per machine, each with its machine.json, as `asv run` writes .asv/results)"
    with pytest.raises(ConfigError, match=f"^{re.escape(f'--asv {tmp_path}: no asv results{shape}')}$"):
        from_asv(tmp_path)
    write_asv_file(tmp_path / "m1", "aaaaaaaa-env.json", "a" * 40, 1000, {})
    with pytest.raises(
        ConfigError, match=f"^{re.escape(f'--asv {tmp_path}: no asv results of machine m2{shape}')}$"
    ):
        from_asv(tmp_path, machine="m2")
    assert from_asv(tmp_path, machine="m1") == []
    bad = tmp_path / "m1" / "bbbbbbbb-env.json"
    bad.write_text("not json")
    with pytest.raises(
        ConfigError, match=f"^{re.escape(f'--asv {tmp_path}: {bad} is not an asv results file (')}"
    ):
        from_asv(tmp_path)


def test_distbench_results_give_the_tracked_metrics_with_their_windows_range(tmp_path):
    """Per configuration, one series for each metric with an asv track (not tokens/s, which has none, nor
    bus bandwidth, which asv's collectives follow), in the order the runs were made (not the order of their
    folders), runs without a commit left out. A time's range over the timed windows
    is proportional to them, a rate's or an efficiency's (MFU, scaling) inversely so; memory, which the
    windows do not time, has none, nor a run that kept no windows."""
    v = 0.1
    runs = [("", "00:01", [0.99, 1.0, 1.01]), ("b" * 40, "00:02", [0.99, 1.0, 1.01]), ("c" * 40, "00:00", [0.98, 1.02]),
            ("d" * 40, "00:03", [])]  # fmt: skip
    for sha, created, windows in runs:
        r = make_result(
            {"strategy": "ddp", "world_size": 1, "model": "gpt2-tiny", "precision": "fp32", "seq_len": 32,
             "global_batch": 4, "micro_batch": 2, "steps": 5, "warmup": 2, "windows": 5, "device": "cpu"},
            metrics={"step_time_s": v, "tokens_per_s": 128 / v, "mfu": 0.3, "scaling_efficiency": 0.9,
                     "mem_allocated_peak_bytes": 1e9, "busbw_gbps": 10.0},
            step_time_s={"median": v, "p10": v, "p90": v, "windows": [v * w for w in windows]},
            env={"git_commit": sha},
        )  # fmt: skip
        r["created"] = f"2026-11-01T00:{created}+00:00"
        save_result(r, tmp_path / sha[:1])
    got = {s.metric: [(p.commit, p.value, p.low, p.high) for p in s.points] for s in from_results([tmp_path])}
    assert sorted(got) == ["mem_allocated_peak_bytes", "mfu", "scaling_efficiency", "step_time_s"]
    commits = ["c" * 40, "b" * 40, "d" * 40]
    assert [c for c, *_ in got["step_time_s"]] == commits
    assert got["step_time_s"] == [
        (commits[0], v, pytest.approx(0.98 * v), pytest.approx(1.02 * v)),
        (commits[1], v, pytest.approx(0.99 * v), pytest.approx(1.01 * v)),
        (commits[2], v, None, None),
    ]
    for metric, value in (("mfu", 0.3), ("scaling_efficiency", 0.9)):
        assert got[metric] == [
            (commits[0], value, pytest.approx(value / 1.02), pytest.approx(value / 0.98)),
            (commits[1], value, pytest.approx(value / 1.01), pytest.approx(value / 0.99)),
            (commits[2], value, None, None),
        ], metric
    assert got["mem_allocated_peak_bytes"] == [(c, 1e9, None, None) for c in commits]
