"""Each implausible figure, planted in an otherwise clean synthetic matrix, draws its warning; the clean
matrix draws none."""

from __future__ import annotations

from typing import Any

import pytest

from distbench.plausibility import annotate, check
from distbench.results import make_result

WORKLOAD = {"model": "gpt2-tiny", "precision": "fp32", "seq_len": 64, "global_batch": 4, "micro_batch": 2}
TOKENS = 4 * 64


def run(
    strategy: str,
    ws: int,
    tps: float,
    *,
    spread: float = 0.04,
    created: str = "2026-11-23T06:00:10+00:00",
    std: float = 0.0,
) -> dict[str, Any]:
    """One ok result whose step times have median TOKENS / tps and relative p10-p90 width `spread`."""
    st = TOKENS / tps
    r = make_result(
        {"strategy": strategy, "world_size": ws, **WORKLOAD},
        metrics={"tokens_per_s": tps, "step_time_s": st},
        step_time_s={
            "median": st,
            "p10": st * (1 - spread / 2),
            "p90": st * (1 + spread / 2),
            "std": std * st,
            "n": 8,
        },
    )
    r["created"] = created
    return r


def clean() -> list[dict[str, Any]]:
    """single and ddp on 1 rank (3 repeats each), ddp at 2 ranks with 90% efficiency: nothing to flag."""
    return (
        [run("single", 1, t) for t in (1000, 1010, 990)]
        + [run("ddp", 1, t) for t in (950, 960, 940)]
        + [run("ddp", 2, 1800)]
    )


def flagged(results: list[dict[str, Any]], strategy: str, ws: int) -> list[str]:
    found = check(results)
    return [
        w
        for r in results
        if r["config"]["strategy"] == strategy and r["config"]["world_size"] == ws
        for w in found.get(r["id"], [])
    ]


def test_a_clean_matrix_draws_no_warning():
    results = clean()
    assert check(results) == {}
    annotate(results)
    assert all(r["warnings"] == [] for r in results)


def test_superlinear_scaling_beyond_noise():
    """The issue's CPU run: 1-rank runs 10x slow made ddp at 2 ranks '8.07x, 403.6%'."""
    results = [run("single", 1, 100), run("ddp", 1, 95), run("ddp", 2, 807)]
    (warning,) = flagged(results, "ddp", 2)  # one of a kind: against single on 1 rank, the stated speedup
    assert warning.startswith(
        "superlinear: 8.07x the tokens/s of single on 1 rank (100, median of 1 run(s)) on 2"
    )
    (warning,) = flagged([run("ddp", 1, 95), run("ddp", 2, 807)], "ddp", 2)  # no single: its own 1-rank run
    assert warning.startswith("superlinear: 8.49x the tokens/s of ddp on 1 rank")


def test_superlinear_within_a_wide_spread_is_an_artefact():
    """The CPU default run: zero2 at 2 ranks 5.75x against a 1-rank run with p10-p90 0.081-0.570 s."""
    results = [run("zero2", 1, 754, spread=0.9), run("zero2", 2, 4339, spread=1.3)]
    found = flagged(results, "zero2", 2)
    assert [w.split(":")[0] for w in found] == [
        "step times spread wider than their median",
        "superlinear within noise",
    ]
    assert "5.75x the tokens/s of zero2 on 1 rank" in found[1]


def test_superlinear_within_the_measured_spread_is_not_flagged():
    """2.1x on 2 ranks with +-15% step-time spread on each side: noise, not an impossibility."""
    results = [run("ddp", 1, 1000, spread=0.15), run("ddp", 2, 2100, spread=0.15)]
    assert check(results) == {}


def test_a_speedup_within_noise_supports_nothing():
    results = clean()[:3] + [run("ddp", 2, 1050, spread=0.3)]
    (warning,) = flagged(results, "ddp", 2)
    assert warning.startswith("speedup within noise: 1.05x")


def test_a_reference_slower_than_its_own_repeats():
    results = clean()
    results[1] = run("single", 1, 300)  # one of single's three repeats, far below the other two
    found = check(results)
    (warning,) = found[results[1]["id"]]
    assert warning.startswith("slower than its repeats: 300 tokens/s, 70% below")
    assert "1-rank reference" in warning and "cold start" not in warning
    assert set(found) == {results[1]["id"]}  # the median reference still holds ddp at 2 ranks


def test_a_cold_first_configuration():
    results = clean()
    results[0] = run("single", 1, 400, created="2026-11-23T06:00:00+00:00")  # the first run of the matrix
    (warning,) = check(results)[results[0]["id"]]
    assert "the first run of the set, a cold start" in warning


def test_repeats_within_their_spread_are_not_flagged():
    results = [
        run("ddp", 2, t, created=f"2026-11-23T06:00:0{i}+00:00") for i, t in enumerate((940, 1000, 1080))
    ]
    assert check(results) == {}  # 940 is 10% below 1040, inside the others' 8% range floored at 10%


def test_a_spread_wider_than_the_median():
    results = clean()
    results[6] = run("ddp", 2, 1800, spread=1.5)
    assert any(w.startswith("step times spread wider than their median") for w in flagged(results, "ddp", 2))
    results[6] = run("ddp", 2, 1800, std=1.2)  # a few huge outliers: p10-p90 narrow, std above the median
    assert any(w.startswith("step times spread wider than their median") for w in flagged(results, "ddp", 2))


def with_host(
    r: dict[str, Any], refs: list[list[float]], regime: str = "host-bound", waits: list[float] | None = None
) -> dict[str, Any]:
    """`r` with per-rank reference readings around one window each (`refs[rank]`), the step's regime, and
    its training threads' run-queue wait per rank (seconds over the window)."""
    waits = waits or [0.0] * len(refs)
    r["host"] = {
        "speed": [
            [{"ref_s": ref, "threads": {"main_wait_s": wait, "autograd_wait_s": 0.0}}]
            for ref, wait in zip(refs, waits, strict=True)
        ]
    }
    r["step_time_s"]["steps"] = [r["step_time_s"]["median"]] * 8
    r["regime"] = {"regime": regime, "busy_ratio": 0.2 if regime == "host-bound" else 0.95}
    return r


def host_warnings(r: dict[str, Any]) -> list[str]:
    return [w for w in flagged([*clean()[:6], r], "ddp", 2) if w.startswith("the host ran")]


def test_a_host_that_changed_speed_and_moved_a_host_bound_step():
    # one H200 VM: the reference took 7.0 ms or 10.3 ms depending on the vCPU's state
    moved = with_host(run("ddp", 2, 1800, spread=0.3), [[0.0070, 0.0103], [0.0071, 0.0101]])
    (w,) = host_warnings(moved)
    assert "7.00-10.30 ms (x1.47) on one rank" in w and "spread 30%" in w and "--bind-cpus" in w
    for quiet in (
        with_host(run("ddp", 2, 1800, spread=0.3), [[0.0070, 0.0072], [0.0071, 0.0073]]),  # a steady host
        with_host(run("ddp", 2, 1800, spread=0.3), [[0.0070, 0.0103]], "device-bound"),  # the device paces
        with_host(run("ddp", 2, 1800, spread=0.04), [[0.0070, 0.0103]]),  # the step did not move with it
        with_host(
            run("ddp", 2, 1800, spread=0.3), [[0.0070, 0.0071], [0.0103, 0.0101]]
        ),  # two CPUs, each steady
    ):
        assert host_warnings(quiet) == []


def test_a_run_with_an_interval_gets_the_host_speed_as_its_reason_not_a_flag():
    """Timed in six or more windows, the figure is their median and its interval holds the slow windows: the
    finding is kept as the reason the interval is wide (plausibility.notes), and the row is a measurement."""
    moved = with_host(run("ddp", 2, 1800, spread=0.3), [[0.0070, 0.0103], [0.0071, 0.0101]])
    moved["step_time_s"]["interval"] = [0.13, 0.16]
    results = [*clean()[:6], moved]
    annotate(results)
    assert moved["warnings"] == []
    note, repeat = moved["notes"]
    assert (
        note.startswith("its interval is wide because the host ran at different speeds") and "x1.47" in note
    )
    assert (
        repeat.startswith("its tokens/s may not repeat") and "as the host ran at different speeds" in repeat
    )


def test_the_idle_probes_of_an_h200_draw_no_host_warning_and_its_host_bound_runs_do():
    """Real results (results/): recommend's probes on an idle H200, whose reference moved x1.3-1.5 while their
    step times spread under 6% (the rule before read every one of them as the host's fault), and DDP at
    micro-batch 1, host-bound, whose step times spread 23-75% with a reference moving x1.4-1.8."""
    from pathlib import Path

    from distbench.results import load_results

    root = Path(__file__).resolve().parents[1] / "results"
    probes = load_results([root / "recommend-h200-2026-11-24"])
    assert (
        max(
            max(x for w in r["host"]["speed"][0] for x in w["ref_s"])
            / min(x for w in r["host"]["speed"][0] for x in w["ref_s"])
            for r in probes
        )
        > 1.4
    )
    assert not any("host" in w for ws in check(probes).values() for w in ws)
    host_bound = load_results([root / "gate-host-h200-2026-11-24" / "windows-pinned-3"])
    found = check(host_bound)
    assert len(host_bound) == 12
    assert all(
        any(w.startswith("the host ran at different speeds") for w in found[r["id"]]) for r in host_bound
    )
    assert not any("contended" in w for ws in found.values() for w in ws)  # pinned: threads share a CPU


def test_a_contended_host():
    """A CPU-bound neighbour on the rank's cores: its training threads wait on the run queue."""
    busy = with_host(run("ddp", 2, 1800), [[0.007, 0.007], [0.007, 0.007]], waits=[0.0, 0.4])
    timed = sum(busy["step_time_s"]["steps"])
    (w,) = [w for w in flagged([*clean()[:6], busy], "ddp", 2) if "contended" in w]
    assert w.startswith(
        f"a contended host: the training threads of rank 1 waited 400 ms for a CPU, {0.4 / timed:.0%}"
    )
    idle = with_host(run("ddp", 2, 1800), [[0.007, 0.007]], waits=[0.002 * timed])  # 0.2%: idle H200 runs
    pinned = with_host(run("ddp", 2, 1800), [[0.007, 0.007]], waits=[0.4])
    pinned["env"] = {"env": {"DISTBENCH_BIND_CPUS": "pinned"}}  # main and autograd share one CPU by design
    for r in (idle, pinned):
        assert not [w for w in flagged([*clean()[:6], r], "ddp", 2) if "contended" in w]


def test_a_wrapped_strategy_faster_than_single_on_one_rank():
    """The sibling issue: "fsdp_grad ws1 2.52x, 251.9%" passed unflagged, speedups being judged above 1 rank only."""
    results = [*clean(), run("fsdp_grad", 1, 2520)]
    (w,) = flagged(results, "fsdp_grad", 1)
    assert w.startswith(
        "superlinear: 2.52x the tokens/s of single on 1 rank (1,000, median of 3 run(s)) on 1"
    )
    assert flagged([*clean(), run("fsdp_grad", 1, 1040)], "fsdp_grad", 1) == []  # inside 10%: no flag


def test_no_speedup_against_a_flagged_reference():
    """A 1-rank `single` whose own measurement is flagged gives no speedup; its unflagged repeats do."""
    from distbench.scaling import annotate as scale

    results = [run("single", 1, 1000, spread=1.5), run("ddp", 2, 1800)]
    found = check(results)
    assert found[results[0]["id"]][0].startswith("step times spread wider")
    (w,) = found[results[1]["id"]]
    assert (
        w.startswith("against a flagged reference: every 1-rank run of single") and "step times spread" in w
    )
    annotate(results)
    scale(results)
    assert "speedup" not in results[1]["metrics"]  # the table shows none rather than one from a flagged run
    results = clean()[:3] + [run("single", 1, 400, spread=1.5), run("ddp", 2, 1800)]
    annotate(results)
    scale(results)
    assert results[-1]["warnings"] == [] and results[-1]["metrics"]["speedup"] == pytest.approx(1.8)


def test_failed_runs_and_other_workloads_are_left_alone():
    results = clean()
    failed = make_result({"strategy": "ddp", "world_size": 2, **WORKLOAD}, status="error", error="boom")
    other = run("ddp", 2, 9000)
    other["config"]["seq_len"] = 128  # no 1-rank run of this workload: nothing to scale against
    assert check([*results, failed, other]) == {}


def issue_run() -> list[dict[str, Any]]:
    """The shape of the issue's CPU run: 1-rank runs 10x slow, ddp at 2 ranks 8.07x."""
    return [run("single", 1, 100), run("ddp", 1, 95), run("ddp", 2, 807)]


def test_the_console_table_footnotes_each_warning():
    from rich.console import Console

    from distbench.report.tables import results_table

    results = issue_run()
    annotate(results)
    console = Console(record=True, width=400)
    console.print(results_table(results))
    text = console.export_text()
    assert "ok ! 1" in text  # ddp ws2's row points at its footnote
    assert "Implausible, not results:" in text and "! 1 ddp ws2: superlinear: 8.07x" in text
    console = Console(record=True, width=400)
    console.print(results_table(clean()))
    assert "Implausible" not in console.export_text()


def test_the_report_and_job_summary_list_the_warnings(tmp_path):
    from distbench.report import job_summary_markdown, write_report

    md = write_report(issue_run(), tmp_path).read_text()
    assert "### Implausible figures (warnings, not results)" in md
    assert "- ddp ws2: superlinear: 8.07x the tokens/s of single on 1 rank" in md
    assert "| ddp | 2 | 1 | 807 |" in md and md.count("| **1** |") == 1  # the Warnings column
    assert "- ddp ws2: superlinear" in job_summary_markdown(issue_run())
    assert "Implausible figures (" not in write_report(clean(), tmp_path).read_text()


def test_the_report_command_counts_the_warnings(tmp_path, capsys):
    import argparse

    from distbench.commands import report as report_cmd
    from distbench.results import save_result

    for r in issue_run():
        save_result(r, tmp_path / "results")
    assert (
        report_cmd.run(argparse.Namespace(results=[tmp_path / "results"], out=tmp_path, github_summary=False))
        == 0
    )
    assert "1 plausibility warning(s) on 1 result(s): see 'Implausible figures' in" in capsys.readouterr().out


def test_run_matrix_writes_the_warnings_into_every_result(tmp_path, monkeypatch):
    """The matrix judges its results once all have run and saves them again, warnings included."""
    import distbench.matrix as matrix
    from distbench.matrix import Matrix, run_matrix
    from distbench.results import load_results

    tps = {1: 95.0, 2: 807.0}

    class Pools:
        device_type = "cpu"

        def pool_for(self, ws: int) -> int:
            return ws

    monkeypatch.setattr(
        matrix, "run_benchmark", lambda pool, cfg, **kw: run(cfg.strategy, cfg.world_size, tps[pool])
    )
    run_matrix(Matrix(["ddp"], [1, 2], ["gpt2-tiny"], ["fp32"]), out_dir=tmp_path, pools=Pools())
    saved = {r["config"]["world_size"]: r["warnings"] for r in load_results(tmp_path)}
    assert saved[1] == [] and saved[2][0].startswith("superlinear: 8.49x the tokens/s of ddp on 1 rank")


def side_by_side(r: dict[str, Any], estimate: float, half: float, rounds: int = 6) -> dict[str, Any]:
    """`r` as measured side by side with single at ws1: its tokens/s ratio `estimate` +- `half`."""
    r["side_by_side"] = {
        "mode": "all",
        "rounds": rounds,
        "reference": "single ws1 gpt2-tiny fp32 mb2",
        "vs_reference": {"estimate": estimate, "low": estimate - half, "high": estimate + half, "n": rounds},
    }
    return r


def with_interval(r: dict[str, Any], half: float) -> dict[str, Any]:
    """`r` with a 95% interval of its median window of +-`half` of its step time."""
    st = r["metrics"]["step_time_s"]
    r["step_time_s"]["interval"] = [st * (1 - half), st * (1 + half)]
    return r


def judged(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`results` annotated as run_matrix leaves them: plausibility's flags and notes, then the speedups."""
    from distbench import scaling

    annotate(results)
    scaling.annotate(results)
    return results


def table_text(results: list[dict[str, Any]]) -> str:
    from rich.console import Console

    from distbench.report.tables import results_table

    console = Console(record=True, width=400)
    console.print(results_table(results))
    return " ".join(console.export_text().split())  # a caption wraps at the table's width


def test_a_figure_whose_repeat_would_not_hold_is_footnoted_with_the_reason():
    from distbench.plausibility import SPEEDUP_HOLD, TOKENS_HOLD

    narrow = [
        with_interval(run("single", 1, 1000), 0.01),
        side_by_side(with_interval(run("ddp", 1, 900), 0.01), -0.1, 0.01),
    ]
    judged(narrow)
    assert all(r["notes"] == [] for r in narrow)
    text = table_text(narrow)
    assert "0.90x±1%" in text and "1,000±1%" in text and "Notes on figures" not in text
    wide = [
        with_interval(run("single", 1, 1000), TOKENS_HOLD + 0.01),
        side_by_side(with_interval(run("ddp", 1, 900), 0.01), -0.1, 0.9 * (SPEEDUP_HOLD + 0.01)),
    ]
    judged(wide)
    assert "its tokens/s may not repeat" in wide[0]["notes"][0] and "wider than +/-5%" in wide[0]["notes"][0]
    assert "its windows' times spread" in wide[0]["notes"][0]  # the reason
    assert "its speedup may not repeat" in wide[1]["notes"][0] and "+/-3%" in wide[1]["notes"][0]
    assert "against single ws1 gpt2-tiny fp32 mb2's in the same rounds" in wide[1]["notes"][0]
    text = table_text(wide)
    assert "Notes on figures a repeat may not reproduce:" in text
    assert "ok * 1" in text and "ok * 2" in text
    assert "* 1 single ws1: its tokens/s may not repeat" in text
    assert "* 2 ddp ws1: its speedup may not repeat" in text


def test_the_host_speed_note_is_footnoted_in_the_table_not_only_in_the_json():
    r = with_interval(run("single", 1, 1000, spread=0.3), 0.02)
    r["host"] = {"speed": [[{"ref_s": [0.001, 0.0017]}]]}
    annotate([r])
    assert r["notes"] and r["notes"][0].startswith("its interval is wide because the host ran at different")
    assert "* 1 single ws1: its interval is wide because the host ran at different speeds" in table_text([r])


def test_the_table_says_in_one_line_when_its_rows_are_host_bound():
    from distbench.plausibility import host_bound

    rows = [run("single", 1, 1000), run("ddp", 1, 950), run("zero3", 1, 400)]
    for r, busy in zip(rows, (0.95, 0.76, 0.2), strict=True):
        r["metrics"]["busy_ratio"] = busy
    line = host_bound(rows)
    assert (
        line and "76% of ddp ws1's step" in line and "host's launch speed as much as the strategies" in line
    )
    assert "Host-bound: the device was busy 76% of ddp ws1's step" in table_text(rows)
    rows[1]["metrics"]["busy_ratio"] = 0.93  # ddp's device busy: the rows measure the GPU
    assert host_bound(rows) is None and "Host-bound" not in table_text(rows)
    del rows[1]  # no ddp: the reference's row decides
    assert host_bound(rows) is None
    rows[0]["metrics"]["busy_ratio"] = 0.5
    assert "50% of single ws1's step" in (host_bound(rows) or "")
    assert host_bound(clean()) is None  # nothing sampled the device (CPU runs)


def test_the_table_says_how_its_comparisons_were_measured():
    alone = [run("single", 1, 1000), run("ddp", 1, 900)]
    assert "Measured one at a time" in table_text(alone)
    paired = [side_by_side(run("single", 1, 1000), 0.0, 0.0), side_by_side(run("ddp", 1, 900), -0.1, 0.01)]
    paired[0]["side_by_side"]["vs_reference"] = None
    assert "Measured side by side: 6 rounds" in table_text(paired)
    paired[1]["side_by_side"].update(mode="pairs", why="the runs did not fit in device memory at once")
    assert "in pairs with the reference, as the runs did not fit" in table_text(paired)
    for r in alone:  # not even a pair fitted: every row alone, and the title says why
        r["side_by_side"] = {"mode": "alone", "why": "the runs did not fit in device memory at once"}
    assert (
        "Measured one at a time (the runs did not fit in device memory at once; nor in pairs)"
        in table_text(alone)
    )


def test_the_loss_column_is_the_loss_at_one_named_step():
    rows = [run("single", 1, 1000), run("ddp", 1, 900)]
    for r, (last, fixed) in zip(rows, ((6.5, 7.0), (6.2, 7.1)), strict=True):
        r["losses"] = [9.0, fixed, last]
        r["loss"] = {"step": 2, "value": fixed}
    text = table_text(rows)
    assert "step 2" in text and "7.0000" in text and "7.1000" in text and "6.5000" not in text


def test_a_speedup_measured_side_by_side_is_judged_by_its_paired_ratio_and_interval():
    """Medians of separate windows say 0.98x inside a 4% spread ("within noise"); the paired windows say
    0.90x +-1% at 2 ranks: the speedup the table states is judged, not the medians'."""
    base = [run("single", 1, 1000), run("ddp", 2, 980)]
    assert any("speedup within noise" in w for w in flagged(base, "ddp", 2))
    paired = [run("single", 1, 1000), side_by_side(run("ddp", 2, 980), -0.10, 0.01)]
    assert flagged(paired, "ddp", 2) == []
    wide = [run("single", 1, 1000), side_by_side(run("ddp", 2, 980), -0.02, 0.05)]
    assert any("speedup within noise: 0.98x" in w for w in flagged(wide, "ddp", 2))
