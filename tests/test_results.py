"""Result files: read through a versioned schema (a damaged file is one line naming it, from the library and
from every command that reads results), newer sections pass through, and writes are durable and honour the
umask."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from distbench.cli import main
from distbench.results import SCHEMA, ResultFileError, json_schema, load_results, make_result, save_result

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "schemas" / "distbench.result-1.json"


def good() -> dict:
    cfg = {
        "strategy": "ddp",
        "world_size": 2,
        "model": "gpt2-tiny",
        "precision": "fp32",
        "seq_len": 32,
        "global_batch": 8,
        "micro_batch": 2,
    }
    return json.loads(
        json.dumps(
            make_result(
                cfg,
                metrics={"tokens_per_s": 1000.0, "mfu": 0.1},
                step_time_s={"median": 0.1, "p10": 0.09, "p90": 0.12, "n": 5},
            )
        )
    )


def without(key: str) -> dict:
    r = good()
    del r[key]
    return r


def with_(path: str, value) -> dict:
    r = good()
    *parents, last = path.split(".")
    node = r
    for p in parents:
        node = node[p]
    node[last] = value
    return r


DAMAGED = [
    ("not-utf8", b'{"schema": "distbench.result/1", "id": "\xff\xfe"}', "is not UTF-8 text (byte"),
    ("not-json", b'{"schema": "distbench.result/1",', "is not valid JSON: line 1"),
    ("no-config", without("config"), "config: field required"),
    ("config-null", with_("config", None), "config: input should be a valid dictionary"),
    (
        "metric-string",
        with_("metrics.tokens_per_s", "fast"),
        "metrics.tokens_per_s: input should be a valid number",
    ),
    (
        "world-size-string",
        with_("config.world_size", "2"),
        "config.world_size: input should be a valid integer",
    ),
    ("status", with_("status", "great"), "status: input should be 'ok', 'oom' or 'error'"),
    ("step-time", with_("step_time_s.median", None), "step_time_s.median"),
    ("in-a-list", [good(), without("id")], "(item 1) is a damaged"),
]


@pytest.mark.parametrize("content,needle", [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED])
def test_a_damaged_result_is_one_line_naming_the_file(tmp_path, capsys, content, needle):
    good_dir, bad_dir = tmp_path / "good", tmp_path / "bad"
    save_result(good(), good_dir)
    bad = bad_dir / "sub" / "r.json"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(ResultFileError) as e:
        load_results(bad_dir)
    assert str(bad) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)
    for argv in (
        ["report", str(bad_dir), "--out", str(tmp_path / "rep")],
        ["compare", str(good_dir), str(bad_dir)],
    ):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and str(bad) in err and needle in err and "Traceback" not in out + err


def test_newer_sections_and_metrics_pass_through_and_other_json_is_skipped(tmp_path):
    r = good()
    r["metrics"]["a_metric_from_a_newer_writer"] = 3
    r["plausibility"] = {"warnings": ["superlinear"]}
    save_result(r, tmp_path)
    (tmp_path / "benchmark.json").write_text('{"benchmarks": []}')
    (tmp_path / "future.json").write_text('{"schema": "distbench.result/2", "config": null}')
    assert load_results(tmp_path) == [r]


def test_every_committed_result_loads():
    assert len(load_results(ROOT / "results")) >= 80


def test_the_committed_json_schema_is_generated_from_the_model():
    fix = (
        "regenerate: PYTHONPATH=src python -c 'import json; from distbench.results import json_schema; "
        "print(json.dumps(json_schema(), indent=2, sort_keys=True))' > schemas/distbench.result-1.json"
    )
    assert json.loads(SCHEMA_FILE.read_text()) == json_schema(), fix
    assert json_schema()["properties"]["schema"]["const"] == SCHEMA


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_result_files_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = save_result(good(), tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "a temporary file was left behind"


def test_a_result_is_fsynced_and_so_is_its_directory(tmp_path, monkeypatch):
    synced: list[bool] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_result(good(), tmp_path)
    assert synced == [False, True]


def test_the_loss_shown_is_at_warmup_plus_steps_whatever_the_timing_ran():
    from distbench.config import RunConfig
    from distbench.results import loss_at_step, loss_step

    cfg = RunConfig(strategy="single", world_size=1, model="gpt2-tiny", precision="fp32", steps=6, warmup=2)
    assert loss_step(cfg) == 8
    losses = [float(i) for i in range(1, 13)]  # more windows under until_ci, or rounds side by side
    assert loss_at_step(cfg, losses) == {"step": 8, "value": 8.0}
    assert loss_at_step(cfg, losses[:8]) == loss_at_step(cfg, losses)
    assert loss_at_step(cfg, losses[:7]) == {"step": 8, "value": None}
