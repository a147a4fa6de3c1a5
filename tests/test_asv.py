"""The asv layer stores what `distbench run` would show as results, and its dashboard says what it shows:
names, units, which runs have data, and links to the commits."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from distbench.metrics import METRICS
from distbench.results import make_result

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


def test_asv_stores_no_figure_distbench_run_would_flag(bench, monkeypatch):
    """The grid's 1-rank runs cold, ddp at 2 ranks 8x faster (the 405% efficiency asv stored): its step time,
    MFU and scaling are not stored; its memory is, and so is every figure of an unflagged run."""
    tps = {("single", 1): 100.0, ("ddp", 1): 95.0, ("ddp", 2): 807.0}

    def train(strategy: str, ws: int) -> dict:
        if (strategy, ws) not in tps:
            return {"skip": "single runs on 1 rank"}
        st = 4 * 32 / tps[strategy, ws]
        metrics = {k: 0.5 for k in METRICS if METRICS[k].source == "bench"}
        return make_result(
            {"strategy": strategy, "world_size": ws, **WORKLOAD},
            metrics={**metrics, "tokens_per_s": tps[strategy, ws], "step_time_s": st},
            step_time_s={"median": st, "p10": st * 0.99, "p90": st * 1.01, "std": 0.0, "n": 5},
        )

    monkeypatch.setattr(bench, "STRATEGIES", ["single", "ddp"])
    monkeypatch.setattr(bench, "WORLD_SIZES", [1, 2])
    monkeypatch.setattr(bench, "_train", train)
    monkeypatch.setattr(bench, "_busbw", lambda ws: {})
    cache = bench.setup_cache()
    assert cache["train"]["ddp/2"]["metrics"]["scaling_efficiency"] == pytest.approx(4.035)
    for cls, _, m in tracks(bench):
        if m.source == "busbw":
            continue
        cls().setup(cache, "ddp", 1)  # nothing flagged: stored
        if m.unit == "bytes":  # device memory: the checks judge the clock, not memory
            cls().setup(cache, "ddp", 2)
        else:
            with pytest.raises(NotImplementedError, match="implausible, not a result: superlinear"):
                cls().setup(cache, "ddp", 2)


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
