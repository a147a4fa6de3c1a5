"""The goldens' rules (testsuite/goldens.py), each stated against what is written here by hand: which machine
class a golden is filed under, what it records of the run's versions and emulated instruction set, what a
mismatch and an update say, how a golden file reads back and is rewritten. The goldens' comparison itself is
gate/numerics.py's (tests/test_rules_numerics.py)."""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distbench import machine
from distbench.config import RunConfig
from distbench.gate import numerics as nm
from distbench.testsuite import goldens

GOLDENS = Path(__file__).parent / "goldens"
EPS = 2.0**-23  # float32's machine epsilon, written out


def curve(loss: list[float], norm: list[float]) -> nm.Curve:
    return nm.Curve(tuple(loss), tuple(norm))


def golden(
    loss: list[float], norm: list[float], versions: dict[str, str | None] | None = None
) -> goldens.Golden:
    c = curve(loss, norm)
    cfg = RunConfig(steps=len(loss))
    return goldens.Golden("x", versions or {"torch": "2.13.0"}, cfg.to_dict(), c, nm.tolerance(c, []))


@pytest.fixture(autouse=True)
def own_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes here are not the session's: its summary lists real goldens only."""
    monkeypatch.setattr(goldens, "UPDATED", [])


# --- the machine class and what a run records ---------------------------------------------------------------


def test_the_machine_class_is_each_gpu_model_once_sorted_else_the_cpu_instruction_set(monkeypatch) -> None:
    """On a GPU run the class is the machine's GPU models, each once, in alphabetical order, joined by " + ";
    a CPU run, or a GPU run where no GPU is seen, is "cpu " and the instruction set torch's kernels use."""
    cpu = f"cpu {torch.backends.cpu.get_cpu_capability()}"
    monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA H200", "NVIDIA A100", "NVIDIA H200"])
    assert goldens.hardware("cuda") == "NVIDIA A100 + NVIDIA H200"
    assert goldens.hardware("cpu") == cpu  # the GPUs of the machine do not run a CPU job
    monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA H200"])
    assert goldens.hardware("cuda") == "NVIDIA H200"
    monkeypatch.setattr(machine, "gpu_names", lambda: [])
    assert goldens.hardware("cuda") == cpu


def test_a_run_records_torch_deepspeed_transformers_and_cuda_only_on_a_gpu(monkeypatch) -> None:
    """The versions a golden records are VERSION_FIELDS' four, whatever else the process reports; CUDA's is
    torch's build's on a GPU run and none on a CPU one (a CPU golden does not change with the CUDA build)."""
    monkeypatch.setattr(
        goldens,
        "versions",
        lambda: {"torch": "2.13.0", "transformers": "5.24.0", "deepspeed": "0.19.8", "numpy": "2"},
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert goldens.run_versions("cuda") == {
        "torch": "2.13.0",
        "cuda": "12.8",
        "deepspeed": "0.19.8",
        "transformers": "5.24.0",
    }
    assert goldens.run_versions("cpu") == {
        "torch": "2.13.0",
        "cuda": None,
        "deepspeed": "0.19.8",
        "transformers": "5.24.0",
    }


def test_a_golden_records_the_instruction_set_variables_that_are_set(monkeypatch) -> None:
    """isa_env: ISA_ENV's variables that this process sets to something; one unset or empty is not recorded,
    and a variable ISA_ENV does not name is not either."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert goldens.isa_env() == {"ATEN_CPU_CAPABILITY": "avx2"}


def test_a_machine_key_is_lower_case_each_run_of_other_characters_one_dash_none_at_the_ends() -> None:
    assert goldens.machine_key(" NVIDIA H200 (SXM) ") == "nvidia-h200-sxm"
    assert goldens.machine_key("NVIDIA A100 + NVIDIA H200") == "nvidia-a100-nvidia-h200"
    assert goldens.machine_key("cpu AVX512") == "cpu-avx512"


def test_a_factory_models_colon_is_a_dot_in_the_file_name() -> None:
    """A model given as package.module:function names its golden with a dot for the colon (no colon in a file
    name that Windows checkouts and artifact uploads must hold)."""
    cfg = RunConfig(strategy="ddp", world_size=2, model="mypkg.models:tiny")
    assert goldens.file_name(cfg) == "ddp-ws2-mypkg.models.tiny-fp32.json"


# --- what a mismatch and an update say ----------------------------------------------------------------------


def test_versions_are_described_in_a_fixed_order_leaving_out_those_not_recorded() -> None:
    v = {"transformers": "5.24.0", "cuda": None, "torch": "2.13.0", "deepspeed": "0.19.8"}
    assert goldens.describe_versions(v) == "torch 2.13.0, deepspeed 0.19.8, transformers 5.24.0"
    assert goldens.describe_versions({"cuda": None}) == "no versions recorded"
    assert goldens.describe_versions({}) == "no versions recorded"


def test_a_version_change_names_each_differing_version_then_and_now() -> None:
    then = {"torch": "2.13.0", "cuda": "12.8", "deepspeed": "0.19.8"}
    now = {"torch": "2.14.0", "cuda": "12.8", "transformers": "5.24.0"}
    assert goldens.version_changes(then, now) == [
        "torch 2.13.0 -> 2.14.0",
        "deepspeed 0.19.8 -> None",
        "transformers None -> 5.24.0",
    ]


def test_a_mismatch_names_the_file_both_version_sets_each_change_and_every_moved_value(tmp_path) -> None:
    """The whole message: the verdict, the file, the versions on both sides, what changed between them, and
    every step and metric that moved (beyond tolerance or not), loss before grad_norm."""
    g = golden([6.0, 5.0, 4.0], [2.0, 2.0, 2.0], {"torch": "2.13.0", "deepspeed": "0.19.8"})
    got = curve([6.0, 5.5, 4.0], [2.0, 2.0, 3.0])
    now = {"torch": "2.14.0", "deepspeed": "0.19.9"}
    path = tmp_path / "g.json"
    verdict = nm.compare(g.curve, got, g.tolerance).describe()
    assert verdict.startswith("diverged from step 1: loss 5.0 -> 5.5")
    assert goldens.mismatch(g, got, now, path) == (
        f"{verdict} against {path}; the golden was written with torch 2.13.0, deepspeed 0.19.8, this run has "
        "torch 2.14.0, deepspeed 0.19.9 (changed: torch 2.13.0 -> 2.14.0; deepspeed 0.19.8 -> 0.19.9); "
        "what moved: step 1 loss: 5.0 -> 5.5; step 2 grad_norm: 2.0 -> 3.0"
    )


def test_what_moved_lists_only_the_steps_both_curves_have() -> None:
    old, new = curve([6.0, 5.0, 4.0], [2.0, 2.0, 2.0]), curve([6.0, 5.5], [2.5, 2.0])
    assert goldens.moved(old, new) == ["step 1 loss: 5.0 -> 5.5", "step 0 grad_norm: 2.0 -> 2.5"]


def test_an_update_that_adds_or_drops_steps_counts_each_as_a_moved_value() -> None:
    """A rewrite with one more step and one common value moved: 2 values moved (the moved one and the new
    step), the largest moves over the steps both have."""
    before, after = golden([6.0, 5.0], [2.0, 2.0]), golden([6.0, 5.5, 4.0], [2.0, 2.0, 2.0])
    entry = goldens.update_entry(before, after, "2026-12-02")
    assert entry is not None
    assert entry["values_moved"] == 2
    assert entry["max_abs_diff"] == {"loss": 0.5, "grad_norm": 0.0}
    dropped = goldens.update_entry(after, before, "2026-12-02")
    assert dropped is not None and dropped["values_moved"] == 2


def test_an_updates_largest_move_in_ulps_is_rounded_to_hundredths() -> None:
    """1 + 10/3 float32 ulps is 3.33 ulps of the old value 1.0 (not 3, nor 3.333)."""
    before, after = golden([1.0, 2.0], [2.0, 2.0]), golden([1.0 + EPS * 10 / 3, 2.0], [2.0, 2.0])
    entry = goldens.update_entry(before, after, "2026-12-02")
    assert entry is not None and entry["max_ulps"] == {"loss": 3.33, "grad_norm": 0.0}


def test_a_value_of_zero_that_did_not_move_records_no_ulps() -> None:
    """A gradient norm of exactly 0 (a step that trained nothing) left as it was moved by 0 ulps; it has no
    relative size of its own to divide by."""
    before, after = golden([6.0, 5.0], [0.0, 2.0]), golden([6.0, 5.5], [0.0, 2.0])
    entry = goldens.update_entry(before, after, "2026-12-02")
    assert entry is not None and entry["max_ulps"]["grad_norm"] == 0.0


def test_the_replaced_values_digest_is_sha256_of_the_curves_sorted_json() -> None:
    """The first 16 hex digits of SHA-256 over the curve's JSON with its keys sorted: a history entry's digest
    can be checked against an old file's values by hand."""
    text = b'{"grad_norm": [2.0, 2.1], "loss": [6.0, 5.9]}'
    assert goldens.curve_digest(curve([6.0, 5.9], [2.0, 2.1])) == hashlib.sha256(text).hexdigest()[:16]


# --- reading and writing a golden file ----------------------------------------------------------------------


def test_an_unreadable_golden_names_the_file_the_error_and_the_fix(tmp_path) -> None:
    path = tmp_path / "g.json"
    d = golden([6.0, 5.0], [2.0, 2.0]).to_json()
    d["curve"]["grad_norm"] = [2.0]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        goldens.read(path)
    assert str(e.value) == (
        f"golden {path} is not readable (ValueError: {path}: 2 losses and 1 gradient norms); rewrite it with "
        "pytest --update-goldens"
    )
    del d["curve"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        goldens.read(path)
    assert str(e.value) == (
        f"golden {path} is not readable (KeyError: 'curve'); rewrite it with pytest --update-goldens"
    )


def test_rewriting_a_committed_golden_with_its_own_values_changes_no_byte(tmp_path) -> None:
    """`--update-goldens` on a run that moved nothing leaves every committed file as it is (no diff to
    review): the same fields, order, indentation and final newline, the emulated instruction set kept where
    there is one (the AVX2 goldens, written on an AVX-512 machine) and absent where there is none."""
    files = sorted(GOLDENS.glob("*/*.json"))
    assert files
    for f in files:
        copy = tmp_path / f.parent.name / f.name
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(f, copy)
        g = goldens.read(copy)
        if f.parent.name == "cpu-avx2":
            assert g.isa_env == goldens.ISA_ENV["avx2"], f
        assert goldens.write(copy, g, "2026-12-02") == ["nothing moved"]
        assert copy.read_bytes() == f.read_bytes(), f
    assert "isa_env" not in json.loads((GOLDENS / "cpu-avx512" / "ddp-ws1-gpt2-tiny-fp32.json").read_text())


def test_each_update_appends_to_the_history_oldest_first(tmp_path) -> None:
    path = tmp_path / "g.json"
    goldens.write(path, golden([6.0, 5.0], [2.0, 2.0]), "2026-12-01")
    goldens.write(path, golden([6.0, 5.5], [2.0, 2.0]), "2026-12-02")
    goldens.write(path, golden([6.0, 5.5], [2.0, 2.5]), "2026-12-03")
    history = goldens.read(path).history
    assert [(h["date"], h["max_abs_diff"]) for h in history] == [
        ("2026-12-02", {"loss": 0.5, "grad_norm": 0.0}),
        ("2026-12-03", {"loss": 0.0, "grad_norm": 0.5}),
    ]


def test_writing_a_golden_makes_its_machine_folder_and_any_above_it(tmp_path) -> None:
    path = tmp_path / "goldens" / "cpu-avx512" / "g.json"
    assert goldens.write(path, golden([6.0, 5.0], [2.0, 2.0])) == ["new golden"]
    assert goldens.read(path).curve == curve([6.0, 5.0], [2.0, 2.0])


@pytest.fixture
def local_zone_off_utcs_date(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's local time zone set to one whose calendar date is not UTC's at this hour: 12 hours
    behind before noon UTC, 14 ahead after."""
    zone = "Etc/GMT+12" if datetime.datetime.now(datetime.timezone.utc).hour < 12 else "Etc/GMT-14"
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("local_zone_off_utcs_date")
def test_an_update_is_dated_by_utcs_calendar_not_the_machines(tmp_path) -> None:
    """Without a date given, an update's history entry is today's date in UTC, wherever the machine is."""
    path = tmp_path / "g.json"
    goldens.write(path, golden([6.0, 5.0], [2.0, 2.0]))
    before = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    goldens.write(path, golden([6.0, 5.5], [2.0, 2.0]))
    after = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    (entry,) = goldens.read(path).history
    assert datetime.date.today().isoformat() != before  # the machine's calendar is another day
    assert entry["date"] in (before, after)
