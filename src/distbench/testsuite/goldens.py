"""Golden loss and gradient-norm curves per machine and version set, so that a torch, DeepSpeed or transformers
upgrade that moves every strategy and the reference together still shows (gate/numerics.py compares two
installations side by side; this compares one with what an earlier one recorded).

A golden is a small JSON file, tests/goldens/<machine key>/<strategy>-ws<n>-<model>-<precision>.json, holding
what produced it (the key's facts), the configuration, the curve and its tolerance (rounding, and the spread of
runs with non-deterministic kernels measured when it was written). The machine key names the hardware (GPU
model, or the CPU instruction set torch dispatches to) and every version that changes numerics (torch, CUDA,
DeepSpeed, transformers): another version set finds no golden and skips, saying which file it looked for, so
that a lock's upgrade never turns CI red by itself; `pytest --update-goldens` writes them, listing what moved.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..gate.numerics import METRICS, Curve, Tolerance

#: Goldens written in this pytest process, with what moved in each (the terminal summary lists them).
UPDATED: list[tuple[Path, list[str]]] = []


def machine_facts(device_type: str) -> dict[str, str | None]:
    """What a golden depends on besides the code: the hardware and the versions of what computes."""
    import torch

    from .. import machine

    names = machine.gpu_names() if device_type == "cuda" else []
    return {
        "hardware": " + ".join(sorted(set(names)))
        if names
        else f"cpu {torch.backends.cpu.get_cpu_capability()}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device_type == "cuda" else None,
        "deepspeed": machine.package_version("deepspeed"),
        "transformers": machine.package_version("transformers"),
    }


def machine_key(facts: dict[str, str | None]) -> str:
    """A directory name from the facts: lower case, runs of other characters as one dash."""
    parts = [facts["hardware"]] + [
        f"{k}{facts[k]}" for k in ("torch", "cuda", "deepspeed", "transformers") if facts[k]
    ]
    return re.sub(r"[^a-z0-9.]+", "-", "-".join(str(p) for p in parts if p).lower()).strip("-")


def file_name(cfg: RunConfig) -> str:
    return f"{cfg.strategy}-ws{cfg.world_size}-{cfg.model.replace(':', '.')}-{cfg.precision}.json"


@dataclass(frozen=True)
class Golden:
    facts: dict[str, str | None]
    config: dict[str, Any]
    curve: Curve
    tolerance: Tolerance

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.facts,
            "config": self.config,
            "curve": self.curve.to_dict(),
            "tolerance": self.tolerance.to_dict(),
        }


def load(path: Path, cfg: RunConfig) -> tuple[Golden | None, str]:
    """The golden at `path` for `cfg`, or None and why there is none (to skip with). A file that cannot be read
    as a golden is an error naming it (ValueError): it was damaged or edited by hand."""
    if not path.exists():
        return None, f"no golden for this machine and version set: {path} (write it: pytest --update-goldens)"
    try:
        d = json.loads(path.read_text())
        golden = Golden(
            d["key"], d["config"], Curve.from_dict(d["curve"], str(path)), Tolerance.from_dict(d["tolerance"])
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"golden {path} is not readable ({type(e).__name__}: {e}); rewrite it with pytest "
            "--update-goldens"
        ) from None
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


def write(path: Path, golden: Golden) -> list[str]:
    """Write `golden` to `path` and return what moved from the one there before (everything, for a new one)."""
    before = None
    if path.exists():
        try:
            before = Curve.from_dict(json.loads(path.read_text())["curve"], str(path))
        except (ValueError, KeyError, TypeError):
            before = None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden.to_json(), indent=1) + "\n")
    diff = ["new golden"] if before is None else moved(before, golden.curve) or ["nothing moved"]
    UPDATED.append((path, diff))
    return diff
