"""Speedup and scaling efficiency: one rule for every place that states them.

speedup = a configuration's tokens/s over the tokens/s of the 1-GPU baseline of the same workload (model,
precision, sequence, batch, micro-batch, compile). The baseline is `single` at world size 1 when it ran (as
seed 004 measures: against the unwrapped model on one GPU), else the same strategy at world size 1; its
repeats count by their median, less those whose own measurement the plausibility checks flagged (their
`warnings`, plausibility.py): where every baseline run is flagged, no speedup is stated. scaling efficiency
= speedup / world size. A world-size-1 run of a wrapped strategy gets its speedup too (0.9x: what the
wrapper costs on one GPU).

`distbench run` and the asv grid write both into each result (`annotate`), the report prints them and the
plausibility checks judge them, all through `baseline_runs`, so no two places can disagree.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from .results import config_key


def workload(result: dict[str, Any]) -> tuple:
    """config_key without strategy and world size: what a speedup holds fixed."""
    return config_key(result)[2:]


def tokens_per_s(result: dict[str, Any]) -> float:
    """tokens/s of a result, 0.0 where it has none (failed, or not a benchmark)."""
    return float((result.get("metrics") or {}).get("tokens_per_s") or 0.0)


def unflagged(result: dict[str, Any]) -> bool:
    """Whether a run carries no plausibility warning (plausibility.annotate writes them)."""
    return not result.get("warnings")


def baseline_runs(
    results: list[dict[str, Any]],
    result: dict[str, Any],
    usable: Callable[[dict[str, Any]], bool] = unflagged,
) -> list[dict[str, Any]]:
    """The ok, `usable` 1-GPU runs `result`'s speedup is measured against: `single`'s where it ran, else its
    own strategy's; none where every run of that strategy is unusable."""
    ones = [
        r
        for r in results
        if r.get("status") == "ok"
        and tokens_per_s(r)
        and r["config"].get("world_size") == 1
        and workload(r) == workload(result)
    ]
    for strategy in ("single", result["config"].get("strategy")):
        runs = [r for r in ones if r["config"].get("strategy") == strategy]
        if runs:
            return [r for r in runs if usable(r)]
    return []


def baseline_tokens_per_s(results: list[dict[str, Any]], result: dict[str, Any]) -> float | None:
    runs = baseline_runs(results, result)
    return statistics.median(tokens_per_s(r) for r in runs) if runs else None


def speedup(result: dict[str, Any], baseline_tps: float) -> tuple[float, float]:
    """(speedup, scaling efficiency) of `result` against a baseline's tokens/s."""
    s = tokens_per_s(result) / baseline_tps
    return s, s / result["config"]["world_size"]


def annotate(results: list[dict[str, Any]]) -> None:
    """Write speedup and scaling_efficiency into every ok result that has a baseline among `results`."""
    for r in results:
        if r.get("status") != "ok" or not tokens_per_s(r):
            continue
        base = baseline_tokens_per_s(results, r)
        metrics = r["metrics"]
        if base:
            metrics["speedup"], metrics["scaling_efficiency"] = speedup(r, base)
        else:
            metrics.pop("speedup", None)
            metrics.pop("scaling_efficiency", None)
