"""Figures that cannot be true, flagged instead of printed as results.

A suite whose job is trustworthy numbers must not show "8.07x on 2 ranks" as a finding: a contended or cold
1-rank reference inflates every speedup against it. `check` reads a set of results (one matrix, or every
result a report loads) and returns, per result id, one warning per implausibility.

A run's own measurement (`measurement_warnings`):

- a run far below its repeats: tokens/s below the median of the other runs of its configuration by more
  than their spread (at least 10%); named as a cold start when it is the first run of the set, and as an
  inflating reference when it runs on 1 rank;
- a step-time spread (p10-p90, or the standard deviation) wider than the median step time;
- a contended host: the training threads (main and autograd, measure/hostspeed.py's ThreadTimes) of some rank
  waited on a CPU run queue for more than CONTENDED_SHARE of the timed windows: another process had their
  cores;
- a host that ran at different speeds and moved the step: on one rank, the reference launch work timed around
  the windows (measure/hostspeed.py) varied by more than HOST_SPEED_RATIO, in a step that is not
  device-bound, and the step times spread by more than HOST_MOVED; for a run timed in six or more windows
  this is a note on its interval (`notes`), not a flag.

What would not hold on a repeat (`notes`, footnoted in the table like the flags): a speedup measured side by
side whose 95% interval is wider than +/-SPEEDUP_HOLD, or tokens/s whose interval is wider than
+/-TOKENS_HOLD, each with the reason: a repeat of the run may land anywhere in that interval. And of a whole
table (`host_bound`): a DDP row (else the reference's) whose device was busy less than DEVICE_BOUND_RATIO
of its step, where the speedups measure the host's launch speed as much as the strategies.

Its speedup against the 1-rank reference of its workload (scaling.py), at every world size but the
reference's own runs:

- superlinear beyond noise: above world size x the reference by more than the step-time spread of the two
  (at 1 rank: a wrapped strategy faster than the unwrapped model);
- superlinear within noise: above linear by more than 10% but inside that spread, an artefact of noisy runs
  (the CPU default run's zero2 at 2 ranks, 5.75x against a 1-rank run whose p90 was 3x its median);
- a speedup within noise (more than 1 rank): |speedup - 1| no larger than that spread, so it supports
  neither a gain nor a loss;
- a flagged reference: every 1-rank reference run has a measurement warning of its own, so no speedup is
  stated (scaling.py leaves flagged runs out of the baseline).

Noise is the relative p10-p90 width of a run's step times, (p90 - p10) / median, summed over the two; for a
speedup measured side by side with its reference (sidebyside.py), the paired speedup and the larger half of
its 95% interval.

Why the host checks read as they do: on an idle H200 virtual machine the reference launch work moved up to
x1.49 between two readings of one process while the step times of the same runs spread 0.0-5.9% (the probes
under results/recommend-h200-2026-11-24): a vCPU's speed changes within seconds, whatever the binding (a loop
pinned to one vCPU took 3.05-6.06 ms, results/gate-host-h200-2026-11-24/cpuprobe.log), and moves a step only
where the host paces it. The reference alone flagged every step that was not device-bound; the step must
have moved too. The training threads' run-queue wait is what a CPU-bound neighbour leaves: 0.0-0.2% of the
timed time in those idle unbound runs.
"""

from __future__ import annotations

import statistics
from typing import Any

from .measure.devicetime import DEVICE_BOUND_RATIO
from .results import config_key
from .runtime.affinity import ENV as BIND_ENV
from .scaling import baseline_runs, tokens_per_s

#: a run must fall this far below the median of its repeats to be flagged, whatever their spread
MIN_GAP = 0.10
#: slowest / fastest reference launch time of one rank beyond which the host's speed is called unsteady
HOST_SPEED_RATIO = 1.25
#: ... and the step times' relative p10-p90 spread beyond which the step moved with it
HOST_MOVED = 0.10
#: the share of the timed windows a rank's training threads may wait for a CPU before the host is contended
CONTENDED_SHARE = 0.05
#: half-widths of the 95% intervals beyond which a repeat of the run need not hold: speedup, tokens/s
SPEEDUP_HOLD = 0.03
TOKENS_HOLD = 0.05


def rel_spread(result: dict[str, Any]) -> float:
    """(p90 - p10) / median of the run's step times; 0 where they were not recorded."""
    st = result.get("step_time_s") or {}
    med, p10, p90 = st.get("median"), st.get("p10"), st.get("p90")
    return (p90 - p10) / med if med and p10 is not None and p90 is not None else 0.0


def _scaling(result: dict[str, Any], refs: list[dict[str, Any]]) -> list[str]:
    """Superlinear or within-noise speedup of a result against one reference group. At 1 rank only above
    it: a wrapped strategy at the unwrapped model's speed is what one GPU should show."""
    ws, tps = result["config"]["world_size"], tokens_per_s(result)
    ref_tps = statistics.median(t for r in refs if (t := tokens_per_s(r)))
    vs = (result.get("side_by_side") or {}).get("vs_reference")
    if vs:  # measured side by side with it: the speedup scaling.py states, and its paired interval as noise
        speedup = 1 + vs["estimate"]
        noise = max(_half_widths(speedup, 1 + vs["low"], 1 + vs["high"]))
    else:
        speedup = tps / ref_tps
        noise = rel_spread(result) + statistics.median(rel_spread(r) for r in refs)
    against = (
        f"{speedup:.2f}x the tokens/s of {refs[0]['config'].get('strategy')} on 1 rank ({ref_tps:,.0f}, "
        f"median of {len(refs)} run(s)) on {ws} rank(s)"
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
    if ws > 1 and abs(speedup - 1) <= noise:
        return [
            f"speedup within noise: {against}, inside the step-time spread (+-{noise:.0%}): it shows "
            "neither a gain nor a loss; take more steps or repeats"
        ]
    return []


def _flagged_reference(refs: list[dict[str, Any]], own: dict[int, list[str]]) -> list[str]:
    first = own[id(refs[0])][0]
    return [
        f"against a flagged reference: every 1-rank run of {refs[0]['config'].get('strategy')} it would be "
        f'measured against is flagged itself ("{first.split(":")[0]}"), so it has no speedup or efficiency; '
        "rerun the reference"
    ]


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


def _speed_windows(result: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per rank, the host-speed readings of its timed windows (measure/hostspeed.py; results.py keeps them)."""
    return [[w for w in rank if w] for rank in (result.get("host") or {}).get("speed") or []]


def _contended(result: dict[str, Any]) -> list[str]:
    """The run-queue wait of the most delayed rank's training threads over the run's timed steps. Not under
    pinned binding, whose main and autograd threads share one CPU by design and wait for each other."""
    timed = sum((result.get("step_time_s") or {}).get("steps") or [])
    mode = ((result.get("env") or {}).get("env") or {}).get(BIND_ENV)
    if not timed or mode == "pinned":
        return []
    waits = [
        sum(w["threads"]["main_wait_s"] + w["threads"]["autograd_wait_s"] for w in rank if w.get("threads"))
        for rank in _speed_windows(result)
    ]
    worst = max(waits, default=0.0)
    if worst <= CONTENDED_SHARE * timed:
        return []
    return [
        f"a contended host: the training threads of rank {waits.index(worst)} waited {worst * 1000:,.0f} ms "
        f"for a CPU, {worst / timed:.0%} of the {timed:.2f} s of timed steps: another process had their "
        "cores; rerun on a quiet machine"
    ]


def _host_speed(result: dict[str, Any]) -> list[str]:
    """The host-speed finding as a flag, for a run whose figure has no interval of its own (fewer than six
    windows): nothing else says how far the host moved it."""
    found = _host_speed_finding(result)
    return [found] if found and not _has_interval(result) else []


def _has_interval(result: dict[str, Any]) -> bool:
    return bool((result.get("step_time_s") or {}).get("interval"))


def notes(result: dict[str, Any]) -> list[str]:
    """What widened a run's interval, for a run that has one: the host-speed finding is then a reason beside
    the figure, not a flag. Timed in six or more windows, the figure is their median and its 95% interval
    holds the windows a slower host stretched; on one H200 the flag fired on 8 of 11 rows of an idle run
    (every rank's readings of twelve windows compared), whose intervals held the next repeats' figures.
    Then the figures whose interval is too wide for a repeat to hold (`repeat_notes`)."""
    found = _host_speed_finding(result)
    wide = [f"its interval is wide because {found}"] if found and _has_interval(result) else []
    return wide + repeat_notes(result)


def _half_widths(estimate: float, low: float, high: float) -> tuple[float, float]:
    """(how far below, how far above) `estimate` an interval reaches, as fractions of it."""
    return 1 - low / estimate, high / estimate - 1


def repeat_notes(result: dict[str, Any]) -> list[str]:
    """The run's figures whose 95% interval is wider than a repeat must hold to (SPEEDUP_HOLD on a paired
    speedup, TOKENS_HOLD on tokens/s), each with its reason: a repeat may land anywhere inside."""
    out = []
    vs = (result.get("side_by_side") or {}).get("vs_reference")
    if vs:
        below, above = _half_widths(1 + vs["estimate"], 1 + vs["low"], 1 + vs["high"])
        if max(below, above) > SPEEDUP_HOLD:
            out.append(
                f"its speedup may not repeat: 95% interval -{below:.1%}/+{above:.1%} over {vs['n']} rounds "
                f"(wider than +/-{SPEEDUP_HOLD:.0%}), as its windows moved against "
                f"{result['side_by_side']['reference']}'s in the same rounds: the step itself varies; take "
                "more windows"
            )
    st = result.get("step_time_s") or {}
    if st.get("interval") and (result.get("metrics") or {}).get("step_time_s"):
        lo, hi = st["interval"]
        slower, faster = _half_widths(1 / result["metrics"]["step_time_s"], 1 / hi, 1 / lo)
        if max(slower, faster) > TOKENS_HOLD:
            why = (
                "the host ran at different speeds (above)"
                if _host_speed_finding(result)
                else f"its windows' times spread {rel_spread(result):.0%} (p10-p90)"
            )
            out.append(
                f"its tokens/s may not repeat: 95% interval -{slower:.1%}/+{faster:.1%} (wider than "
                f"+/-{TOKENS_HOLD:.0%}), as {why}"
            )
    return out


def host_bound(results: list[dict[str, Any]]) -> str | None:
    """One line for a table whose rows are host-bound: DDP's device (at its smallest world size; else the
    speedups' reference's, else the first row's) busy less than DEVICE_BOUND_RATIO of its step; None where it
    was busier, or nothing sampled the device."""
    ok = [
        r
        for r in results
        if r.get("status") == "ok" and (r.get("metrics") or {}).get("busy_ratio") is not None
    ]
    if not ok:
        return None
    ddp = sorted(
        (r for r in ok if r["config"].get("strategy") == "ddp"), key=lambda r: r["config"]["world_size"]
    )
    ref = baseline_runs(ok, ok[0])
    row = (ddp or ref or ok)[0]
    busy = row["metrics"]["busy_ratio"]
    if busy >= DEVICE_BOUND_RATIO:
        return None
    c = row["config"]
    return (
        f"Host-bound: the device was busy {busy:.0%} of {c['strategy']} ws{c['world_size']}'s step (under "
        f"{DEVICE_BOUND_RATIO:.0%}), so the speedups here measure the host's launch speed as much as the "
        "strategies; a larger model or micro-batch measures the GPU"
    )


def _host_speed_finding(result: dict[str, Any]) -> str | None:
    """A rank whose reference launch work moved by more than HOST_SPEED_RATIO over the run, in a step that is not
    device-bound and whose step times moved too."""
    if (result.get("regime") or {}).get("regime") == "device-bound" or rel_spread(result) <= HOST_MOVED:
        return None
    ratios = []
    for rank in _speed_windows(result):
        refs = [x for w in rank for x in w.get("ref_s") or []]
        if len(refs) >= 2 and min(refs) > 0:
            ratios.append((max(refs) / min(refs), min(refs), max(refs)))
    if not ratios or max(ratios)[0] <= HOST_SPEED_RATIO:
        return None
    ratio, fast, slow = max(ratios)
    return (
        f"the host ran at different speeds: the same launch work took {fast * 1000:.2f}-{slow * 1000:.2f} ms "
        f"(x{ratio:.2f}) on one rank around this run's windows, and its step times, not device-bound, spread "
        f"{rel_spread(result):.0%} with it; compare such runs with `distbench ab --bind-cpus` (interleaved "
        "windows on one core), not as separate runs"
    )


def measurement_warnings(result: dict[str, Any], repeats: list[dict[str, Any]], first: bool) -> list[str]:
    """What is wrong with a run's own measurement, whatever it is compared with; `repeats` are the other runs
    of its configuration, `first` whether it ran first of the set."""
    found = _spread(result) + _contended(result) + _host_speed(result)
    return found + (_below_repeats(result, repeats, first) if repeats else [])


def check(results: list[dict[str, Any]]) -> dict[str, list[str]]:
    """{result id: [warning, ...]} for every ok result with something implausible; others are absent."""
    ok = [r for r in results if r.get("status") == "ok" and tokens_per_s(r)]
    order = {id(r): i for i, r in enumerate(ok)}  # run order breaks ties of `created` (whole seconds)
    first = min(ok, key=lambda r: (r.get("created", ""), order[id(r)]), default=None)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(config_key(r), []).append(r)
    own = {
        id(r): measurement_warnings(r, [o for o in groups[config_key(r)] if o is not r], r is first)
        for r in ok
    }
    out: dict[str, list[str]] = {}
    for r in ok:
        found = list(own[id(r)])
        # the speedup the results and the report state (scaling.py), from the references' own measurements
        refs = baseline_runs(ok, r, usable=lambda x: not own[id(x)])
        candidates = refs or baseline_runs(ok, r, usable=lambda x: True)
        if candidates and config_key(candidates[0]) != config_key(r):  # no reference against itself
            found += _scaling(r, refs) if refs else _flagged_reference(candidates, own)
        if found:
            out[r["id"]] = found
    return out


def annotate(results: list[dict[str, Any]]) -> None:
    """Set each result's `warnings` list from `check` over the whole set (empty where nothing is wrong)."""
    found = check(results)
    for r in results:
        r["warnings"] = found.get(r["id"], [])
        r["notes"] = notes(r) if r.get("status") == "ok" else []
