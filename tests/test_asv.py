"""The asv layer stores what `distbench run` would show as results, and its dashboard says what it shows:
names, units, which runs have data, and links to the commits."""

from __future__ import annotations

import importlib
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from distbench.metrics import METRICS
from distbench.results import make_result
from extras import need

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = {"model": "gpt2-tiny", "precision": "fp32", "seq_len": 32, "global_batch": 4, "micro_batch": 2}


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("benchmarks.bench_training")
    finally:
        sys.path.remove(str(ROOT))


def tracks(bench):
    """(benchmark class, method name, registry metric) of every asv track."""
    return [
        (getattr(bench, m.asv.benchmark.split(".")[0]), m.asv.benchmark.split(".")[1], m)
        for m in METRICS.values()
        if m.asv is not None
    ]


def _grid(bench, monkeypatch) -> dict:
    """setup_cache over a fabricated grid: the 1-rank runs cold, ddp at 2 ranks 8x faster (the 405% efficiency
    asv stored once), each run with five timed windows 1% apart."""
    tps = {("single", 1): 100.0, ("ddp", 1): 95.0, ("ddp", 2): 807.0}

    def train(strategy: str, ws: int) -> dict:
        if (strategy, ws) not in tps:
            return {"skip": "single runs on 1 rank"}
        st = 4 * 32 / tps[strategy, ws]
        metrics = {k: 0.5 for k in METRICS if METRICS[k].source == "bench"}
        windows = [st * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)]
        return make_result(
            {"strategy": strategy, "world_size": ws, **WORKLOAD},
            metrics={**metrics, "tokens_per_s": tps[strategy, ws], "step_time_s": st},
            step_time_s={
                "median": st,
                "p10": st * 0.99,
                "p90": st * 1.01,
                "std": 0.0,
                "n": 5,
                "windows": windows,
            },
        )

    monkeypatch.setattr(bench, "STRATEGIES", ["single", "ddp"])
    monkeypatch.setattr(bench, "WORLD_SIZES", [1, 2])
    monkeypatch.setattr(bench, "_train", train)
    monkeypatch.setattr(bench, "_busbw", lambda ws: {})
    return bench.setup_cache()


def recorded(bench, cache: dict, cls, method: str, strategy: str, ws: int):
    track = cls()
    track.setup(cache, strategy, ws)
    return getattr(track, method)(cache, strategy, ws)


def test_asv_stores_every_configuration_with_its_windows_and_a_flagged_one_widened(bench, monkeypatch, capfd):
    """Nothing missing: a flagged result (ddp at 2 ranks, superlinear) is stored too. A time figure's samples
    are its five windows (their median the result's figure); a flagged one's carry the +-50% ends as well, and
    its reason goes to the benchmark's stderr (asv's log); device memory is one figure either way."""
    cache = _grid(bench, monkeypatch)
    assert cache["train"]["ddp/2"]["metrics"]["scaling_efficiency"] == pytest.approx(4.035)
    assert cache["train"]["ddp/2"]["warnings"] and not cache["train"]["ddp/1"]["warnings"]
    for cls, method, m in tracks(bench):
        if m.source == "busbw":
            continue
        for ws, flagged in ((1, False), (2, True)):
            got = recorded(bench, cache, cls, method, "ddp", ws)
            value = m.asv_value(cache["train"][f"ddp/{ws}"]["metrics"][m.name])
            if not bench._per_window(m):  # a memory peak, the device-time sample: one figure a run
                assert got == value
                continue
            xs = got["samples"]
            assert got["number"] == 1 and len(xs) == 5 + 2 * flagged, (method, ws, xs)
            assert statistics.median(xs) == pytest.approx(value)
            if flagged:
                assert min(xs) == pytest.approx(0.5 * value) and max(xs) == pytest.approx(1.5 * value)
                assert "asv: flagged:" in capfd.readouterr().err
            else:
                assert max(xs) / min(xs) == pytest.approx(1.02 / 0.98)
    assert recorded(bench, cache, bench.Plausibility, "track_warnings", "ddp", 2) == 1
    assert recorded(bench, cache, bench.Plausibility, "track_warnings", "ddp", 1) == 0
    assert "superlinear" in capfd.readouterr().err


def _asv_saves(tmp_path, benchmark: dict, output) -> dict:
    """asv's own runner and results code on what a track returned: the runner's parse of the result file
    (asv.runner._run_benchmark_single_param, with a spawner that writes `output` as the benchmark process
    would), Results.add_result, and the results JSON it saves; the row of that benchmark, by column."""
    results, runner = need("asv.results"), need("asv.runner")

    class Spawner:
        def run(self, name, params_str, profile_path, result_file_name, timeout, cwd):
            Path(result_file_name).write_text(json.dumps(output))
            return "", 0

    res = runner._run_benchmark_single_param(
        benchmark, Spawner(), None, profile=False, extra_params={}, cwd=None
    )
    r = results.Results({"machine": "cpu"}, {}, "0" * 40, 0, "3.11", "same", {})
    r.add_result(benchmark, res, record_samples=True)
    r.save(str(tmp_path))
    saved = json.loads(next(tmp_path.rglob("*.json")).read_text())
    return dict(zip(saved["result_columns"], saved["results"][benchmark["name"]], strict=False))


@pytest.mark.parametrize("flagged", [False, True])
def test_asv_computes_its_statistics_over_the_windows(bench, monkeypatch, tmp_path, flagged):
    """What asv stores of a step-time track: its own statistics (99% interval, quartiles, repeat) over the
    windows, a flagged run's interval spanning +-50%; an unflagged one's lies within its windows."""
    cache = _grid(bench, monkeypatch)
    ws = 2 if flagged else 1
    out = recorded(bench, cache, bench.StepTime, "track_step_time", "ddp", ws)
    bm = {"name": "bench_training.StepTime.track_step_time", "params": [], "timeout": 60, "version": "1"}
    row = _asv_saves(tmp_path, bm, out)
    st = cache["train"][f"ddp/{ws}"]["metrics"]["step_time_s"]
    assert row["result"] == [pytest.approx(st)]
    assert row["stats_repeat"] == [5 + 2 * flagged] and row["samples"] == [out["samples"]]
    lo, hi = row["stats_ci_99_a"][0], row["stats_ci_99_b"][0]
    assert row["stats_q_25"][0] < st < row["stats_q_75"][0]
    if flagged:
        assert lo == pytest.approx(0.5 * st, rel=1e-3) and hi == pytest.approx(1.5 * st, rel=1e-3)
    else:
        assert 0.97 * st < lo < st < hi < 1.03 * st


def test_a_plain_number_gets_no_statistics_from_asv(tmp_path):
    """The bite of the test above: the track before per-window samples (one number) stores no interval."""
    bm = {"name": "bench_training.StepTime.track_step_time", "params": [], "timeout": 60, "version": "1"}
    row = _asv_saves(tmp_path, bm, 1.25)
    assert row["result"] == [1.25] and "stats_ci_99_a" not in row


def test_the_dashboard_names_each_benchmark_with_its_unit_and_the_runs_that_have_data(bench):
    from distbench.measure.memory import memory_stats
    from distbench.measure.mfu import peak_flops
    from distbench.runtime.context import RankContext

    cpu = RankContext(0, 1, 0, torch.device("cpu"), "gloo")
    not_on_cpu = {k for k, v in memory_stats(cpu).items() if v is None}
    not_on_cpu |= {"mfu"} if peak_flops("cpu", "fp32") is None else set()
    for cls, method, m in tracks(bench):
        fn = getattr(cls, method)
        assert fn.pretty_name and fn.pretty_name != method and fn.unit == m.asv.unit, method
        assert fn.pretty_source == fn.__doc__ and m.description.rstrip(".") in fn.pretty_source
        if m.name in not_on_cpu:  # empty on a CPU machine: the dashboard's name says why
            assert fn.pretty_name.endswith("(GPU runs only)"), fn.pretty_name


def test_asv_links_its_commits():
    conf = json.loads((ROOT / "asv.conf.json").read_text())
    assert conf["project_url"].startswith("https://github.com/") and conf["project_url"].endswith("/")
    assert conf["show_commit_url"] == conf["project_url"] + "commit/"


def test_the_dashboard_page_lists_what_the_registry_names():
    """docs/asv-history.md's table of benchmarks, units and which runs have data is the registry's."""
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in (ROOT / "docs" / "asv-history.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| Benchmark")
    ]
    assert sorted(rows) == sorted(
        [m.asv.title, m.asv.unit, m.asv.where or "every run"] for m in METRICS.values() if m.asv is not None
    )


@pytest.mark.slow  # the CPU grid of ddp at 1 and 2 ranks in asv's own processes: 1-3 minutes on 2 cores
def test_an_asv_run_on_cpu_stores_the_statistics(tmp_path):
    """A real `asv run --python=same --quick` of the step-time and plausibility tracks (ddp on gloo): every
    configuration is in the results JSON with asv's statistics over its windows (repeat 5, or 7 where flagged)."""
    import os
    import subprocess

    conf = json.loads((ROOT / "asv.conf.json").read_text())
    conf.update(
        repo=str(ROOT),
        benchmark_dir=str(ROOT / "benchmarks"),
        results_dir=str(tmp_path / "results"),
        html_dir=str(tmp_path / "html"),
        env_dir=str(tmp_path / "env"),
    )
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "DISTBENCH_ASV_STRATEGIES": "ddp",
        "ASV_PYTHONPATH": str(ROOT / "src"),
    }
    asv = [sys.executable, "-m", "asv", "--config", str(tmp_path / "asv.conf.json")]
    subprocess.run([*asv, "machine", "--yes", "--machine", "cpu"], env=env, cwd=tmp_path, check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    run = subprocess.run(
        [*asv, "run", "--python=same", "--quick", "--machine", "cpu", "--show-stderr"]
        + ["--set-commit-hash", commit, "-b", "StepTime|Plausibility"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saved = json.loads(next((tmp_path / "results" / "cpu").glob(f"{commit[:8]}-*.json")).read_text())
    row = dict(
        zip(
            saved["result_columns"], saved["results"]["bench_training.StepTime.track_step_time"], strict=False
        )
    )
    flags = saved["results"]["bench_training.Plausibility.track_warnings"][0]
    assert len(row["result"]) == 2 and all(v is not None for v in row["result"]), row  # ws 1 and 2: none n/a
    for i, value in enumerate(row["result"]):
        assert row["stats_repeat"][i] == (7 if flags[i] else 5)
        assert row["stats_ci_99_a"][i] <= value <= row["stats_ci_99_b"][i]
        assert row["stats_q_25"][i] <= value <= row["stats_q_75"][i]
    if any(flags):
        assert "asv: flagged:" in run.stdout + run.stderr
