"""`distbench ab` end to end on gloo: two variant servers with their own rank pools, alternating runs, a verdict
and every run's result on disk; bad variants are usage errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distbench.cli import main
from distbench.errors import ConfigError
from distbench.gate.variants import parse_variant


def _protocol_1_tree(tmp_path) -> str:
    """A copy of this distbench whose server announces protocol 1, as one from before runs came in pieces."""
    tree = tmp_path / "old"
    shutil.copytree(Path(__file__).resolve().parents[1] / "src", tree / "src")
    serve = tree / "src" / "distbench" / "gate" / "serve.py"
    text, n = re.subn(r"^PROTOCOL = \d+$", "PROTOCOL = 1", serve.read_text(), flags=re.M)
    assert n == 1, "serve.py no longer names its PROTOCOL on a line of its own"
    serve.write_text(text)
    return str(tree)


@pytest.mark.slow  # two variant servers, three pairs, fresh ranks each round: 60-95 s on 2 cores, per case
# an old head's fallback to whole runs is decided per submission by
# test_a_variant_whose_server_runs_whole_runs_only_makes_the_runs_alternate; through real processes, nightly
@pytest.mark.parametrize("head", ["env", pytest.param("protocol-1", marks=pytest.mark.nightly)])
def test_ab_smoke_on_gloo(tmp_path, head):
    out = tmp_path / "ab"
    # Two trivially different variants: the head's ranks see one more environment variable, or the head is a
    # distbench whose server runs whole runs only (then the runs alternate instead of their windows).
    spec = "env.DISTBENCH_AB_SMOKE=1" if head == "env" else f"tree={_protocol_1_tree(tmp_path)}"
    proc = subprocess.run(
        [sys.executable, "-m", "distbench.cli", "ab", "--device", "cpu", "-s", "ddp", "-n", "2"]
        + ["--steps", "3", "--head", spec, "--min-pairs", "3", "--max-pairs", "3", "-o", str(out)]
        + [
            "--numerics",
            "default",
        ],  # the speed's smoke test: the recipes have their own (test_numerics_recipes)
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1, 3), proc.stdout + proc.stderr  # CPU timings decide nothing here
    report = json.loads((out / "ab.json").read_text())
    (cfg,) = report["configs"]
    assert cfg["orders"] == ["AB", "BA", "AB"] and cfg["gated"] == ["step_time_s"]
    if head == "env":
        assert report["head"] == "this checkout, env.DISTBENCH_AB_SMOKE=1"
        # the runs' timed windows were interleaved: one log ratio per pair of adjacent windows, 3 windows a run
        assert cfg["interleave"] == "windows" and [len(w) for w in cfg["window_log_ratios"]] == [3, 3, 3]
    else:
        assert "runs alternate" in proc.stdout and cfg["interleave"] == "runs"
        assert cfg["window_log_ratios"] == [None, None, None]
    for side in ("base", "head"):
        saved = {p.stem for p in (out / side).glob("*.json")}
        assert set(cfg[f"{side}_ids"]) <= saved
    row = next(r for r in cfg["rows"] if r["metric"] == "step_time_s")
    assert len(row["base"]) == len(row["head"]) == 3 and row["effect"] is not None
    assert (out / "ab.md").read_text().startswith("## distbench ab: ")
    left = subprocess.run(["pgrep", "-f", "distbench.gate.serve"], capture_output=True, text=True)
    assert not left.stdout.strip(), "variant servers left running"


@pytest.mark.parametrize(
    "spec,why",
    [
        ("rev", "not KEY=VALUE"),
        ("color=red", "unknown item"),
        ("tree=/nonexistent", "holds no src/distbench"),
        ("python=/nonexistent/python", "not an executable"),
        ("rev=main,tree=.", "not both"),
        ("path=/nonexistent", "not a directory"),
    ],
)
def test_bad_variants_are_refused(spec, why):
    with pytest.raises(ConfigError, match=why):
        parse_variant("head", spec)


def test_variant_parsing(tmp_path):
    v = parse_variant("head", "env.NCCL_ALGO=Ring, env.X=1,python=" + sys.executable)
    assert (
        v.env == {"NCCL_ALGO": "Ring", "X": "1"}
        and v.describe() == "this checkout, env.NCCL_ALGO=Ring, env.X=1"
    )
    (tmp_path / "src").mkdir()
    v = parse_variant("base", f"path={tmp_path},path={tmp_path / 'src'}")
    assert v.path == (str(tmp_path), str(tmp_path / "src"))
    assert v.describe() == f"this checkout, path={tmp_path}, path={tmp_path / 'src'}"


@pytest.mark.parametrize(
    "args",
    [
        ["--alpha", "0.7"],
        ["--min-pairs", "2"],
        ["--threshold", "0.004"],  # below --min-effect (0.005)
        ["--head", "bogus"],
        ["-s", "fsdp1_full"],
    ],
)
def test_usage_errors_exit_2(args, tmp_path, capsys):
    assert main(["ab", "--device", "cpu", "-o", str(tmp_path), *args]) == 2
    assert "error:" in capsys.readouterr().out


def test_a_run_the_variant_cannot_do_is_a_failed_run_not_a_dead_server():
    from distbench.gate.serve import Server

    class Pools:
        device_type = "cpu"

        def pool_for(self, world_size: int):
            raise RuntimeError("no pool for this world size here")

    out = Server(Pools()).handle({"cfg": {"strategy": "ddp", "world_size": 2}, "timeout": 5})
    assert out["status"] == "error" and "no pool for this world size here" in out["error"]
    bad = Server(Pools()).handle({"cfg": {"strategy": "ddp", "steps": "five"}, "timeout": 5})
    assert bad["status"] == "error" and "steps" in bad["error"]


@pytest.mark.parametrize(
    ("announced", "interleave", "note"),
    [({"protocol": 3}, "windows", False), ({"protocol": 2}, "windows", False), ({}, "runs", True)],
)
def test_a_variant_whose_server_runs_whole_runs_only_makes_the_runs_alternate(
    monkeypatch, tmp_path, announced, interleave, note
):
    """A head from before runs came in pieces announces no protocol (1): its windows cannot be interleaved, so
    whole runs alternate and the output says why. (`test_ab_smoke_on_gloo[protocol-1]`, nightly, runs such a
    distbench through real processes.)"""
    from distbench.gate import ab as gate_ab
    from distbench.gate import variants
    from distbench.gate.ab import ABReport

    class Server(variants.VariantProcess):
        """A variant's server that starts nothing and announces what the case says (the real protocol)."""

        def start(self) -> None:
            self.info = {"ready": True, **(announced if self.variant.label == "head" else {"protocol": 3})}

        def close(self) -> None:
            pass

        def remove_checkout(self) -> None:
            pass

    seen = {}

    def run_ab(configs, base, head, servers=None, **kwargs):
        seen["interleaved"] = servers is not None
        return ABReport([], 0.05, 0.05, 0.02, 0.01, 0.0, False, "", "")

    monkeypatch.setattr(variants, "VariantProcess", Server)
    monkeypatch.setattr(gate_ab, "run_ab", run_ab)
    monkeypatch.setenv("DISTBENCH_BIND_CPUS", "")
    out = tmp_path / "ab"
    lines = []
    monkeypatch.setattr(
        "rich.console.Console.print", lambda self, *a, **k: lines.append(" ".join(map(str, a)))
    )
    args = ["ab", "--device", "cpu", "-s", "ddp", "-n", "2", "--head", "env.X=1", "--numerics", "off"]
    assert main([*args, "-o", str(out)]) == 3
    assert seen["interleaved"] == (interleave == "windows")
    said = [ln for ln in lines if "runs alternate" in ln]
    assert bool(said) == note and (not note or "the head variant's distbench runs whole runs only" in said[0])
    assert any(f"{interleave} interleaved" in ln for ln in lines), lines


@pytest.mark.parametrize(("interleave", "mode"), [("windows", "pinned"), ("runs", "exclusive")])
def test_bind_cpus_pins_the_training_threads_when_windows_take_turns(monkeypatch, tmp_path, interleave, mode):
    import os

    from distbench.commands import ab as command
    from distbench.gate.ab import ABReport

    seen = {}

    def alternate(args, configs, device, variants, console):
        seen["mode"] = os.environ.get("DISTBENCH_BIND_CPUS")
        return ABReport([], 0.05, 0.05, 0.02, 0.01, 0.0, False, "", "")

    monkeypatch.setenv("DISTBENCH_BIND_CPUS", "")  # registered, so what run() sets is undone after the test
    monkeypatch.setattr(command, "alternate", alternate)
    args = ["ab", "--device", "cpu", "--bind-cpus", "--interleave", interleave, "-o", str(tmp_path)]
    assert main(args) == 3  # nothing compared: undecided, never a pass
    assert seen["mode"] == mode


@pytest.mark.slow  # an A/B run on a pool of its own (~10 s on 2 cores)
def test_a_run_in_pieces_is_a_whole_run_of_the_windows_asked_for():
    """serve.py's protocol 2 through real rank pools: setup, windows on request, finish into one result."""
    from distbench.gate.serve import Server
    from distbench.runtime.pool import PoolManager

    cfg = {"strategy": "ddp", "world_size": 1, "model": "gpt2-tiny", "micro_batch": 2, "global_batch": 2}
    cfg |= {"steps": 4, "windows": 2, "warmup": 1, "deterministic": False}
    pools = PoolManager("cpu")
    try:
        server = Server(pools)
        early = server.handle({"op": "window", "steps": 2, "timeout": 60})
        assert early["status"] == "error" and "send setup first" in early["error"]
        assert server.handle({"op": "setup", "cfg": cfg, "timeout": 120}) == {"status": "ok"}
        walls = [server.handle({"op": "window", "steps": n, "timeout": 60}) for n in (2, 1, 3)]
        assert all(w["status"] == "ok" and w["step_s"] > 0 for w in walls)
        result = server.handle({"op": "finish", "timeout": 60})
    finally:
        pools.close_all()
    assert result["status"] == "ok" and result["step_time_s"]["n"] == 6  # every window asked for, not cfg's 4
    assert len(result["step_time_s"]["windows"]) == 3 and len(result["losses"]) == 1 + 6
    assert server.stepped is None


@pytest.mark.parametrize(
    ("flags", "micro_batch", "checkpointing"), [([], 16, True), (["--micro-batch", "8"], 8, False)]
)
def test_gpu_defaults_are_sized_to_the_card_and_a_given_micro_batch_is_kept(
    monkeypatch, flags, micro_batch, checkpointing
):
    """On an 80 GB H100 at world size 2 the default DDP run (micro-batch 16) fits neither once nor twice: the
    gate turns activation checkpointing on; a micro-batch on the command line is run as given."""
    import argparse

    from distbench.commands import ab as command
    from distbench.gate import fit

    monkeypatch.setattr(fit, "card_bytes", lambda: 81559 * 2**20)
    parser = argparse.ArgumentParser()
    command.add_comparison_flags(parser)
    (cfg,) = command.configurations(parser.parse_args(["-s", "ddp", "-n", "2", *flags]), "cuda", 2)
    assert (cfg.micro_batch, cfg.activation_checkpointing, cfg.global_batch) == (
        micro_batch,
        checkpointing,
        2 * micro_batch,
    )


def test_ab_and_bisect_take_every_precision_run_takes():
    """The bisect a history proposes for the GPU grid names its precision (bf16-amp): ab and bisect parse it."""
    from distbench.commands import COMMANDS
    from distbench.commands.parser import build_parser

    parser = build_parser(COMMANDS)
    for precision in ("fp32", "bf16", "fp16", "bf16-amp"):
        assert parser.parse_args(["ab", "--precision", precision]).precision == precision
        assert parser.parse_args(["bisect", "--good", "a", "--precision", precision]).precision == precision
