"""The `distbench` command line on a machine without GPUs: the main job and a failing configuration recorded
(bad input refused before any rank starts: tests/test_bad_input.py)."""

from __future__ import annotations

import json
import os

import pytest

from distbench.cli import main
from distbench.invariants.checks import SINGLE_PROCESS_REFERENCE, assert_losses_match
from distbench.strategies import REGISTRY


def test_strategies_lists_every_name_and_where_it_runs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    assert main(["strategies"]) == 0
    rows = [
        [cell.strip() for cell in ln.split("│")[1:-1]]
        for ln in capsys.readouterr().out.splitlines()
        if ln.startswith("│")
    ]
    cpu = {row[0]: row[1].split()[0] for row in rows}
    assert cpu == {name: "yes" if spec.cpu else "no" for name, spec in REGISTRY.items()}


@pytest.mark.slow  # a whole `distbench run` with its own pools (~6 s on 2 cores)
def test_a_failing_configuration_is_a_result_and_the_matrix_goes_on(capsys, tmp_path):
    argv = [
        "run",
        "-s",
        "ddp",
        "-n",
        "1",
        "-m",
        "user_models:tiny_lm,user_models:wrong_vocab_lm",
        "--steps",
        "2",
        "--warmup",
        "0",
        "-o",
        str(tmp_path),
    ]
    assert main(argv) == 1
    results = {
        json.loads(p.read_text())["config"]["model"]: json.loads(p.read_text())
        for p in tmp_path.glob("*.json")
    }
    assert results["user_models:tiny_lm"]["status"] == "ok"
    bad = results["user_models:wrong_vocab_lm"]
    assert bad["status"] == "error" and "===== rank 0: error" in bad["error"]
    assert "failed ddp ws1 user_models:wrong_vocab_lm" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow  # a whole `distbench run` with its own pool (~5 s on 2 cores)
def test_a_run_whose_only_configuration_ran_out_of_memory_exits_1(capsys, tmp_path):
    argv = ["run", "-s", "ddp", "-n", "1", "-m", "user_models:oom_lm", "--steps", "1", "-o", str(tmp_path)]
    assert main(argv) == 1
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert result["status"] == "oom"
    assert "out of memory ddp ws1 user_models:oom_lm" in " ".join(capsys.readouterr().out.split())


def test_more_ranks_than_cpus_on_gloo_is_warned_about(capsys, tmp_path, monkeypatch):
    """World size 8 on a 2-CPU host ran 85 s without a word; its times measure contention."""
    import distbench.matrix

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(distbench.matrix, "run_matrix", lambda *a, **kw: [])
    assert main(["run", "-s", "ddp", "-n", "2", "--global-batch", "4", "-o", str(tmp_path)]) == 0
    assert "warning world size 2 on 1 CPU(s)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("preset", "flags", "mode"), [("", ["--bind-cpus"], "pinned"),
                                                      ("", ["--bind-cpus", "--one-at-a-time"], "exclusive"),
                                                      ("", ["--bind-cpus", "--side-by-side"], "exclusive"),
                                                      ("exclusive", ["--bind-cpus"], "exclusive"),
                                                      ("pinned", ["--bind-cpus"], "pinned"),
                                                      ("pinned", ["--no-bind-cpus"], None)])  # fmt: skip
def test_bind_cpus_pins_turn_taking_windows_and_keeps_a_mode_the_caller_set(
    tmp_path, monkeypatch, preset, flags, mode
):
    """`--bind-cpus` (on by default on GPUs) pins the training threads where the rows' windows take turns (the
    default): unpinned, the same rows' speedups moved up to 28% between two runs on one H200 VM, pinned at most
    2%. Rows timed alone or at once on disjoint GPUs get slices only. A mode the caller set stays (it was once
    overwritten, so a run could not pin as `distbench ab` does); --no-bind-cpus unbinds."""
    import distbench.matrix

    seen = {}

    def run_matrix(*a, **kw):
        seen["mode"] = os.environ.get("DISTBENCH_BIND_CPUS")
        return []

    # registered, so what run() sets is undone after the test
    monkeypatch.setenv("DISTBENCH_BIND_CPUS", preset)
    monkeypatch.setattr(distbench.matrix, "run_matrix", run_matrix)
    assert main(["run", "-s", "ddp", "-n", "1", *flags, "--device", "cpu", "-o", str(tmp_path)]) == 0
    assert seen["mode"] == mode


@pytest.mark.slow  # a whole `distbench run` with its own pool (~6 s on 2 cores)
def test_a_trace_that_cannot_be_analysed_costs_its_breakdown_not_the_run(capsys, tmp_path):
    """A CPU trace has no GPU kernels for HolisticTraceAnalysis (on an H100, HTA asserted on a 1-GPU trace):
    the configuration keeps its measurements, its result says why the breakdown is missing, the run goes on."""
    argv = [
        "run",
        "-s",
        "ddp",
        "-n",
        "1",
        "-m",
        "user_models:tiny_lm",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--trace",
        "-o",
        str(tmp_path),
    ]
    assert main(argv) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert result["status"] == "ok" and result["metrics"]["tokens_per_s"] > 0
    assert result["trace"]["error"]
    assert "no trace breakdown ddp ws1" in " ".join(capsys.readouterr().out.split())


@pytest.mark.strategies("ddp", "fsdp_full", "zero2")
def test_a_users_own_model_trains_like_the_reference(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size, model="user_models:tiny_lm")
    losses = suite.train(cfg)[0]["losses"]
    assert_losses_match(
        losses,
        suite.reference(cfg)["losses"],
        f"{strategy} ws{world_size} on a user model",
        against=SINGLE_PROCESS_REFERENCE,
    )


@pytest.mark.parametrize(("flags", "one"), [([], False), (["--one-at-a-time"], True)])
def test_run_measures_side_by_side_unless_asked_one_at_a_time(tmp_path, monkeypatch, flags, one):
    import distbench.matrix

    seen = {}

    def run_matrix(matrix, **kw):
        seen["one"] = matrix.one_at_a_time
        return []

    monkeypatch.setattr(distbench.matrix, "run_matrix", run_matrix)
    assert main(["run", "-s", "ddp", "-n", "1", "--device", "cpu", "-o", str(tmp_path), *flags]) == 0
    assert seen["one"] is one
