"""Where a strategy falls short, and what its device time says the missing time was.

A configuration on more than one GPU falls short when its tokens/s (median of its runs) is more than GAP below
DDP's at the same world size and workload, or below the figure its reference (a published seed, carried in
each result's `reference`: matrix.Reference) states for it. `explain` reads the gap off its step's breakdown
against DDP's: compute, non-compute (exposed communication and copies) and idle, from every run's device-time
sample, or from a trace where the matrix took one (`trace: [2]` in a matrix file: measure/trace.py), which
also gives of the idle what HTA calls host wait (the GPU waiting for the host to launch): measured, not
guessed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .scaling import tokens_per_s, workload

#: a configuration this far below DDP or its reference figure is a shortfall to explain
GAP = 0.05
#: the parts of a traced step (measure/trace.py's keys, ms per step) a gap is split into, with their names
PARTS = (
    ("compute_ms", "compute"),
    ("non_compute_ms", "non-compute (exposed communication, copies)"),
    ("idle_ms", "idle"),
)


@dataclass
class Shortfall:
    """A configuration more than GAP below `against` (DDP's median tokens/s, or the reference figure)."""

    runs: list[dict[str, Any]]
    against: str  # "ddp", or the reference's title
    target: float

    @property
    def strategy(self) -> str:
        return str(self.runs[0]["config"]["strategy"])

    @property
    def world_size(self) -> int:
        return int(self.runs[0]["config"]["world_size"])

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(tokens_per_s(r) for r in self.runs)

    @property
    def gap(self) -> float:
        """How far below the target, as a fraction of it."""
        return 1 - self.tokens_per_s / self.target


def _cells(results: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """ok runs by (workload, strategy, world size)."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("status") == "ok" and tokens_per_s(r):
            c = r["config"]
            cells.setdefault((workload(r), c["strategy"], c["world_size"]), []).append(r)
    return cells


def shortfalls(results: list[dict[str, Any]], world_sizes: list[int] | None = None) -> list[Shortfall]:
    """Every configuration on more than one GPU (of `world_sizes`, default all) more than GAP below DDP or its
    reference figure, in the order of `results`."""
    cells = _cells(results)
    out = []
    for (wk, strategy, ws), runs in cells.items():
        if ws < 2 or (world_sizes is not None and ws not in world_sizes):
            continue
        targets = []
        ddp = cells.get((wk, "ddp", ws))
        if ddp and strategy != "ddp":
            targets.append(("ddp", statistics.median(tokens_per_s(r) for r in ddp)))
        ref = runs[0].get("reference")
        if ref:
            targets.append((ref["title"], float(ref["tokens_per_s"])))
        out += [s for against, target in targets if (s := Shortfall(runs, against, target)).gap > GAP]
    return out


def ddp_runs(results: list[dict[str, Any]], short: Shortfall) -> list[dict[str, Any]]:
    """DDP's runs at the shortfall's world size and workload: the traced baseline of its explanation."""
    return _cells(results).get((workload(short.runs[0]), "ddp", short.world_size), [])


def _trace(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The runs' step breakdown in ms: a trace's (HTA) where one was taken, else every run's device-time
    sample (measure/devicetime.py: the device's activity in a few profiled steps), which splits the step into
    compute, non-compute (copies, and communication while nothing else ran) and idle (no work on the device:
    in a step with no synchronization inside, waiting for the host), without HTA's host-wait share. On 2x
    H200 that sample alone showed each FSDP and ZeRO-2 shortfall against DDP at 2 GPUs to be idle device
    time, with compute within 25 ms of DDP's."""
    traced = next((r["trace"] for r in runs if (r.get("trace") or {}).get("compute_ms") is not None), None)
    if traced is not None:
        return {**traced, "source": "trace"}
    dt = next(
        (r["device_time"] for r in runs if (r.get("device_time") or {}).get("busy_s") is not None), None
    )
    if dt is None:
        return None
    exposed = dt.get("exposed_comm_s", 0.0)  # results from before it count it as idle
    return {
        "compute_ms": dt["compute_s"] * 1e3,
        "non_compute_ms": (max(0.0, dt["busy_s"] - dt["compute_s"]) + exposed) * 1e3,
        "idle_ms": max(0.0, dt["wall_s"] - dt["busy_s"] - exposed) * 1e3,
        "source": "device time",
    }


def _host_wait(breakdown: dict[str, Any]) -> float | None:
    """A trace's host wait in ms; None from a device-time sample, which cannot tell it within the idle time."""
    return None if breakdown["source"] == "device time" else breakdown.get("host_wait_ms") or 0.0


def explain(results: list[dict[str, Any]], short: Shortfall) -> dict[str, Any] | None:
    """The shortfall's step in ms (its parts, host wait, their sum `step_ms`, `source`: its trace or its
    device-time sample) and, for a strategy other than DDP whose DDP has one too, `vs_ddp`: each part's
    difference, host wait's, and the part that grew most; None where neither was taken."""
    mine = _trace(short.runs)
    if mine is None:
        return None
    out: dict[str, Any] = {k: mine.get(k) or 0.0 for k, _ in PARTS}
    out["step_ms"] = sum(out.values())
    out["host_wait_ms"] = _host_wait(mine)
    out["source"] = mine["source"]
    base = _trace(ddp_runs(results, short)) if short.strategy != "ddp" else None
    if base is not None:
        delta: dict[str, Any] = {k: out[k] - (base.get(k) or 0.0) for k, _ in PARTS}
        waits = (out["host_wait_ms"], _host_wait(base))
        delta["host_wait_ms"] = None if None in waits else waits[0] - waits[1]
        grew = max((k for k, _ in PARTS), key=lambda k: delta[k])
        out["vs_ddp"] = {**delta, "step_ms": sum(delta[k] for k, _ in PARTS), "largest": dict(PARTS)[grew]}
    return out
