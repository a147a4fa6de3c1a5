"""Speedup and scaling efficiency follow one rule wherever they are stated: the result JSON that `distbench
run` writes, the report's table and the plausibility checks (the committed seed 004 report once said 1.14x
where its JSON said 1.0, because three places had three rules)."""

from __future__ import annotations

import re

import pytest

from distbench.plausibility import check
from distbench.report.markdown import report_markdown
from distbench.results import make_result
from distbench.scaling import annotate, baseline_runs

WORKLOAD = {"model": "gpt2-large", "precision": "bf16", "seq_len": 1024, "global_batch": 32, "micro_batch": 8}


def run(strategy: str, ws: int, tps: float, **workload) -> dict:
    st = 32 * 1024 / tps
    return make_result(
        {"strategy": strategy, "world_size": ws, **WORKLOAD, **workload},
        metrics={"tokens_per_s": tps, "step_time_s": st},
        step_time_s={"median": st, "p10": st, "p90": st, "n": 10},
    )


def matrix() -> list[dict]:
    return [
        run("single", 1, 1000),
        run("single", 1, 1020),
        run("single", 1, 980),  # median 1000
        run("fsdp_full", 1, 1143),
        run("fsdp_full", 2, 1900),
        run("ddp", 2, 1800),
        run("zero3", 1, 700),
        run("zero3", 2, 1300, micro_batch=4),
    ]  # another workload: no single to use


def test_the_baseline_is_single_when_it_ran_else_the_strategy_itself():
    results = matrix()
    annotate(results)
    m = {
        (r["config"]["strategy"], r["config"]["world_size"], r["config"]["micro_batch"]): r["metrics"]
        for r in results
    }
    assert m[("fsdp_full", 1, 8)]["speedup"] == pytest.approx(1.143)  # the wrapper's cost on one GPU
    assert m[("fsdp_full", 2, 8)]["speedup"] == pytest.approx(1.9)
    assert m[("fsdp_full", 2, 8)]["scaling_efficiency"] == pytest.approx(0.95)
    assert m[("ddp", 2, 8)]["scaling_efficiency"] == pytest.approx(0.9)
    singles = sorted(r["metrics"]["speedup"] for r in results if r["config"]["strategy"] == "single")
    assert singles == pytest.approx([0.98, 1.0, 1.02])  # each repeat against their median, 1000
    assert "speedup" not in m[("zero3", 2, 4)]  # nothing at one GPU of its workload
    only_own = [run("zero3", 1, 700), run("zero3", 2, 1260)]
    annotate(only_own)
    assert only_own[1]["metrics"]["speedup"] == pytest.approx(1.8)  # no single: its own 1-GPU run
    assert [r["config"]["strategy"] for r in baseline_runs(only_own, only_own[1])] == ["zero3"]


def test_json_report_and_plausibility_state_the_same_speedup():
    results = matrix()
    annotate(results)
    md = report_markdown(results, {})
    for r in results:
        c, m = r["config"], r["metrics"]
        if "speedup" not in m or c["micro_batch"] != 8 or c["strategy"] == "single":
            continue
        row = next(
            line for line in md.splitlines() if re.match(rf"\| {c['strategy']} \| {c['world_size']} \|", line)
        )
        assert f"{m['speedup']:.2f}x" in row, (row, m["speedup"])
    superlinear = [run("single", 1, 100), run("ddp", 1, 300), run("ddp", 2, 1000)]
    annotate(superlinear)
    (warning,) = check(superlinear)[superlinear[2]["id"]]
    assert f"{superlinear[2]['metrics']['speedup']:.2f}x the tokens/s of single" in warning
