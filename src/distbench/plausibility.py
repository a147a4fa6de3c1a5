"""Figures that cannot be true, flagged instead of printed as results.

A suite whose job is trustworthy numbers must not show "8.07x on 2 ranks" as a finding: a contended or cold
1-rank reference inflates every speedup against it. `check` reads a set of results (one matrix, or every
result a report loads) and returns, per result id, one warning per implausibility:

- superlinear scaling beyond noise: tokens/s on N ranks above N x a 1-rank reference of the same workload (the
  same strategy on 1 rank, or `single`) by more than the step-time spread of the two;
- superlinear within noise: above linear by more than 10% but inside that spread, an artefact of noisy runs
  (the CPU default run's zero2 at 2 ranks, 5.75x against a 1-rank run whose p90 was 3x its median);
- a speedup within noise: |speedup - 1| no larger than that spread, so it supports neither a gain nor a loss;
- a run far below its repeats: tokens/s below the median of the other runs of its configuration by more
  than their spread (at least 10%); named as a cold start when it is the first run of the set, and as an
  inflating reference when it runs on 1 rank;
- a step-time spread (p10-p90, or the standard deviation) wider than the median step time;
- a host that ran at different speeds: the reference launch work timed around the windows
  (measure/hostspeed.py) varied by more than HOST_SPEED_RATIO, in a step that is not device-bound, whose
  time then moves with the host (one H200 virtual machine's vCPUs ran at two speeds, x1.7 apart).

Noise is the relative p10-p90 width of a run's step times, (p90 - p10) / median.
"""

from __future__ import annotations

import statistics
from typing import Any

from .results import config_key
from .scaling import baseline_runs, tokens_per_s

#: a run must fall this far below the median of its repeats to be flagged, whatever their spread
MIN_GAP = 0.10
#: slowest / fastest reference launch time within one run beyond which the host's speed is called unsteady
HOST_SPEED_RATIO = 1.25


def rel_spread(result: dict[str, Any]) -> float:
    """(p90 - p10) / median of the run's step times; 0 where they were not recorded."""
    st = result.get("step_time_s") or {}
    med, p10, p90 = st.get("median"), st.get("p10"), st.get("p90")
    return (p90 - p10) / med if med and p10 is not None and p90 is not None else 0.0


def _scaling(result: dict[str, Any], refs: list[dict[str, Any]]) -> list[str]:
    """Superlinear or within-noise speedup of a multi-rank result against one reference group."""
    ws, tps = result["config"]["world_size"], tokens_per_s(result)
    ref_tps = statistics.median(t for r in refs if (t := tokens_per_s(r)))
    speedup = tps / ref_tps
    noise = rel_spread(result) + statistics.median(rel_spread(r) for r in refs)
    against = (
        f"{speedup:.2f}x the tokens/s of {refs[0]['config'].get('strategy')} on 1 rank ({ref_tps:,.0f}, "
        f"median of {len(refs)} run(s)) on {ws} ranks"
    )
    if speedup > ws * (1 + noise):
        return [
            f"superlinear: {against}, beyond linear by more than the step-time spread (+-{noise:.0%}); "
            "the 1-rank run was likely cold, contended or short of CPU: rerun it on a quiet machine"
        ]
    if speedup > ws * (1 + MIN_GAP):
        return [
            f"superlinear within noise: {against}, above linear only inside a step-time spread of "
            f"+-{noise:.0%}: an artefact of noisy runs, not a result; take more steps or repeats"
        ]
    if abs(speedup - 1) <= noise:
        return [
            f"speedup within noise: {against}, inside the step-time spread (+-{noise:.0%}): it shows "
            "neither a gain nor a loss; take more steps or repeats"
        ]
    return []


def _below_repeats(result: dict[str, Any], others: list[dict[str, Any]], first: bool) -> list[str]:
    tps = tokens_per_s(result)
    vals = [t for r in others if (t := tokens_per_s(r))]
    med = statistics.median(vals)
    gap = max(MIN_GAP, (max(vals) - min(vals)) / med)
    if tps >= med * (1 - gap):
        return []
    why = f"{tps:,.0f} tokens/s, {1 - tps / med:.0%} below the median of its {len(vals)} other repeat(s) ({med:,.0f})"
    if first:
        why += ": the first run of the set, a cold start; add warm-up steps or discard it"
    if result["config"].get("world_size") == 1:
        why += ": as a 1-rank reference it inflates every speedup measured against it"
    return [f"slower than its repeats: {why}"]


def _spread(result: dict[str, Any]) -> list[str]:
    st = result.get("step_time_s") or {}
    med = st.get("median")
    if not med:
        return []
    width = max(st.get("p90", med) - st.get("p10", med), st.get("std") or 0.0)
    if width <= med:
        return []
    return [
        f"step times spread wider than their median: p10-p90 {st.get('p10', 0) * 1000:.1f}-"
        f"{st.get('p90', 0) * 1000:.1f} ms, std {(st.get('std') or 0) * 1000:.1f} ms, median "
        f"{med * 1000:.1f} ms; its throughput is not a measurement (contention? too few steps?)"
    ]


def _host_speed(result: dict[str, Any]) -> list[str]:
    if (result.get("regime") or {}).get("regime") == "device-bound":
        return []
    speed = (result.get("host") or {}).get("speed") or []
    refs = [x for rank in speed for w in rank if w for x in w.get("ref_s") or []]
    if len(refs) < 2 or min(refs) <= 0 or max(refs) / min(refs) <= HOST_SPEED_RATIO:
        return []
    return [
        f"the host ran at different speeds: the same launch work took {min(refs) * 1000:.2f}-"
        f"{max(refs) * 1000:.2f} ms (x{max(refs) / min(refs):.2f}) around this run's windows, and a step that "
        "is not device-bound moves with it; compare such runs with `distbench ab --bind-cpus` (interleaved "
        "windows on one core), not as separate runs"
    ]


def check(results: list[dict[str, Any]]) -> dict[str, list[str]]:
    """{result id: [warning, ...]} for every ok result with something implausible; others are absent."""
    ok = [r for r in results if r.get("status") == "ok" and tokens_per_s(r)]
    order = {id(r): i for i, r in enumerate(ok)}  # run order breaks ties of `created` (whole seconds)
    first = min(ok, key=lambda r: (r.get("created", ""), order[id(r)]), default=None)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(config_key(r), []).append(r)
    out: dict[str, list[str]] = {}
    for r in ok:
        c = r["config"]
        found = _spread(r) + _host_speed(r)
        others = [o for o in groups[config_key(r)] if o is not r]
        if others:
            found += _below_repeats(r, others, first=r is first)
        if c.get("world_size", 1) > 1:
            refs = baseline_runs(ok, r)  # the speedup the results and the report state (scaling.py)
            found += _scaling(r, refs) if refs else []
        if found:
            out[r["id"]] = found
    return out


def annotate(results: list[dict[str, Any]]) -> None:
    """Set each result's `warnings` list from `check` over the whole set (empty where nothing is wrong)."""
    found = check(results)
    for r in results:
        r["warnings"] = found.get(r["id"], [])
