"""Configurations measured side by side: resident at once, their timed windows taking turns, so that what the
host or the device does slower for a few seconds slows every configuration alike and cancels in their ratios.

On a cloud VM the host's speed moved by x1.4-1.7 within seconds (plausibility.py); measured one after the
other, two configurations of a host-bound step then differ by whatever the host did between them, and a
table's speedups moved 5-30% between two back-to-back runs (issue 69). Here every configuration of a group
builds and warms up first (`setup`), then each round times one window of each in turn (`window`), then each
gives its result (`finish`): the interface of matrix.SteppedRun, which the A/B gate interleaves the same way.

* Order. Round r runs the configurations in the order of row r of a Williams design (`rotation`): each
  configuration takes each place in the round equally often and, for an even count, follows every other
  one exactly once, so no configuration always runs right after the same one (or first, after the gap).
* Ratios. Each configuration's tokens/s against the reference's comes from its window and the reference's
  window of the same round: d_r = ln(tokens/s of its window / tokens/s of the reference's), one per round,
  and the effect is their trimmed mean with the Tukey-McLaughlin interval (gate/stats.py's
  trimmed_log_ratio_effect: a window that stalled in one round moves one value, not the mean). Each
  configuration's absolute tokens/s keeps its own interval, from its own windows (results.py).
* Residency. All of a group go at once where their runs fit in device memory together; the memory model
  (gate/fit.py) decides where it covers the model, and otherwise the device itself: a setup that runs out
  of memory ends the attempt. Where they do not fit, each configuration runs in a pair with the reference
  only (`mode` "pairs"), and where even a pair does not fit, alone (`run_alone`, no ratio).

`measure` takes the configurations and a way to start each (a Stepper with its own processes), and returns
per configuration its result, its window times per round and its ratio to the reference: what `distbench
run` prints (matrix.py) and what a history of relative figures can reuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .config import RunConfig
from .gate import stats
from .gate.ab import label_of
from .scaling import baseline_strategy

#: Fewest rounds (windows of each configuration) a side-by-side measurement takes: the ratio's interval and
#: each configuration's own (measure/adaptive.py's median interval) need six.
MIN_ROUNDS = 6
#: Confidence level of the ratios' intervals.
ALPHA = 0.05

ALL, PAIRS, ALONE = "all", "pairs", "alone"


class Stepper(Protocol):
    """One configuration's run in pieces (matrix.SteppedRun), in processes of its own that `close` ends. A
    piece that fails returns the failure result (status "oom" or "error")."""

    def setup(self) -> dict[str, Any] | None: ...

    def window(self, steps: int) -> float | dict[str, Any]: ...

    def finish(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class Measured:
    """One configuration as measured side by side."""

    cfg: RunConfig
    result: dict[str, Any]
    #: wall seconds per step of its window in each round (the slowest rank's), [] where it ran alone
    window_s: list[float] = field(default_factory=list)
    #: its tokens/s against the reference's, from the rounds' paired windows; None for the reference itself
    vs_reference: stats.Effect | None = None


def plan(cfg: RunConfig) -> tuple[int, int]:
    """(rounds, steps per window) for `cfg`: its windows, at least MIN_ROUNDS, enough steps per window that
    the rounds time at least cfg.steps steps, so the loss at step warmup + steps is reached as it is alone."""
    rounds = max(cfg.windows, MIN_ROUNDS)
    return rounds, math.ceil(cfg.steps / rounds)


def rotation(n: int) -> list[list[int]]:
    """The rows of a Williams design for n items: each row a permutation of range(n); every item at every
    place equally often, and each ordered pair of items adjacent equally often (n rows for even n, 2n for
    odd n)."""
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def round_log_ratios(member: list[float], reference: list[float], tokens_ratio: float = 1.0) -> list[float]:
    """ln(tokens/s of `member` / tokens/s of `reference`) per round, from their windows' wall seconds per
    step in the same round; `tokens_ratio`: the member's tokens per step over the reference's."""
    if len(member) != len(reference):
        raise ValueError(f"paired rounds need as many windows a side, got {len(member)} and {len(reference)}")
    return [math.log(tokens_ratio * ref / own) for own, ref in zip(member, reference, strict=True)]


def tokens_per_step(result: dict[str, Any]) -> float:
    """Tokens one optimizer step of a result's configuration trains (its global batch x sequence)."""
    c = result["config"]
    return float(c["global_batch"] * c["seq_len"])


def interleave(
    cfgs: list[RunConfig], start: Callable[[RunConfig], Stepper]
) -> tuple[list[dict[str, Any] | None], list[list[float]], dict[str, Any] | None]:
    """Set up every configuration, time their windows round by round in rotation, finish each.

    Returns the result of each (None where its setup failed: the failure is in its window list's place as
    described below), each one's window wall seconds per step per round, and the first out-of-memory failure
    if a setup or window ran out of memory (then nothing more ran, every stepper is finished and closed, and
    the caller tries fewer at once). A configuration whose setup or window fails otherwise gets its failure
    as its result and leaves the rotation."""
    steppers: list[Stepper] = []
    results: list[dict[str, Any] | None] = [None] * len(cfgs)
    live: list[int] = []
    try:
        for c in cfgs:  # every one's processes start at once; those started are closed whatever follows
            steppers.append(start(c))
        for i, s in enumerate(steppers):
            failed = s.setup()
            if failed is not None and failed.get("status") == "oom":
                return [None] * len(cfgs), [[] for _ in cfgs], failed
            if failed is not None:
                results[i] = failed
            else:
                live.append(i)
        walls: list[list[float]] = [[] for _ in cfgs]
        rounds, steps = plan(cfgs[0])
        order = rotation(len(cfgs))
        for r in range(rounds):
            for i in order[r % len(order)]:
                if i not in live:
                    continue
                got = steppers[i].window(steps)
                if isinstance(got, dict):
                    if got.get("status") == "oom":
                        return [None] * len(cfgs), [[] for _ in cfgs], got
                    results[i] = got
                    live.remove(i)
                else:
                    walls[i].append(got)
        for i in list(live):
            results[i] = steppers[i].finish()
            live.remove(i)
        return results, walls, None
    finally:
        for i in live:
            steppers[i].finish()
        for s in steppers:
            s.close()


def _effect(
    own: list[float], ref: list[float], own_result: dict[str, Any], ref_result: dict[str, Any]
) -> stats.Effect | None:
    """The paired effect on tokens/s of a configuration against the reference, None without enough rounds."""
    if len(own) != len(ref) or len(own) < stats.MIN_RUNS:
        return None
    d = round_log_ratios(own, ref, tokens_per_step(own_result) / tokens_per_step(ref_result))
    return stats.trimmed_log_ratio_effect(np.asarray(d), ALPHA)


def measure(
    cfgs: list[RunConfig],
    references: list[int | None],
    start: Callable[[RunConfig], Stepper],
    run_alone: Callable[[RunConfig], dict[str, Any]],
    *,
    fit_all: bool | None = None,
) -> list[Measured]:
    """Measure `cfgs` side by side, cfgs[i] against cfgs[references[i]] (module doc; None: against none, as a
    reference is against itself), and return them in the order given.

    `fit_all`: whether all runs fit in device memory at once, where a memory model knows (False: pairs from
    the start; None: try all, fall back to pairs on running out of memory). Every result gets a
    `side_by_side` section saying how it was measured, the residents beside it and its ratio to its
    reference with that ratio's interval."""
    if fit_all is not False:
        results, walls, oom = interleave(cfgs, start)
        if oom is None:
            return _measured(cfgs, references, results, walls, ALL, None)
        why = "the runs did not fit in device memory at once"
    else:
        why = "the memory model (gate/fit.py) puts the runs beyond the device's memory at once"
    out: list[Measured | None] = [None] * len(cfgs)
    for i, ref in enumerate(references):
        if ref is None or ref == i:
            continue
        pair = [cfgs[ref], cfgs[i]]
        results, walls, oom = interleave(pair, start)
        if oom is not None:
            out[i] = _alone(cfgs[i], run_alone, why + "; nor did it with its reference")
            continue
        ref_m, own_m = _measured(pair, [None, 0], results, walls, PAIRS, why)
        out[i] = own_m
        if out[ref] is None:
            out[ref] = ref_m
    return [m if m is not None else _alone(c, run_alone, why) for c, m in zip(cfgs, out, strict=True)]


def _alone(cfg: RunConfig, run_alone: Callable[[RunConfig], dict[str, Any]], why: str) -> Measured:
    result = run_alone(cfg)
    result["side_by_side"] = {"mode": ALONE, "why": why}
    return Measured(cfg, result)


def _measured(
    cfgs: list[RunConfig],
    references: list[int | None],
    results: list[dict[str, Any] | None],
    walls: list[list[float]],
    mode: str,
    why: str | None,
) -> list[Measured]:
    """Each configuration's Measured and result section, its ratio from the rounds paired with its reference's."""
    rounds, steps = plan(cfgs[0])
    out = []
    for i, (cfg, result) in enumerate(zip(cfgs, results, strict=True)):
        assert result is not None  # interleave gives every configuration a result once nothing ran out
        ref = references[i]
        ref_result = results[ref] if ref is not None else None
        effect = None
        if (
            ref is not None
            and ref != i
            and result.get("status") == "ok"
            and (ref_result or {}).get("status") == "ok"
        ):
            effect = _effect(walls[i], walls[ref], result, ref_result or {})
        section: dict[str, Any] = {
            "mode": mode,
            "residents": [label_of(c) for c in cfgs],
            "rounds": rounds,
            "window_steps": steps,
            "order": "williams",
            "reference": label_of(cfgs[ref]) if ref is not None and ref != i else None,
            "vs_reference": None
            if effect is None
            else {
                "estimate": effect.estimate,
                "low": effect.low,
                "high": effect.high,
                "level": effect.level,
                "n": effect.n,
            },
        }
        if why:
            section["why"] = why
        result["side_by_side"] = section
        out.append(Measured(cfg, result, walls[i], effect))
    return out


@dataclass
class Group:
    """Configurations measured side by side, each against residents[references[i]]. The group's own rows come
    first; any after them are guests, there only as the baselines of rows at another world size (their own
    rows come from their own group)."""

    residents: list[RunConfig]
    references: list[int | None]


def _workload(cfg: RunConfig) -> str:
    """What a speedup holds fixed: the configuration without strategy, world size and strategy options."""
    d = cfg.to_dict()
    return repr(sorted((k, repr(v)) for k, v in d.items() if k not in ("strategy", "world_size", "options")))


def groups(cfgs: list[RunConfig]) -> list[tuple[Group, list[int]]]:
    """The side-by-side groups of a matrix's configurations: per workload and world size, its configurations
    and the 1-rank baselines they are compared with (scaling.baseline_strategy), each with the indices into
    `cfgs` of its rows (its first residents), smallest world size first."""
    by_workload: dict[str, list[int]] = {}
    for i, c in enumerate(cfgs):
        by_workload.setdefault(_workload(c), []).append(i)
    out = []
    for idx in by_workload.values():
        ones = {cfgs[i].strategy: i for i in idx if cfgs[i].world_size == 1}
        for ws in sorted({cfgs[i].world_size for i in idx}):
            rows = [i for i in idx if cfgs[i].world_size == ws]
            base = {i: ones.get(baseline_strategy(cfgs[i].strategy, set(ones)) or "") for i in rows}
            members = rows + sorted({b for b in base.values() if b is not None and b not in rows})
            refs = [members.index(b) if (b := base.get(i)) is not None and b != i else None for i in members]
            out.append((Group([cfgs[i] for i in members], refs), rows))
    return out
