"""Speedup and scaling efficiency: one rule for every place that states them.

speedup = a configuration's tokens/s over the tokens/s of the 1-GPU baseline of the same workload (model,
precision, sequence, batch, micro-batch, compile). The baseline is `single` at world size 1 when it ran (as
seed 004 measures: against the unwrapped model on one GPU), else the same strategy at world size 1; its
repeats count by their median, less those whose own measurement the plausibility checks flagged (their
`warnings`, plausibility.py): where every baseline run is flagged, no speedup is stated. scaling efficiency
= speedup / world size. A world-size-1 run of a wrapped strategy gets its speedup too (0.9x: what the
wrapper costs on one GPU).

Where `distbench run` measured a result side by side with its baseline (sidebyside.py: their timed windows
interleaved), the speedup is that paired ratio of tokens/s (`side_by_side.vs_reference`), whose interval
holds still when the host's speed moves; elsewhere it is the ratio of the two medians.

`distbench run` and the asv grid write both into each result (`annotate`), the report prints them and the
plausibility checks judge them, all through `baseline_runs` and `baseline_strategy`, so no two places can
disagree.
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


#: The strategy every speedup of a workload is stated against where it ran at world size 1.
BASELINE_STRATEGY = "single"


def baseline_strategy(strategy: str, at_one_rank: set[str]) -> str | None:
    """Which strategy's 1-rank runs a run of `strategy` is measured against, given the strategies that ran
    at world size 1 on its workload: BASELINE_STRATEGY's, else its own, else none."""
    return next((s for s in (BASELINE_STRATEGY, strategy) if s in at_one_rank), None)


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
    strategy = baseline_strategy(
        result["config"].get("strategy"), {r["config"].get("strategy") for r in ones}
    )
    return [r for r in ones if r["config"].get("strategy") == strategy and usable(r)]


def baseline_tokens_per_s(results: list[dict[str, Any]], result: dict[str, Any]) -> float | None:
    runs = baseline_runs(results, result)
    return statistics.median(tokens_per_s(r) for r in runs) if runs else None


def paired_speedup(result: dict[str, Any]) -> float | None:
    """The speedup measured side by side with the baseline (1 + the paired effect on tokens/s), if any."""
    vs = (result.get("side_by_side") or {}).get("vs_reference")
    return 1.0 + vs["estimate"] if vs else None


def speedup(result: dict[str, Any], baseline_tps: float) -> tuple[float, float]:
    """(speedup, scaling efficiency) of `result`: its paired ratio where it was measured side by side with
    the baseline, else its tokens/s over the baseline's."""
    s = paired_speedup(result) or tokens_per_s(result) / baseline_tps
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
