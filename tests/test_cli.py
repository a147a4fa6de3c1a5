"""The `distbench` command line on a machine without GPUs: the main job, and bad input refused before any
rank starts, with the fix in the message."""

from __future__ import annotations

import contextlib
import json

import pytest

from distbench.cli import main
from distbench.invariants.checks import assert_losses_match
from distbench.strategies import REGISTRY


def test_strategies_lists_every_name_and_where_it_runs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    assert main(["strategies"]) == 0
    rows = [[cell.strip() for cell in ln.split("│")[1:-1]] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("│")]
    cpu = {row[0]: row[1].split()[0] for row in rows}
    assert cpu == {name: "yes" if spec.cpu else "no" for name, spec in REGISTRY.items()}


@pytest.mark.parametrize("argv,needle", [
    (["-s", "nope"], "unknown strategy 'nope'"),
    (["-s", "zero_3"], "Did you mean zero3"),
    (["-m", "gpt5"], "unknown model 'gpt5'"),
    (["-s", "ddp", "-n", "3", "--global-batch", "8"], "use a global batch of 6 or 12"),
    (["--device", "cuda"], "no CUDA device is visible"),
    (["-m", "user_models:no_such_factory"], "cannot load model factory"),
    (["-m", "user_models:[red]x"], "'user_models:[red]x'"),  # printed as is, not read as markup
], ids=["strategy", "strategy-typo", "model", "batch", "gpu", "factory", "markup"])
def test_bad_input_is_refused_with_the_fix(argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit, match="2") if argv[0] != "--device" else contextlib.nullcontext():
        assert main(["run", *argv, "-o", str(tmp_path)]) == 2
    assert needle in " ".join(capsys.readouterr().err.split())
    assert not list(tmp_path.iterdir()), "a refused run wrote results"


@pytest.mark.parametrize("ds_config,needle", [
    ('{"zero_optimisation": {}}', "did you mean 'zero_optimization'?"),
    ('{"zero_optimization": {"stage": 1}}', "pick zero1, zero2 or zero3 instead"),
    ('{"train_batch_size": 16,}', "is not valid JSON"),
], ids=["typo", "conflict", "malformed"])
def test_bad_ds_config_is_refused_before_ranks_start(ds_config, needle, capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(ds_config)
    out_dir = tmp_path / "out"
    assert main(["run", "-s", "zero2", "-n", "1", "--ds-config", str(path), "-o", str(out_dir)]) == 2
    assert needle in " ".join(capsys.readouterr().err.split())
    assert not out_dir.exists()


def test_a_failing_configuration_is_a_result_and_the_matrix_goes_on(capsys, tmp_path):
    argv = ["run", "-s", "ddp", "-n", "1", "-m", "user_models:tiny_lm,user_models:wrong_vocab_lm",
            "--steps", "2", "--warmup", "0", "-o", str(tmp_path)]
    assert main(argv) == 1
    results = {json.loads(p.read_text())["config"]["model"]: json.loads(p.read_text())
               for p in tmp_path.glob("*.json")}
    assert results["user_models:tiny_lm"]["status"] == "ok"
    bad = results["user_models:wrong_vocab_lm"]
    assert bad["status"] == "error" and "===== rank 0: error" in bad["error"]
    assert "failed ddp ws1 user_models:wrong_vocab_lm" in " ".join(capsys.readouterr().out.split())


def test_a_trace_that_cannot_be_analysed_costs_its_breakdown_not_the_run(capsys, tmp_path):
    """A CPU trace has no GPU kernels for HolisticTraceAnalysis (on an H100, HTA asserted on a 1-GPU trace):
    the configuration keeps its measurements, its result says why the breakdown is missing, the run goes on."""
    argv = ["run", "-s", "ddp", "-n", "1", "-m", "user_models:tiny_lm", "--steps", "2", "--warmup", "0",
            "--trace", "-o", str(tmp_path)]
    assert main(argv) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert result["status"] == "ok" and result["metrics"]["tokens_per_s"] > 0
    assert result["trace"]["error"]
    assert "no trace breakdown ddp ws1" in " ".join(capsys.readouterr().out.split())


@pytest.mark.strategies("ddp", "fsdp_full", "zero2")
def test_a_users_own_model_trains_like_the_reference(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size, model="user_models:tiny_lm")
    losses = suite.train(cfg)[0]["losses"]
    assert_losses_match(losses, suite.reference(cfg)["losses"], f"{strategy} ws{world_size} on a user model")
