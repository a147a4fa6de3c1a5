"""Golden loss and gradient-norm curves per machine class, so that a torch, DeepSpeed or transformers upgrade
that moves every strategy and the reference together still shows (gate/numerics.py compares two
installations side by side; this compares one with what an earlier one recorded).

A golden is a small JSON file, tests/goldens/<machine class>/<strategy>-ws<n>-<model>-<precision>.json. Its
folder is keyed by what decides the figures on that class of machine: the GPU model, or on CPU the instruction
set torch's kernels dispatch to (torch.backends.cpu.get_cpu_capability(): AVX2 and AVX-512 round differently).
The file holds the configuration, the curve, its tolerance (rounding, and the spread of runs with
non-deterministic kernels measured when it was written), the versions it was written with, and a history of
its deliberate updates. Package versions are not in the key: after an upgrade the run is compared with the
golden, and a mismatch names the versions on both sides. `pytest --update-goldens` rewrites a golden and
appends what moved, between which versions, to its history.

Fields missing from a golden written before they existed take their documented defaults: a configuration
field its RunConfig default (same_computation), `versions` the versions its old key held, `history` none.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..gate.numerics import FP32_EPS, METRICS, Curve, Tolerance, compare, versions

#: Goldens written in this pytest process, with what moved in each (the terminal summary lists them).
UPDATED: list[tuple[Path, list[str]]] = []

#: The versions a golden records, in the order its messages list them.
VERSION_FIELDS = ("torch", "cuda", "deepspeed", "transformers")

#: How to run this machine's CPU kernels as another instruction set's machine would: torch's own kernels
#: (ATEN_CPU_CAPABILITY), MKL's GEMMs and oneDNN's, each of which picks its code path by itself. On an AVX-512
#: machine, torch's kernels at AVX2 moved gpt2-tiny's losses by up to an ulp, and MKL's at AVX2 moved them
#: again: an AVX2 golden written with torch's alone would not be an AVX2 machine's. Used to write and check
#: the AVX2 goldens on an AVX-512 machine (scripts/goldens_cpu.sh).
ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def hardware(device_type: str) -> str:
    """The machine class: the GPU model(s), or the CPU instruction set torch's kernels run on."""
    import torch

    from .. import machine

    names = machine.gpu_names() if device_type == "cuda" else []
    return " + ".join(sorted(set(names))) if names else f"cpu {torch.backends.cpu.get_cpu_capability()}"


def run_versions(device_type: str) -> dict[str, str | None]:
    """The versions of what computes in this process (gate/numerics.py's), with CUDA's on a GPU."""
    import torch

    v = {"cuda": torch.version.cuda if device_type == "cuda" else None, **versions()}
    return {k: v.get(k) for k in VERSION_FIELDS}


def isa_env() -> dict[str, str]:
    """The settings of ISA_ENV's variables in this process: a golden written under them records them."""
    names = {k for env in ISA_ENV.values() for k in env}
    return {k: os.environ[k] for k in sorted(names) if os.environ.get(k)}


def machine_key(hardware: str) -> str:
    """A directory name from the machine class: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9.]+", "-", hardware.lower()).strip("-")


def file_name(cfg: RunConfig) -> str:
    return f"{cfg.strategy}-ws{cfg.world_size}-{cfg.model.replace(':', '.')}-{cfg.precision}.json"


def describe_versions(v: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v[k]}" for k in VERSION_FIELDS if v.get(k)) or "no versions recorded"


@dataclass(frozen=True)
class Golden:
    hardware: str
    versions: dict[str, str | None]
    config: dict[str, Any]
    curve: Curve
    tolerance: Tolerance
    #: each deliberate update that moved a value or changed a version (update_entry), oldest first
    history: list[dict[str, Any]] = field(default_factory=list)
    #: the ISA_ENV variables set where it was written (an instruction set emulated), if any
    isa_env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": {"hardware": self.hardware},
            "versions": self.versions,
            **({"isa_env": self.isa_env} if self.isa_env else {}),
            "config": self.config,
            "curve": self.curve.to_dict(),
            "tolerance": self.tolerance.to_dict(),
            "history": self.history,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], what: str) -> Golden:
        """A golden from its file's JSON; one written before versions left the key has them read from there."""
        return cls(
            str(d["key"]["hardware"]),
            dict(d["versions"]) if "versions" in d else {k: d["key"].get(k) for k in VERSION_FIELDS},
            dict(d["config"]),
            Curve.from_dict(d["curve"], what),
            Tolerance.from_dict(d["tolerance"]),
            list(d.get("history", [])),
            dict(d.get("isa_env", {})),
        )


def read(path: Path) -> Golden:
    """The golden at `path`; ValueError naming the file when it cannot be read as one (damaged or edited)."""
    try:
        return Golden.from_json(json.loads(path.read_text()), str(path))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"golden {path} is not readable ({type(e).__name__}: {e}); rewrite it with pytest "
            "--update-goldens"
        ) from None


def load(path: Path, cfg: RunConfig) -> tuple[Golden | None, str]:
    """The golden at `path` for `cfg`, or None and why there is none (to skip with). A file that cannot be read
    as a golden is an error naming it (ValueError)."""
    if not path.exists():
        return None, f"no golden for this machine class: {path} (write it: pytest --update-goldens)"
    golden = read(path)
    if not same_computation(golden.config, cfg):
        return None, f"the golden {path} was written for another configuration (rewrite it: --update-goldens)"
    return golden, ""


#: RunConfig fields that decide how a run is timed, not what it computes
TIMING_ONLY = frozenset(
    {"windows", "until_ci", "max_windows", "timing", "device_time_steps", "gc_during_steps"}
)


def same_computation(written_for: dict[str, Any], cfg: RunConfig) -> bool:
    """Whether a golden written for the configuration `written_for` holds for `cfg`: the same fields that
    decide what is computed, a field added to RunConfig since counting at its default. Comparing every field
    made each new one (the timing's until_ci) turn every committed golden into a skip."""
    now = {k: v for k, v in cfg.to_dict().items() if k not in TIMING_ONLY}
    defaults = RunConfig().to_dict()
    then = {k: written_for.get(k, defaults[k]) for k in now}
    return then == now and set(written_for) - TIMING_ONLY <= set(now)


def moved(old: Curve, new: Curve) -> list[str]:
    """Every step and metric whose value changed, as `step S METRIC: OLD -> NEW`."""
    return [
        f"step {s} {m}: {a!r} -> {b!r}"
        for m in METRICS
        for s, (a, b) in enumerate(zip(old.values(m), new.values(m), strict=False))
        if a != b
    ]


def version_changes(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each version that differs, as `NAME THEN -> NOW`."""
    return [f"{k} {then.get(k)} -> {now.get(k)}" for k in VERSION_FIELDS if then.get(k) != now.get(k)]


def mismatch(golden: Golden, got: Curve, now: dict[str, Any], path: Path) -> str | None:
    """None when `got` is within the golden's tolerance; else what diverged, against which file, the versions
    on both sides (the golden's and this run's) and every value that moved."""
    verdict = compare(golden.curve, got, golden.tolerance)
    if verdict.divergence is None:
        return None
    changed = version_changes(golden.versions, now)
    return (
        f"{verdict.describe()} against {path}; the golden was written with {describe_versions(golden.versions)}, "
        f"this run has {describe_versions(now)} ("
        + (f"changed: {'; '.join(changed)}" if changed else "the same versions")
        + "); what moved: "
        + "; ".join(moved(golden.curve, got))
    )


def curve_digest(curve: Curve) -> str:
    """A short digest of a curve's values, to name the values an update replaced."""
    return hashlib.sha256(json.dumps(curve.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def update_entry(before: Golden, after: Golden, today: str) -> dict[str, Any] | None:
    """What an update changed, for the golden's history: the date, the versions before and after, how many
    values moved, the largest move per metric (absolute and in float32 ulps of the old value), and the digest
    of the values replaced. None when no value moved and no version changed (nothing to record)."""
    pairs = {m: list(zip(before.curve.values(m), after.curve.values(m), strict=False)) for m in METRICS}
    diffs = {m: [abs(new - old) for old, new in pairs[m]] for m in METRICS}
    count = sum(d != 0 for ds in diffs.values() for d in ds) + abs(
        len(before.curve.loss) - len(after.curve.loss)
    )
    if not count and before.versions == after.versions:
        return None
    ulps = {
        m: [abs(new - old) / (FP32_EPS * abs(old)) if old else 0.0 for old, new in pairs[m]] for m in METRICS
    }
    return {
        "date": today,
        "versions_before": before.versions,
        "versions_after": after.versions,
        "values_moved": int(count),
        "max_abs_diff": {m: max(diffs[m], default=0.0) for m in METRICS},
        "max_ulps": {m: round(max(ulps[m], default=0.0), 2) for m in METRICS},
        "replaced_digest": curve_digest(before.curve),
    }


def write(path: Path, golden: Golden, today: str | None = None) -> list[str]:
    """Write `golden` to `path`, carrying the history of the one there before and appending what this update
    moved; returns what moved, for the session's summary. An unreadable old file is replaced, said so."""
    today = today or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    before: Golden | None = None
    note: list[str] = []
    if path.exists():
        try:
            before = read(path)
        except ValueError:
            note = ["the file before was unreadable"]
    entry = update_entry(before, golden, today) if before else None
    history = (before.history if before else []) + ([entry] if entry else [])
    golden = dataclasses.replace(golden, history=history)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden.to_json(), indent=1) + "\n")
    if before is None:
        diff = [*note, "new golden"]
    elif entry is None:
        diff = ["nothing moved"]
    else:
        changed = version_changes(entry["versions_before"], entry["versions_after"])
        diff = [
            f"{entry['values_moved']} values moved (largest: "
            + ", ".join(f"{m} {entry['max_ulps'][m]:g} ulps" for m in METRICS)
            + ")",
            *(changed or ["the same versions"]),
        ]
    UPDATED.append((path, diff))
    return diff
