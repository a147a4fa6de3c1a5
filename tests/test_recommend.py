"""`distbench recommend`: the micro-batch search finds the exact out-of-memory edge, the ranking puts the
fastest fitting candidate first, and the command's table and recommendation agree with the evidence it saved.

The search and the ranking run against made-up probes (a known memory limit, no training); one end-to-end run
on CPU finds a real edge: recommend_models.oom_above_3 raises torch's OutOfMemoryError above micro-batch 3.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from distbench import recommend
from distbench.cli import main
from distbench.recommend import GIB, Candidate, Headroom, Outcome, rank, search
from distbench.results import load_results, make_result

DDP = Candidate("ddp", False)


def _result(
    mb: int,
    status: str = "ok",
    tokens_per_s: float = 0.0,
    peak_gib: float | None = None,
    total_gib: float | None = None,
    error: str | None = None,
    strategy: str = "ddp",
) -> dict[str, Any]:
    metrics = {"tokens_per_s": tokens_per_s} if status == "ok" else {}
    if peak_gib is not None:
        metrics["mem_reserved_peak_bytes"] = int(peak_gib * GIB)
    per_rank = [{"rank": 0, "mem_total_bytes": int(total_gib * GIB) if total_gib else None}]
    return make_result(
        {"strategy": strategy, "world_size": 1, "micro_batch": mb},
        metrics=metrics,
        status=status,
        error=error,
        per_rank=per_rank,
    )


def _limited(limit: int, calls: list[int] | None = None) -> recommend.Probe:
    """A probe out of memory above `limit` samples, its throughput growing with the micro-batch."""

    def probe(mb: int) -> dict[str, Any]:
        if calls is not None:
            calls.append(mb)
        return _result(mb, "oom" if mb > limit else "ok", tokens_per_s=100.0 * mb)

    return probe


def assert_finds_edge(search_fn: Callable[..., Outcome], limit: int, max_micro_batch: int = 1024) -> None:
    """The check the search must pass: the largest fitting micro-batch, exactly, and not marked capped."""
    out = search_fn(DDP, _limited(limit), max_micro_batch=max_micro_batch, max_probes=32)
    assert out.micro_batch == min(limit, max_micro_batch), f"found {out.micro_batch}, the edge is {limit}"
    assert not out.capped and out.ruled_out is None


def assert_recommends_fastest(
    rank_fn: Callable[[list[Outcome]], list[Outcome]], outcomes: list[Outcome]
) -> None:
    """The check the ranking must pass: the fastest fitting candidate first, every ruled-out one after the fits."""
    ranked = rank_fn(outcomes)
    fastest = max((o for o in outcomes if o.best), key=lambda o: o.tokens_per_s or 0.0)
    assert ranked[0] is fastest, (
        f"recommended {ranked[0].candidate.label}, fastest is {fastest.candidate.label}"
    )
    fits = [o.best is not None for o in ranked]
    assert fits == sorted(fits, reverse=True), "a ruled-out candidate ranked above a fitting one"


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 8, 13, 700, 1024, 5000])
def test_the_search_finds_the_largest_micro_batch_that_fits(limit):
    assert_finds_edge(search, limit)


def test_the_search_bisects_after_doubling_and_never_probes_twice():
    calls: list[int] = []
    out = search(DDP, _limited(5, calls), max_micro_batch=1024, max_probes=16)
    assert calls == [1, 2, 4, 8, 6, 5] and out.micro_batch == 5
    assert [mb for mb, _ in out.probes] == calls


def _device(peak_gib: Callable[[int], float], total_gib: float = 40.0, calls: list[int] | None = None):
    """A probe on a GPU of `total_gib` whose peak at micro-batch mb is peak_gib(mb): out of memory above it."""

    def probe(mb: int) -> dict[str, Any]:
        if calls is not None:
            calls.append(mb)
        peak = peak_gib(mb)
        if peak > total_gib:
            return _result(mb, "oom")
        return _result(mb, tokens_per_s=100.0 * mb, peak_gib=peak, total_gib=total_gib)

    return probe


def _edge(peak_gib: Callable[[int], float], total_gib: float = 40.0) -> int:
    return max(mb for mb in range(1, 5000) if peak_gib(mb) <= total_gib)


@pytest.mark.parametrize(
    "peak_gib, total_gib, most",
    [
        (lambda mb: 2 + 1.0 * mb, 40, 6),  # linear: doubling and bisecting take 12
        (lambda mb: 6 + 4.1 * mb, 140, 5),  # GPT-2 Large under DDP on an H200, roughly: 12
        (lambda mb: 20 + 0.05 * mb, 40, 7),  # a far edge (400): 18
        (lambda mb: 2 + 0.02 * mb**2, 40, 8),  # grows faster than linear, the guesses overshoot: 12
        (lambda mb: 2 + 6 * mb**0.5, 40, 13),  # grows slower, they undershoot: 12, one more at worst
        (lambda mb: 2 + 1.0 * mb + (8 if mb > 20 else 0), 40, 10),  # a step the line cannot see: 10
    ],
)
def test_measured_peaks_guide_the_search_to_the_exact_edge(peak_gib, total_gib, most):
    """With device memory measured, the guesses only choose where to probe: the answer is the exact edge
    whatever the memory does, in far fewer probes where it grows about linearly with the micro-batch, and
    at worst about what doubling and bisecting take."""
    calls: list[int] = []
    out = search(DDP, _device(peak_gib, total_gib, calls), max_micro_batch=4096, max_probes=32)
    assert out.micro_batch == _edge(peak_gib, total_gib) and not out.capped
    assert len(calls) <= most, calls
    assert len(set(calls)) == len(calls)  # never the same micro-batch twice


def test_the_headroom_is_part_of_the_guess():
    calls: list[int] = []
    out = search(
        DDP,
        _device(lambda mb: 2 + 1.0 * mb, calls=calls),
        max_micro_batch=4096,
        max_probes=32,
        headroom=Headroom(bytes=10 * GIB),
    )
    assert out.micro_batch == 28 and calls == [1, 2, 8, 28, 29]


@pytest.mark.parametrize(
    "start, limit, probes",
    [(4, 9, [4, 8, 16, 12, 10, 9]), (4, 2, [4, 2, 3]), (4, 0, [4, 2, 1]), (2000, 5000, [1024])],
)
def test_a_search_started_where_a_lighter_variant_fit_still_finds_the_edge(start, limit, probes):
    calls: list[int] = []
    out = search(DDP, _limited(limit, calls), max_micro_batch=1024, max_probes=16, start=start)
    assert calls == probes and out.micro_batch == (min(limit, 1024) or None)


def test_nothing_fits_rules_the_candidate_out_after_one_probe():
    calls: list[int] = []
    out = search(DDP, _limited(0, calls), max_micro_batch=64, max_probes=16)
    assert calls == [1] and out.best is None
    assert out.ruled_out == "micro-batch 1 does not fit: out of memory"


def test_the_ceiling_and_the_probe_budget_are_honoured():
    calls: list[int] = []
    assert search(DDP, _limited(100, calls), max_micro_batch=6, max_probes=16).micro_batch == 6
    assert calls == [1, 2, 4, 6]
    short = search(DDP, _limited(5), max_micro_batch=1024, max_probes=3)
    assert len(short.probes) == 3 and short.micro_batch == 4 and short.capped  # 4 fits; 5..7 were never tried


def test_a_fit_leaving_less_than_the_headroom_counts_as_out_of_memory():
    def probe(mb: int) -> dict[str, Any]:  # 1 GiB per sample on a 10 GiB device
        return _result(mb, tokens_per_s=mb, peak_gib=mb, total_gib=10)

    assert (
        search(DDP, probe, max_micro_batch=64, max_probes=16, headroom=Headroom(bytes=3 * GIB)).micro_batch
        == 7
    )
    assert (
        search(DDP, probe, max_micro_batch=64, max_probes=16, headroom=Headroom(fraction=0.5)).micro_batch
        == 5
    )
    assert (
        recommend.misfit(probe(8), Headroom(bytes=3 * GIB))
        == "leaves 2.00 GiB free, less than the 3.00 GiB headroom"
    )
    assert (
        recommend.misfit(_result(8, tokens_per_s=1.0), Headroom(bytes=3 * GIB)) is None
    )  # CPU: no memory known


def test_nvmls_peak_is_held_against_nvmls_total():
    """NVML's used counts the driver's reservation, torch's total leaves it out: a probe that ran on an H200
    read 150,382,444,544 bytes used against torch's 150,109,880,320 and NVML's 150,755,328,000. It fits, with
    NVML's total minus NVML's peak left; torch's total stands in only where NVML's was not kept."""
    r = _result(53, tokens_per_s=1.0)
    r["metrics"]["nvml_mem_used_peak_bytes"] = 150_382_444_544
    r["per_rank"][0].update(mem_total_bytes=150_109_880_320, nvml_mem_total_bytes=150_755_328_000)
    assert recommend.misfit(r, Headroom()) is None
    assert recommend.headroom_bytes(r) == 150_755_328_000 - 150_382_444_544
    del r["per_rank"][0]["nvml_mem_total_bytes"]  # a result written before NVML's total was kept
    assert recommend.total_bytes(r) == 150_109_880_320


def test_a_probe_that_fails_otherwise_rules_the_candidate_out_with_its_exception():
    error = (
        "job distbench.jobs.bench:bench failed at world size 2: rank 0 raised ValueError\n"
        '===== rank 0: error (ValueError) =====\nTraceback (most recent call last):\n  File "x.py"\n'
        "ValueError: bad shapes\n===== rank 1: ok ====="
    )

    def probe(mb: int) -> dict[str, Any]:
        return _result(mb, "error", error=error) if mb == 4 else _result(mb, tokens_per_s=mb)

    out = search(DDP, probe, max_micro_batch=64, max_probes=16)
    assert out.best is None and out.ruled_out == "micro-batch 4 failed: ValueError: bad shapes"


def _outcome(strategy: str, tokens_per_s: float | None, why: str | None = None) -> Outcome:
    best = _result(4, tokens_per_s=tokens_per_s, strategy=strategy) if tokens_per_s else None
    return Outcome(Candidate(strategy, False), probes=[(4, best)] if best else [], best=best, ruled_out=why)


def test_the_ranking_puts_the_fastest_fit_first_and_the_ruled_out_last():
    outcomes = [
        _outcome("ddp", 500.0),
        _outcome("zero3", None, "micro-batch 1 does not fit: out of memory"),
        _outcome("fsdp_full", 900.0),
        _outcome("zero1", 700.0),
    ]
    assert_recommends_fastest(rank, outcomes)
    assert [o.candidate.strategy for o in rank(outcomes)] == ["fsdp_full", "zero1", "ddp", "zero3"]
    rows = recommend.summary(rank(outcomes), {})
    assert rows[-1]["fits"] is False and rows[-1]["ruled_out"].endswith("out of memory")


def test_candidates_whose_step_time_range_overlaps_the_tops_are_named_as_noise():
    def timed(strategy: str, tokens_per_s: float, p10: float, median: float, p90: float) -> Outcome:
        out = _outcome(strategy, tokens_per_s)
        assert out.best is not None
        out.best["step_time_s"] = {"p10": p10, "median": median, "p90": p90}
        return out

    top = timed("zero2", 1000.0, 0.9, 1.0, 1.25)  # 800-1111 tokens/s
    near = timed("ddp", 700.0, 0.8, 1.0, 1.0)  # 700-875: overlaps
    far = timed("fsdp_full", 700.0, 0.9, 1.0, 1.0)  # 700-778: below the top's 800
    assert recommend.rivals(rank([far, near, top])) == [near]
    assert recommend.rivals([timed("zero2", 1000.0, 1.0, 1.0, 1.0), timed("ddp", 999.0, 1.0, 1.0, 1.0)]) == []


# --- bite: each check above fails on a planted defect ---------------------------------------------------------
def test_the_edge_check_catches_a_search_that_stops_one_probe_early():
    probes_needed = len(search(DDP, _limited(5), max_micro_batch=1024, max_probes=32).probes)

    def early(*args: Any, **kwargs: Any) -> Outcome:
        return search(*args, **{**kwargs, "max_probes": probes_needed - 1})

    with pytest.raises(AssertionError, match="found 4, the edge is 5"):
        assert_finds_edge(early, 5)


def test_the_ranking_check_catches_an_ascending_sort(monkeypatch):
    outcomes = [
        _outcome("ddp", 500.0),
        _outcome("fsdp_full", 900.0),
        _outcome("zero3", None, "out of memory"),
    ]
    ascending = sorted(outcomes, key=lambda o: (o.best is None, o.tokens_per_s or 0.0))
    monkeypatch.setattr(recommend, "rank", lambda os: ascending)
    with pytest.raises(AssertionError, match="recommended ddp, fastest is fsdp_full"):
        assert_recommends_fastest(recommend.rank, outcomes)


def _predicted(
    strategy: str, gib: float, offload: bool = False, why: str | None = None
) -> recommend.Predicted:
    return recommend.Predicted(strategy, {"params": gib * GIB}, ruled_out=why, offload=offload)


def assert_ranks_predictions(rank_fn: Callable[..., list[recommend.Predicted]]) -> None:
    """On 10 GiB GPUs: what fits before what does not before what cannot run; among the fits, state on the GPUs
    before offload, and the most memory left for activations first."""
    given = [
        _predicted("zero1", 9.0),
        _predicted("ddp", 30.0),
        _predicted("zero3_offload", 0.0, offload=True),
        _predicted("single", 0.0, why="single runs on at most 1 rank(s)"),
        _predicted("zero3", 2.0),
        _predicted("zero2", 12.0),
    ]
    got = [p.strategy for p in rank_fn(given, 10 * GIB, Headroom())]
    assert got == ["zero3", "zero1", "zero3_offload", "zero2", "ddp", "single"], got


def test_predictions_rank_the_fits_by_the_memory_they_leave():
    assert_ranks_predictions(recommend.rank_predicted)
    tight = recommend.predicted_misfit(_predicted("zero1", 9.0), 10 * GIB, Headroom(bytes=2 * GIB))
    assert tight == "needs 9.00 GiB a GPU, more than 8.00 GiB (the GPU's less the 2.00 GiB headroom)"


def test_the_prediction_ranking_check_catches_the_least_sharded_first():
    def least_sharded_first(predicted, gpu_bytes, headroom):
        return sorted(predicted, key=lambda p: -p.state_bytes)

    with pytest.raises(AssertionError):
        assert_ranks_predictions(least_sharded_first)


# --- the command --------------------------------------------------------------------------------------------
def _rows(out: str) -> dict[str, list[str]]:
    """Table rows by strategy label ("ddp", "ddp +AC"), cells stripped."""
    rows = {}
    for ln in out.splitlines():
        cells = [c.strip() for c in ln.split("│")[1:-1]]
        if len(cells) == 8 and cells[0].isdigit():
            rows[cells[1] + (" +AC" if cells[2] == "on" else "")] = cells
    return rows


@pytest.mark.slow  # three `distbench run`s with pools of their own (~20 s on 2 cores)
def test_recommend_finds_the_real_edge_and_recommends_the_fastest_fit_by_its_evidence(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line
    argv = [
        "recommend",
        "-m",
        "recommend_models:oom_above_3",
        "-n",
        "2",
        "-s",
        "ddp,fsdp_full,single,fsdp_offload",
        "--max-micro-batch",
        "8",
        "--steps",
        "1",
        "--warmup",
        "0",
        "-o",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["ddp"][3] == rows["fsdp_full"][3] == "3"
    assert "ruled out: single runs on at most 1 rank(s)" in rows["single"][7]
    assert "ruled out: fsdp_offload needs CUDA GPUs" in rows["fsdp_offload"][7]
    # Independently of the table: the edge and the winner as the saved results show them.
    results = load_results(tmp_path)
    largest: dict[str, dict[str, Any]] = {}
    for r in results:
        s, mb = r["config"]["strategy"], r["config"]["micro_batch"]
        assert r["status"] == ("oom" if mb > 3 else "ok"), f"{s} micro-batch {mb}: {r['status']}"
        if (
            r["status"] == "ok"
            and mb > largest.get(s, {"config": {"micro_batch": 0}})["config"]["micro_batch"]
        ):
            largest[s] = r
    assert {s: r["config"]["micro_batch"] for s, r in largest.items()} == {"ddp": 3, "fsdp_full": 3}
    winner = max(largest.values(), key=lambda r: r["metrics"]["tokens_per_s"])
    line = " ".join(out.split())
    assert (
        f"Recommendation: {winner['config']['strategy']} at micro-batch 3: "
        f"{winner['metrics']['tokens_per_s']:,.0f} tokens/s" in line
    )
    saved = json.loads((tmp_path / "recommendation.json").read_text())
    assert saved["recommendation"]["evidence"] == f"{winner['id']}.json"  # beside it: the folder moves whole
    assert all((tmp_path / p["file"]).is_file() for row in saved["ranked"] for p in row["probes"])
    assert [r["strategy"] for r in saved["ranked"]][2:] == ["single", "fsdp_offload"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-m", "gpt9"], "unknown model 'gpt9'"),
        (["-m", "gpt2-tiny", "-s", "ddp,fdsp_full"], "unknown strategy 'fdsp_full'"),
        (["-m", "gpt2-tiny", "--headroom-gib", "-1"], "greater than or equal to 0"),
        (["-m", "gpt2-tiny", "--headroom-frac", "1.5"], "must be below 1"),
        (["-m", "gpt2-tiny", "--headroom-gib", "1", "--headroom-frac", "0.1"], "not allowed with argument"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(argv, message, capsys, monkeypatch):
    import distbench.matrix

    monkeypatch.setattr(distbench.matrix, "run_matrix", lambda *a, **kw: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        main(["recommend", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "64"], "--predict needs --gpus and --gpu-memory-gib"),
        (["-n", "12", "--gpu-memory-gib", "80"], "--gpus 12 is not whole nodes of --gpus-per-node 8"),
        (["-n", "8", "--gpu-memory-gib", "80", "--lora-rank", "8"], "drop --lora-rank and --ds-config"),
    ],
)
def test_a_prediction_without_its_cluster_is_refused(argv, message, capsys):
    assert main(["recommend", "-m", "llama-7b", "--predict", *argv]) == 2
    assert message in capsys.readouterr().err


def test_more_gpus_than_the_machine_has_is_refused(capsys, monkeypatch):
    import distbench.matrix
    import distbench.runtime.pool

    monkeypatch.setattr(distbench.matrix, "run_matrix", lambda *a, **kw: pytest.fail("ran"))
    monkeypatch.setattr(distbench.runtime.pool, "cuda_device_count", lambda: 1)
    assert main(["recommend", "-m", "gpt2-tiny", "--device", "cuda", "--gpus", "2"]) == 2
    assert "--gpus 2 but this machine has 1 CUDA device(s)" in capsys.readouterr().err


def test_activation_checkpointing_is_a_candidate_only_for_models_with_the_switch(capsys, monkeypatch):
    from distbench.commands.recommend import _checkpointable

    assert _checkpointable("gpt2-tiny", 0) and not _checkpointable("user_models:tiny_lm", 0)
    argv = [
        "recommend",
        "-m",
        "user_models:tiny_lm",
        "-n",
        "1",
        "-s",
        "ddp",
        "--activation-checkpointing",
        "on",
    ]
    assert main(argv) == 2
    assert "user_models:tiny_lm has no activation checkpointing switch" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-s", "ddp", "--ds-config", "ds.json"], "applies to zero0"),  # no candidate takes it
        (["-s", "zero2", "--ds-config", "missing.json"], "ds_config file missing.json does not exist"),
    ],
)
def test_strategy_options_are_checked_before_anything_runs(argv, message, capsys, monkeypatch, tmp_path):
    import distbench.matrix

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text("{}")
    monkeypatch.setattr(distbench.matrix, "run_matrix", lambda *a, **kw: pytest.fail("ran"))
    assert main(["recommend", "-m", "gpt2-tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_options_reach_only_the_strategies_that_take_them():
    from distbench.commands.recommend import _for_strategy

    base = {"steps": 2, "lora_rank": 4, "options": {"ds_config": '{"zero_optimization": {}}'}}
    assert _for_strategy(base, "zero3")["options"] == base["options"]
    assert _for_strategy(base, "ddp") == {"steps": 2, "lora_rank": 4, "options": {}}


def measured(strategy: str, tps: float, mb: int, spread: float = 0.02) -> dict[str, Any]:
    """An ok 2-GPU result of `strategy` at micro-batch `mb`, step times spread `spread` (p10-p90 / median)."""
    from distbench.results import make_result

    st = 2 * mb * 1024 / tps
    config = {"strategy": strategy, "world_size": 2, "model": "gpt2-large", "precision": "bf16", "seq_len": 1024,
              "global_batch": 32, "micro_batch": mb}  # fmt: skip
    return make_result(
        config,
        metrics={"tokens_per_s": tps, "step_time_s": st},
        step_time_s={"median": st, "p10": st * (1 - spread / 2), "p90": st * (1 + spread / 2), "n": 10},
    )


def test_the_ranking_is_held_against_a_measured_table_and_each_disagreement_says_why():
    """Issue 41: recommend at 2 and 4 GPUs agrees with the measured table, or says where and why not."""
    from distbench.plausibility import check
    from distbench.recommend import agreement as judge

    def agreement(ranked, results, gpus):
        return judge(ranked, results, gpus, check(results))

    table = [measured("single", 33468, 8), measured("ddp", 63370, 8), measured("fsdp_full", 50223, 8),
             measured("zero2", 65206, 8)]  # fmt: skip
    table[0]["config"]["world_size"] = 1
    same = [
        Outcome(Candidate(s, False), best=measured(s, t, 16)) for s, t in (("zero2", 70000), ("ddp", 68000))
    ]
    assert agreement(same, table, 2) == ["agrees with the table at 2 GPUs: both put zero2 first"]
    bigger = [Outcome(Candidate("fsdp_full", False), best=measured("fsdp_full", 72000, 40)), *same]
    lines = agreement(bigger, table, 2)
    assert lines[0] == "differs from the table at 2 GPUs in 2 pair(s); the table's fastest is zero2"
    assert lines[1] == (
        "fsdp_full above zero2 here, below it in the table (50,223 vs 65,206): different micro-batches: here "
        "fsdp_full ran at 40 and zero2 at 16 without accumulation, the table at 8 and 8"
    )
    noisy = [*table[:2], measured("fsdp_full", 50223, 8, spread=1.5), table[3]]
    assert (
        "the table's fsdp_full figure is flagged (step times spread wider than their median)"
        in agreement(bigger, noisy, 2)[1]
    )
    close = [*table[:2], measured("fsdp_full", 63000, 8, spread=0.05), table[3]]
    assert agreement(bigger, close, 2)[2].endswith("inside the table's step-time spread: its order is noise")
    assert agreement(same, table, 4) == [
        "nothing to compare: the table has 0 strategy(ies) at 4 GPUs, 0 of them here"
    ]


def test_a_table_that_is_not_there_is_refused_before_anything_runs(capsys, monkeypatch, tmp_path):
    import distbench.matrix

    monkeypatch.setattr(distbench.matrix, "run_matrix", lambda *a, **kw: pytest.fail("ran"))
    assert main(["recommend", "-m", "gpt2-tiny", "--table", str(tmp_path / "none")]) == 2
    assert f"no results at {tmp_path / 'none'}" in capsys.readouterr().err
