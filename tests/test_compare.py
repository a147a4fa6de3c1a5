"""The compare gate flags a real 3% slowdown, passes identical reruns, reads metric directions right, and says
UNDECIDED, never PASS, when its runs cannot rule out a regression."""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console

from distbench.cli import main
from distbench.compare import (
    EXIT_INSUFFICIENT,
    EXIT_OK,
    EXIT_REGRESSION,
    IMPROVEMENT,
    INSUFFICIENT,
    REGRESSION,
    UNCHANGED,
    UNDECIDED,
    compare,
)
from distbench.errors import ConfigError
from distbench.results import make_result, save_result

CFG = {
    "strategy": "fsdp_grad",
    "world_size": 2,
    "model": "gpt2-large",
    "precision": "bf16",
    "seq_len": 1024,
    "global_batch": 32,
    "micro_batch": 8,
    "compile": False,
}
ENV = {"gpu_model": "NVIDIA H200", "gpu_count": 2}
TOKENS_PER_STEP = 32 * 1024
MEM = 8 * 1024**3


def runs(
    rng: np.random.Generator,
    n: int,
    step_s: float = 0.5,
    cv: float = 0.004,
    mem: float = MEM,
    trace: dict | None = None,
    cfg: dict | None = None,
    **extra,
) -> list[dict]:
    """`n` separate runs: step time with `cv` run-to-run noise, throughput derived, memory deterministic."""
    out = []
    for st in rng.normal(step_s, cv * step_s, n):
        metrics = {
            "step_time_s": st,
            "tokens_per_s": TOKENS_PER_STEP / st,
            "mfu": 0.2 / st,
            "mem_allocated_peak_bytes": mem,
            "mem_reserved_peak_bytes": mem * 1.1,
        }
        out.append(
            make_result(
                cfg or CFG,
                metrics=metrics,
                env=ENV,
                nvml={"throttled": False},
                step_time_s={"median": st, "p10": st * 0.99, "p90": st * 1.01, "n": 20},
                trace=trace,
                **extra,
            )
        )
    return out


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


def verdicts(report) -> dict[str, str]:
    return {r.metric: r.verdict for r in report.rows}


@pytest.mark.parametrize("cv", [0.003, 0.005])
def test_injected_3pct_slowdown_is_a_regression(rng, cv):
    report = compare(runs(rng, 6, cv=cv), runs(rng, 6, step_s=0.5 * 1.03, cv=cv))
    v = verdicts(report)
    assert v["step_time_s"] == REGRESSION  # time went up
    assert v["tokens_per_s"] == REGRESSION  # throughput went down
    assert v["mfu"] == REGRESSION
    assert v["mem_allocated_peak_bytes"] == UNCHANGED
    assert report.exit_code == EXIT_REGRESSION
    row = next(r for r in report.rows if r.metric == "step_time_s")
    assert 0.02 < row.change < 0.04 and row.effect.p_value < 0.01 and row.effect.low > 0


def test_identical_reruns_are_not_flagged():
    # many seeds: identical distributions must pass every time, not just for one lucky draw
    for seed in range(50):
        rng = np.random.default_rng(seed)
        report = compare(runs(rng, 6, cv=0.005), runs(rng, 6, cv=0.005))
        assert report.exit_code == EXIT_OK, report.to_markdown()
        assert set(verdicts(report).values()) == {UNCHANGED}


def test_faster_head_is_an_improvement_and_passes(rng):
    report = compare(runs(rng, 8), runs(rng, 8, step_s=0.5 * 0.95))
    assert verdicts(report)["tokens_per_s"] == IMPROVEMENT
    assert verdicts(report)["step_time_s"] == IMPROVEMENT
    assert {r.metric for r in report.improvements} == {"tokens_per_s", "step_time_s", "mfu"}
    assert report.exit_code == EXIT_OK


def test_memory_increase_is_a_regression_and_decrease_an_improvement(rng):
    up = compare(runs(rng, 6), runs(rng, 6, mem=MEM * 1.05))
    assert verdicts(up)["mem_allocated_peak_bytes"] == REGRESSION
    assert verdicts(up)["tokens_per_s"] == UNCHANGED
    assert up.exit_code == EXIT_REGRESSION
    down = compare(runs(rng, 6), runs(rng, 6, mem=MEM * 0.9))
    assert verdicts(down)["mem_reserved_peak_bytes"] == IMPROVEMENT
    assert down.exit_code == EXIT_OK


def test_small_significant_drift_below_noise_threshold_is_unchanged(rng):
    # 0.5% slower with 0.05% noise: statistically clear, practically irrelevant (below the 1% floor)
    report = compare(runs(rng, 6, cv=0.0005), runs(rng, 6, step_s=0.5 * 1.005, cv=0.0005))
    row = next(r for r in report.rows if r.metric == "step_time_s")
    assert row.effect.p_value < 0.01 and row.effect.low > 0 and row.verdict == UNCHANGED


def test_noisy_runs_are_undecided_and_more_runs_decide(rng):
    # 8%-noisy runs (a CPU runner): 6 identical runs a side cannot rule out a 2% regression, so the gate says
    # UNDECIDED instead of PASS (a CPU result set printed "PASS" with thresholds of +-155% before); a 16%
    # slowdown is found with 30 a side, where the detectable effect has shrunk.
    same = compare(runs(rng, 6, cv=0.08), runs(rng, 6, cv=0.08))
    row = next(r for r in same.rows if r.metric == "step_time_s")
    assert row.verdict == UNDECIDED and row.effect.detectable > 0.1 and same.exit_code == EXIT_INSUFFICIENT
    assert same.summary().startswith("UNDECIDED")
    few = compare(runs(rng, 6, cv=0.08), runs(rng, 6, step_s=0.58, cv=0.08))
    many = compare(runs(rng, 30, cv=0.08), runs(rng, 30, step_s=0.58, cv=0.08))
    few_row, many_row = (next(r for r in rep.rows if r.metric == "step_time_s") for rep in (few, many))
    assert many_row.effect.detectable < few_row.effect.detectable / 2
    assert many_row.verdict == REGRESSION and many.exit_code == EXIT_REGRESSION


def test_a_metric_and_its_reciprocal_get_the_same_verdict():
    # On 4x H200 a slowdown read +42.2% in step time and -29.8% in tokens/s on ~10%-noisy runs: a linear
    # threshold of about 30% flagged the time and passed the throughput. The gate decides on log ratios.
    for seed in range(40):
        rng = np.random.default_rng(seed)
        report = compare(runs(rng, 6, cv=0.1), runs(rng, 6, step_s=0.5 * 1.42, cv=0.1))
        v = verdicts(report)
        assert v["step_time_s"] == v["tokens_per_s"] == v["mfu"], (seed, report.to_markdown())


def test_insufficient_runs_are_reported_and_do_not_pass(rng):
    report = compare(runs(rng, 3), runs(rng, 3, step_s=0.6))
    assert {r.verdict for r in report.rows} == {INSUFFICIENT}
    assert report.exit_code == EXIT_INSUFFICIENT
    assert "need 6 runs per side, have 3 base / 3 head" in report.to_markdown()
    # --allow-insufficient never makes a pass out of nothing decided
    assert compare(runs(rng, 3), runs(rng, 3), allow_insufficient=True).exit_code == EXIT_INSUFFICIENT
    other = dict(CFG, world_size=4)
    mixed = compare(
        runs(rng, 6) + runs(rng, 3, cfg=other),
        runs(rng, 6) + runs(rng, 3, cfg=other),
        allow_insufficient=True,
    )
    assert mixed.insufficient and mixed.exit_code == EXIT_OK


def test_config_on_one_side_only_is_insufficient(rng):
    other = dict(CFG, world_size=4)
    report = compare(runs(rng, 6), runs(rng, 6) + runs(rng, 6, cfg=other))
    new = [r for r in report.rows if "ws4" in r.label]
    assert new and all(r.verdict == INSUFFICIENT and not r.base for r in new)
    assert report.exit_code == EXIT_INSUFFICIENT


def test_throttled_runs_are_excluded_and_counted(rng):
    head = runs(rng, 6, step_s=0.5 * 1.03)
    for r in head[:2]:
        r["nvml"]["throttled"] = True
    report = compare(runs(rng, 6), head)
    assert [e.reason for e in report.excluded] == ["throttled", "throttled"]
    row = next(r for r in report.rows if r.metric == "step_time_s")
    assert len(row.head) == 4 and row.verdict == INSUFFICIENT  # 6 - 2 throttled < min_runs
    assert "2 throttled" in report.summary()
    # the throttled runs' numbers never entered the comparison even when enough remain
    slow = runs(rng, 2, step_s=5.0)
    for r in slow:
        r["nvml"]["throttled"] = True
    report = compare(runs(rng, 6), runs(rng, 6) + slow)
    assert report.exit_code == EXIT_OK and len(report.excluded) == 2


def test_failed_runs_are_excluded_and_reported(rng):
    oom = make_result(CFG, status="oom", error="CUDA out of memory", env=ENV)
    report = compare(runs(rng, 6), runs(rng, 6) + [oom])
    assert [(e.side, e.reason) for e in report.excluded] == [("head", "status oom: CUDA out of memory")]
    assert report.exit_code == EXIT_OK
    assert "CUDA out of memory" in report.to_markdown()


def test_regression_is_attributed_to_the_trace_part_that_grew(rng):
    base_trace = {"compute_pct": 97.0, "non_compute_pct": 1.5, "idle_pct": 1.5, "compute_ms": 1, "idle_ms": 1}
    # head: same compute time per step, the extra 3% of step time is exposed communication
    head_trace = {
        "compute_pct": 97.0 / 1.03,
        "non_compute_pct": 100 - 97.0 / 1.03 - 1.5 / 1.03,
        "idle_pct": 1.5 / 1.03,
    }
    report = compare(runs(rng, 6, trace=base_trace), runs(rng, 6, step_s=0.515, trace=head_trace))
    row = next(r for r in report.rows if r.metric == "step_time_s")
    assert row.verdict == REGRESSION
    top = row.attribution[0]
    assert top.part == "non_compute" and 12 < top.delta_ms < 18  # ~15 ms of the 0.5 s step
    assert abs(next(a for a in row.attribution if a.part == "compute").delta_ms) < 3
    assert "non-compute" in report.to_markdown()


def test_no_attribution_without_traces_on_both_sides(rng):
    report = compare(
        runs(rng, 6, trace={"compute_pct": 97, "non_compute_pct": 2, "idle_pct": 1}),
        runs(rng, 6, step_s=0.515),
    )
    assert all(not r.attribution for r in report.regressions)


def test_renders_markdown_and_rich(rng):
    report = compare(runs(rng, 6), runs(rng, 6, step_s=0.515))
    md = report.to_markdown()
    assert md.startswith("## distbench compare: FAIL")
    assert "| fsdp_grad ws2 gpt2-large bf16 s1024 gb32 mb8 | step_time_s |" in md
    console = Console(record=True, width=200)
    console.print(report)
    assert "regression" in console.export_text()


def test_unknown_metric_is_a_config_error(rng):
    with pytest.raises(ConfigError, match="known metrics"):
        compare(runs(rng, 6), runs(rng, 6), metrics=["tokens_per_sec"])


def test_nothing_to_compare_does_not_pass(rng):
    assert compare([], []).exit_code == EXIT_INSUFFICIENT
    # an empty or failed head side, even when told to allow missing runs
    empty = compare(runs(rng, 6), [], allow_insufficient=True)
    assert empty.exit_code == EXIT_INSUFFICIENT and "head side holds no usable result" in empty.to_markdown()
    failed = [make_result(CFG, status="error", error="boom", env=ENV) for _ in range(6)]
    assert compare(runs(rng, 6), failed, allow_insufficient=True).exit_code == EXIT_INSUFFICIENT


@pytest.mark.parametrize(
    "kw", [{"alpha": 5}, {"alpha": 0}, {"min_runs": 2}, {"min_effect": 0.05, "threshold": 0.02}]
)
def test_settings_under_which_the_gate_cannot_work_are_refused(rng, kw):
    with pytest.raises(ConfigError):
        compare(runs(rng, 6), runs(rng, 6), **kw)


def test_machine_mismatch_is_noted(rng):
    head = runs(rng, 6)
    for r in head:
        r["env"] = {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 2}
    assert "not comparable across machines" in compare(runs(rng, 6), head).to_markdown()


def save_all(results: list[dict], out) -> None:
    for i, r in enumerate(results):
        r["id"] += f"-{i}"  # ids have one-second resolution
        save_result(r, out)


def test_cli_exit_codes(rng, tmp_path, monkeypatch, capsys):
    save_all(runs(rng, 6), tmp_path / "base")
    save_all(runs(rng, 6, step_s=0.515), tmp_path / "slow")
    save_all(runs(rng, 6), tmp_path / "same")
    save_all(runs(rng, 2), tmp_path / "few")
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert (
        main(
            [
                "compare",
                str(tmp_path / "base"),
                str(tmp_path / "slow"),
                "--github-summary",
                "--markdown",
                str(tmp_path / "cmp.md"),
            ]
        )
        == EXIT_REGRESSION
    )
    assert "FAIL: significant regression" in summary.read_text()
    assert (tmp_path / "cmp.md").read_text() == summary.read_text()
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "same")]) == EXIT_OK
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "few")]) == EXIT_INSUFFICIENT
    assert (
        main(["compare", str(tmp_path / "base"), str(tmp_path / "few"), "--allow-insufficient"])
        == EXIT_INSUFFICIENT
    )  # nothing decided: never a pass
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "same"), "--alpha", "5"]) == 2
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "missing")]) == 2
    assert "no results at" in capsys.readouterr().err


def _run(
    strategy: str, mfu: float, mem: float, *, step: float = 0.5, trace: dict | None = None, **kw
) -> dict:
    cfg = {**CFG, "strategy": strategy}
    metrics = {"step_time_s": step, "mfu": mfu, "mem_allocated_peak_bytes": mem}
    r = make_result(
        cfg, metrics=metrics, env=kw.pop("env", ENV), nvml={"throttled": False}, trace=trace, **kw
    )
    return r


def _report_of_every_kind():
    """Three configurations, compared on peak memory and MFU (6 runs a side unless said):
    ddp: memory equal (unchanged), MFU 0.40 -> 0.42 (improvement);
    fsdp_full: one head run (both rows insufficient);
    zero3: memory within +-4% on both sides (undecided), MFU 0.40 -> 0.38 (regression), its step time
    0.5 -> 0.526 s split by each run's trace (60/30/10 -> 0.62/0.28 with no idle time: the parts are
    shares of their sum, whatever their scale: 362.4/163.6/0 ms; a base run without a trace and one whose
    trace is all zeros count for nothing);
    and runs left out: a base run that failed (with its error), one that timed out (without; nor an id), a
    throttled head run with its id and one without; one base run on a one-GPU machine, one head run on an H100."""
    base_trace, head_trace = (
        {"compute_pct": 60, "non_compute_pct": 30, "idle_pct": 10},
        {"compute_pct": 0.62, "non_compute_pct": 0.28},
    )
    zeros = {"compute_pct": 0, "non_compute_pct": 0, "idle_pct": 0}
    noisy_base, noisy_head = [100, 104, 96, 102, 98, 100], [101, 105, 95, 103, 97, 103]
    base = [_run("ddp", 0.40, 100.0) for _ in range(6)] + [_run("fsdp_full", 0.40, 100.0) for _ in range(6)]
    base += [
        _run("zero3", 0.40, m, trace=t)
        for m, t in zip(noisy_base, [None, zeros] + [base_trace] * 4, strict=True)
    ]
    head = [_run("ddp", 0.42, 100.0) for _ in range(6)] + [_run("fsdp_full", 0.40, 100.0)]
    head += [_run("zero3", 0.38, m, step=0.526, trace=head_trace) for m in noisy_head]
    head[0]["env"] = {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 2}
    base[0]["env"] = {"gpu_model": "NVIDIA H200", "gpu_count": 1}
    failed = _run("ddp", 0.4, 100.0, status="error", error="CUDA error: out of memory")
    failed["id"] = "base-failed"
    timed_out = _run("ddp", 0.4, 100.0)
    timed_out["status"] = "timeout"
    del timed_out["id"]
    throttled = _run("zero3", 0.38, 100.0, step=0.526)
    throttled["nvml"] = {"throttled": True}
    named = {**throttled, "id": "head-throttled"}
    del throttled["id"]
    return compare(
        base + [failed, timed_out], head + [named, throttled], metrics=["mem_allocated_peak_bytes", "mfu"]
    )


def test_the_report_of_every_kind_of_row_reads_as_written():
    """The markdown report, in full: the summary counts each verdict and the excluded runs, the criteria
    name the per-row level (0.05 over the 4 testable rows: 98.750%), the note names both machines, rows go
    regression, undecided, insufficient, improvement, unchanged (then by configuration and metric), with
    the medians and run counts, the interval, the detectable effect and p, or dashes and why; the
    regression of a time is attributed to the trace's parts (ms per step, largest growth first), and each
    excluded run is listed with its side, configuration, id ("?" where it has none) and reason."""
    from scipy.stats import mannwhitneyu, t

    report = _report_of_every_kind()
    b, h = np.log([100, 104, 96, 102, 98, 100]), np.log([101, 105, 95, 103, 97, 103])
    vb, vh = b.var(ddof=1) / 6, h.var(ddof=1) / 6
    df = (vb + vh) ** 2 / (vb**2 / 5 + vh**2 / 5)
    d, se = h.mean() - b.mean(), np.sqrt(vb + vh)
    half = t.ppf(1 - 0.0125 / 2, df) * se
    reach = (t.ppf(1 - 0.0125 / 2, int(df)) + t.ppf(0.8, int(df))) * se
    p = mannwhitneyu(h, b).pvalue
    undecided = (
        f"{np.expm1(d):+.2%} [{np.expm1(d - half):+.2%}, {np.expm1(d + half):+.2%}] | ±{np.expm1(reach):.2%} | "
        f"{p:.3g}"
    )
    zero3, fsdp, ddp = (f"{s} ws2 gpt2-large bf16 s1024 gb32 mb8" for s in ("zero3", "fsdp_full", "ddp"))
    expected = f"""\
## distbench compare: FAIL: significant regression (exit 1); 1 regression, 1 improvement, 1 unchanged, 1 undecided, 2 insufficient-data, 4 runs excluded (2 throttled)

Welch's t interval on log values at 98.750% (family-wise alpha 0.05 over 6 rows), Mann-Whitney U p beside it; regression when the interval excludes 0 and the change is at least 1.0%; unchanged when a 2.0% regression is ruled out; at least 6 runs per side.

> base ran on 1x NVIDIA H200, 2x NVIDIA H200, head on 2x NVIDIA H100 80GB HBM3, 2x NVIDIA H200: throughput and memory are not comparable across machines

| Config | Metric | Base median (n) | Head median (n) | Change [CI] | Detectable | p | Verdict |
|---|---|---|---|---|---|---|---|
| {zero3} | mfu | 40.0% (6) | 38.0% (6) | -5.00% [-5.00%, -5.00%] | ±0.00% | 0 | regression |
| {zero3} | mem_allocated_peak_bytes | 0.00 GiB (6) | 0.00 GiB (6) | {undecided} | undecided |
| {fsdp} | mem_allocated_peak_bytes | 0.00 GiB (6) | 0.00 GiB (1) | — | — | — | insufficient-data (need 6 runs per side, have 6 base / 1 head) |
| {fsdp} | mfu | 40.0% (6) | 40.0% (1) | — | — | — | insufficient-data (need 6 runs per side, have 6 base / 1 head) |
| {ddp} | mfu | 40.0% (6) | 42.0% (6) | +5.00% [+5.00%, +5.00%] | ±0.00% | 0 | improvement |
| {ddp} | mem_allocated_peak_bytes | 0.00 GiB (6) | 0.00 GiB (6) | +0.00% [-0.00%, +0.00%] | ±0.00% | 1 | unchanged |

### Where the time went (trace breakdown, per step, largest growth first)

- **{zero3} mfu**: step time +26.0 ms/step: compute 300.0 → 362.4 ms (+62.4), non-compute 150.0 → 163.6 ms (+13.6), idle 50.0 → 0.0 ms (-50.0)

### Excluded runs

| Side | Config | Run | Reason |
|---|---|---|---|
| base | {ddp} | base-failed | status error: CUDA error: out of memory |
| base | {ddp} | ? | status timeout |
| head | {zero3} | head-throttled | throttled |
| head | {zero3} | ? | throttled |
"""
    assert report.to_markdown() == expected


def test_the_terminal_report_holds_the_same_rows_styled_by_verdict():
    """The rich rendering: one table titled "distbench compare" with the criteria as its caption, the
    markdown's columns and cells, each row styled by its verdict (regression bold red, undecided and
    insufficient yellow, improvement green, unchanged plain); then the note (yellow), the attribution (red),
    each excluded run (dim), and the summary in its status's style (a regression: bold red)."""
    report = _report_of_every_kind()
    md = report.to_markdown().splitlines()
    start = md.index(
        "| Config | Metric | Base median (n) | Head median (n) | Change [CI] | Detectable | p | Verdict |"
    )
    md_rows = [line[2:-2].split(" | ") for line in md[start + 2 : start + 8]]
    table, *texts = report.__rich__().renderables
    assert (table.title, table.caption) == ("distbench compare", md[2])
    assert [c.header for c in table.columns] == md[start][2:-2].split(" | ")
    assert [list(row) for row in zip(*(c._cells for c in table.columns), strict=True)] == md_rows
    assert [r.style for r in table.rows] == ["bold red", "yellow", "yellow", "yellow", "green", ""]
    zero3, ddp = (f"{s} ws2 gpt2-large bf16 s1024 gb32 mb8" for s in ("zero3", "ddp"))
    attribution = md[
        md.index("### Where the time went (trace breakdown, per step, largest growth first)") + 2
    ]
    assert [(t.plain, t.style) for t in texts] == [
        (f"note: {md[4][2:]}", "yellow"),
        (f"{zero3} mfu: {attribution.split('**: ', 1)[1]}", "red"),
        (f"excluded base run base-failed ({ddp}): status error: CUDA error: out of memory", "dim"),
        (f"excluded base run ? ({ddp}): status timeout", "dim"),
        (f"excluded head run head-throttled ({zero3}): throttled", "dim"),
        (f"excluded head run ? ({zero3}): throttled", "dim"),
        (report.summary(), "bold red"),
    ]


def test_a_passing_and_an_empty_comparison_say_so():
    """Equal sides: PASS, counting the unchanged rows, in bold green; nothing at all to compare: UNDECIDED,
    saying there was nothing, in bold yellow, with a note for each empty side and none about machines."""
    same = [_run("ddp", 0.4, 100.0) for _ in range(6)]
    report = compare(same, same, metrics=["mem_allocated_peak_bytes", "mfu"])
    assert report.summary() == "PASS (exit 0); 2 unchanged"
    assert report.to_markdown().splitlines()[3:5] == [
        "",
        "| Config | Metric | Base median (n) | Head median (n) | Change [CI] | Detectable | p | Verdict |",
    ]  # no note, no blank line for one
    assert report.__rich__().renderables[-1].style == "bold green"
    empty = compare([], [])
    assert empty.summary() == (
        "UNDECIDED: could not rule out a regression (too few usable runs, or too noisy) (exit 3); nothing to compare"
    )
    assert empty.__rich__().renderables[-1].style == "bold yellow"
    one_side = compare(same, [])
    assert one_side.notes == ["the head side holds no usable result: nothing can pass"]


def test_rows_follow_the_configurations_names_and_only_regressions_are_attributed(rng):
    """ddp at world size 16 is named before world size 2 ("ws16" < "ws2"), whatever the order of the
    configuration's fields; an improvement in a time (MFU), traces and all, has no attribution."""

    def at(ws: int, mfu: float) -> list[dict]:
        trace = {"compute_pct": 60, "non_compute_pct": 30, "idle_pct": 10}
        return [_run("ddp", mfu, 100.0, trace=trace) | {"config": {**CFG, "strategy": "ddp", "world_size": ws}}
                for _ in range(6)]  # fmt: skip

    report = compare(at(2, 0.4) + at(16, 0.4), at(2, 0.42) + at(16, 0.42), metrics=["mfu"])
    assert [r.label.split()[1] for r in report.rows] == ["ws16", "ws2"]
    assert [r.verdict for r in report.rows] == [IMPROVEMENT, IMPROVEMENT]
    assert all(r.attribution == [] for r in report.rows)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"min_runs": 2}, "min_runs must be at least 3 for an interval, got 2"),
        ({"alpha": 0.5}, "alpha must be between 0 and 0.5, got 0.5"),
        ({"alpha": 0.6}, "alpha must be between 0 and 0.5, got 0.6"),
        ({"min_effect": 0.0}, "need 0 < min_effect <= threshold < 1, got 0.0 and 0.02"),
        ({"min_effect": 0.5, "threshold": 1.0}, "need 0 < min_effect <= threshold < 1, got 0.5 and 1.0"),
        ({"min_effect": 0.5, "threshold": 1.5}, "need 0 < min_effect <= threshold < 1, got 0.5 and 1.5"),
        ({"metrics": ["tokens_per_sec"]}, "unknown metric(s) ['tokens_per_sec']; known metrics: "),
    ],
)
def test_each_refused_setting_is_named(rng, kw, message):
    """The bounds are strict where the gate cannot work (alpha of a half, a min_effect of 0, a threshold
    of 100%) and each refusal says which setting and what it got."""
    import re

    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        compare(runs(rng, 6), runs(rng, 6), **kw)


def test_the_loosest_settings_the_gate_works_at_are_accepted(rng):
    """Three runs a side, and a min_effect equal to the threshold, are enough for an interval and a rule."""
    report = compare(runs(rng, 3), runs(rng, 3), min_runs=3, min_effect=0.02, threshold=0.02)
    assert report.min_runs == 3 and all(r.effect is not None for r in report.rows)


def test_the_known_metrics_are_listed_comma_separated(rng):
    from distbench.metrics import METRICS

    with pytest.raises(ConfigError) as e:
        compare(runs(rng, 6), runs(rng, 6), metrics=["tokens_per_sec"])
    assert str(e.value).endswith("known metrics: " + ", ".join(METRICS))
