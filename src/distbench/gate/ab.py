"""The interleaved A/B gate: base and head alternate on the same GPUs until each configuration is decided or
the time budget runs out.

Each round plays one pair of runs per configuration, one of each variant, in alternating order (AB, BA, ...),
so slow drift (SM clocks moved 1665-1875 MHz under load on H200) and order effects cancel within pairs.
With `servers` (the default of `distbench ab`) the pair's timed windows interleave too: both variants build
and warm up at once, then take turns window by window (ABBA), and the round's step-time effect is the
trimmed mean of the adjacent windows' log ratios (stats.interleaved_effect). On one H200 virtual machine the
host's speed flipped by x1.7 within seconds, so whole runs of a host-bound step spread 10-20% while windows
that take turns on one core (runtime/affinity.py, "pinned") agreed within a few percent. A configuration
whose two runs do not fit in device memory at once falls back to whole runs.

Rounds go over every undecided configuration; after `min_pairs` rounds, and every `look_every` rounds after
that, each configuration is judged (gate/stats.py) and leaves the rotation once every gated metric is
decided. Between rounds both variants get fresh rank processes, so a bias of one process is noise across
pairs rather than a difference between the variants (an A/A run on one pair of long-lived pools flagged a
30% difference in host CPU time per step). The family-wise false-alarm rate `alpha` is divided over
configurations, gated metrics and the looks the schedule allows, plus the final judgement of a configuration
whose budget ran out between looks.

Gated metrics follow the configuration's regime, read from the base's first run (the roles are each metric's
`ab` in distbench/metrics.py):
    always                       step_time_s (the window wall clock per step: what users get)
    with a device sample         one device-side candidate, fixed before the first pair (DEVICE_METRIC by
                                 world size, or the comparison's choice): device_compute_s (kernels other
                                 than NCCL, busiest rank) at one rank, where nothing communicates;
                                 device_compute_floor_s (each kernel at its least disturbed) at two or more,
                                 where NCCL's waiting kernels slow the compute beside them
                                 (measure/devicetime.py); the other candidates are reported
    host-bound, with counters    host_instructions (user-mode instructions of the training thread per step)
    on GPUs                      mem_allocated_peak_bytes (nearly exact from run to run, so any change of at
                                 least min_effect is found in the first look; its interval is trimmed,
                                 stats.trimmed_log_ratio_effect, as a run in six may jump by a buffer)
Reported beside them, not gated: tokens_per_s, host_cpu_s, step_gcycles (cycles per step, where NVML read
the clock), device_comm_s and busy_ratio.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..config import RunConfig, label_of  # label_of: the name every report of the gate gives a configuration
from ..errors import error_line
from ..metrics import METRICS, names
from . import stats
from .numerics import EXIT_DIVERGED, NumericsOutcome, exit_status

#: The metric whose pairs come from interleaved windows (the window wall clock per step).
WINDOWED = "step_time_s"

#: Pairs before the first judgement, most pairs, pairs between judgements (`distbench ab`'s defaults).
MIN_PAIRS, MAX_PAIRS, LOOK_EVERY = 6, 12, 3

#: The gated device-side metric by world size (1, and 2 or more), unless a comparison names another.
DEVICE_METRIC = {1: "device_compute_s", 2: "device_compute_floor_s"}


def device_metric(world_size: int, chosen: str | None = None) -> str:
    """The device-side metric a configuration of `world_size` ranks is gated on: `chosen`, else DEVICE_METRIC's."""
    return chosen or DEVICE_METRIC[min(world_size, 2)]


@dataclass
class Pair:
    order: str  # "AB" or "BA"
    base: dict[str, Any]
    head: dict[str, Any]
    #: interleaved windows: ln(head / base) of each pair of adjacent windows' wall clock per step
    window_log_ratios: list[float] | None = None


class Servers(Protocol):
    """The two variants' servers as the window interleaving drives them (gate/serve.py's requests)."""

    def post(self, side: str, request: dict[str, Any]) -> None:
        """Send `request` to the "base" or "head" server without waiting."""

    def reply(self, side: str) -> dict[str, Any]:
        """That server's reply; a failure is {"status": "error" or "oom", "error": ...}."""


@dataclass
class Row:
    label: str
    metric: str
    gated: bool
    base: list[float]
    head: list[float]
    verdict: str
    effect: stats.Effect | None = None


@dataclass
class ConfigOutcome:
    cfg: RunConfig
    label: str
    pairs: list[Pair] = field(default_factory=list)
    gated: tuple[str, ...] = ()
    regime: dict[str, Any] | None = None
    rows: list[Row] = field(default_factory=list)
    error: str | None = None
    interleave: str = "runs"  # "windows" or "runs": how its pairs were played
    note: str | None = None  # why it fell back from windows to runs
    failed: str | None = None  # "base" or "head": whose run failed, with `error`
    only: tuple[str, ...] | None = None  # the metrics to gate instead of the regime's (run_ab's `gate`)
    device: str = DEVICE_METRIC[1]  # the device-side candidate gated (device_metric)

    @property
    def verdict(self) -> str:
        if self.error:
            return stats.UNDECIDED
        gated = [r.verdict for r in self.rows if r.gated]
        for v in (stats.REGRESSION, stats.UNDECIDED, stats.IMPROVEMENT):
            if v in gated:
                return v
        return stats.UNCHANGED if gated else stats.UNDECIDED


def gated_metrics(
    first_base: dict[str, Any], only: tuple[str, ...] | None = None, device: str = DEVICE_METRIC[1]
) -> tuple[str, ...]:
    """The registry's gated metrics (`ab` "gate", the device-side candidate `device`, and "gate-host-bound"
    unless the configuration is device-bound) that the base's first run has, in registry order; a base
    without `device` (a distbench from before it) is gated on device_compute_s. With `only`, those of `only`
    it has, whatever the regime."""
    m = first_base.get("metrics") or {}
    if only is not None:
        return tuple(k for k in only if m.get(k))
    if not m.get(device):
        device = DEVICE_METRIC[1]
    host_bound = (first_base.get("regime") or {}).get("regime") != "device-bound"
    roles = ("gate", "gate-host-bound") if host_bound else ("gate",)
    return tuple(k for k, metric in METRICS.items() if (metric.ab in roles or k == device) and m.get(k))


def trimmed(metric: str) -> bool:
    """Whether a metric's pairs are judged by their trimmed mean: memory's peaks repeat to the byte but for
    the odd run that holds one more buffer; every other metric's by Student's t on the mean."""
    return METRICS[metric].unit == "bytes"


def effect_of(metric: str) -> Callable[[np.ndarray, float], stats.Effect]:
    """How the pairs' log ratios of a metric become its effect (see `trimmed`)."""
    return stats.trimmed_log_ratio_effect if trimmed(metric) else stats.log_ratio_effect


def looks(min_pairs: int, max_pairs: int, look_every: int) -> list[int]:
    """The pair counts at which configurations are judged."""
    return sorted({*range(min_pairs, max_pairs + 1, look_every), max_pairs})


def judge(outcome: ConfigOutcome, *, alpha: float, threshold: float, min_effect: float) -> None:
    """Fill outcome.rows from its pairs."""
    outcome.rows = []
    reported = (*names(ab="device"), *names(ab="report"))
    for metric in (*outcome.gated, *[m for m in reported if m not in outcome.gated]):
        base = [p.base["metrics"].get(metric) for p in outcome.pairs]
        head = [p.head["metrics"].get(metric) for p in outcome.pairs]
        if any(v is None or v <= 0 for v in base + head):
            continue
        gated = metric in outcome.gated
        row = Row(outcome.label, metric, gated, base, head, stats.UNDECIDED)
        windows = [p.window_log_ratios for p in outcome.pairs]
        if len(base) >= stats.MIN_RUNS:
            if metric == WINDOWED and all(windows):
                row.effect = stats.interleaved_effect([w for w in windows if w], alpha)
            else:
                row.effect = effect_of(metric)(stats.log_ratios(base, head), alpha)
            row.verdict = stats.verdict(
                row.effect, METRICS[metric].direction, threshold=threshold, min_effect=min_effect
            )
        outcome.rows.append(row)


def _play_pair(
    o: ConfigOutcome,
    order: str,
    run_base: Callable[[RunConfig], dict[str, Any]],
    run_head: Callable[[RunConfig], dict[str, Any]],
) -> Pair | None:
    """One run of each variant in `order`, recorded in `o`; None (and `o.error`, naming the side whose run
    failed) when a run failed: a failed first run ends the pair before the second."""
    sides = (("base", run_base), ("head", run_head))
    (first, run_first), (_, run_second) = sides if order == "AB" else sides[::-1]
    r1 = run_first(o.cfg)
    if r1.get("status") != "ok":
        _failed(o, first, r1)
        return None
    r2 = run_second(o.cfg)
    base, head = (r1, r2) if order == "AB" else (r2, r1)
    return _record(o, Pair(order, base, head))


def _failed(o: ConfigOutcome, side: str, r: dict[str, Any]) -> None:
    o.failed = side
    o.error = f"{side} run failed ({r.get('status')}): {error_line(r.get('error') or '')}"


def _play_interleaved(o: ConfigOutcome, order: str, servers: Servers) -> Pair | None:
    """One pair of runs whose timed windows alternate: both variants build and warm up at once, then time
    their windows in turn (ABBA...: adjacent windows of the two share the host's and the GPU's state of
    that moment), then finish. None and `o.error` when a run failed; a configuration whose two runs do not
    fit in device memory at once (a setup or a window out of memory) is played as whole runs from then on."""
    sides = ("base", "head") if order == "AB" else ("head", "base")
    for side in sides:
        servers.post(side, {"op": "setup", "cfg": o.cfg.to_dict()})
    setup = {side: servers.reply(side) for side in sides}
    bad = [side for side in sides if setup[side].get("status") != "ok"]
    if bad:
        for side in sides:
            if side not in bad:
                servers.post(side, {"op": "finish"})
                servers.reply(side)
        if any(setup[side].get("status") == "oom" for side in bad):
            o.interleave, o.note = "runs", "the two runs do not fit in device memory at once"
            return None
        _failed(o, bad[0], setup[bad[0]])
        return None
    walls: dict[str, list[float]] = {"base": [], "head": []}
    for k, n in enumerate(o.cfg.window_steps):
        for side in sides if k % 2 == 0 else sides[::-1]:
            servers.post(side, {"op": "window", "steps": n})
            r = servers.reply(side)
            if r.get("status") != "ok":
                other = "head" if side == "base" else "base"
                servers.post(other, {"op": "finish"})
                servers.reply(other)
                if r.get("status") == "oom":
                    o.interleave, o.note = "runs", "the two runs ran out of device memory side by side"
                else:
                    _failed(o, side, r)
                return None
            walls[side].append(float(r["step_s"]))
    results = {}
    for side in sides:
        servers.post(side, {"op": "finish"})
        results[side] = servers.reply(side)
    ratios = [math.log(h / b) for b, h in zip(walls["base"], walls["head"], strict=True)]
    return _record(o, Pair(order, results["base"], results["head"], ratios))


def _record(o: ConfigOutcome, pair: Pair) -> Pair | None:
    """Keep a played pair in `o`, or record its failure."""
    bad = [(side, r) for side, r in (("base", pair.base), ("head", pair.head)) if r.get("status") != "ok"]
    if bad:
        _failed(o, *bad[0])
        return None
    o.pairs.append(pair)
    if not o.gated:
        o.gated = gated_metrics(pair.base, o.only, o.device)
        o.regime = pair.base.get("regime")
    return pair


@dataclass
class ABReport:
    outcomes: list[ConfigOutcome]
    alpha: float
    per_test_alpha: float
    threshold: float
    min_effect: float
    elapsed_s: float
    budget_exhausted: bool
    base_desc: str
    head_desc: str
    looks: tuple[int, ...] = ()  # the pair counts at which configurations were judged
    sizing: tuple[str, ...] = ()  # what the memory model predicts of each configuration on this card
    numerics: list[NumericsOutcome] = field(default_factory=list)  # head's numerics against base's
    speed: bool = True  # whether speed was compared (False: `--numerics only`)

    @property
    def status(self) -> str:
        verdicts = [o.verdict for o in self.outcomes]
        if stats.REGRESSION in verdicts:
            return stats.REGRESSION
        if stats.UNDECIDED in verdicts or not verdicts:
            return stats.UNDECIDED
        return "pass"

    @property
    def exit_code(self) -> int:
        """numerics.EXIT_DIVERGED when numerics diverged (wrong numbers make speed moot), else 1 on a speed
        regression, 3 when speed or numerics are undecided, 0 when both pass."""
        numerics = exit_status(self.numerics)
        speed = {stats.REGRESSION: 1, stats.UNDECIDED: 3}.get(self.status, 0) if self.speed else 0
        if numerics == EXIT_DIVERGED:
            return numerics
        return speed if speed == 1 else 3 if 3 in (numerics, speed) else 0


def run_ab(
    configs: list[RunConfig],
    run_base: Callable[[RunConfig], dict[str, Any]],
    run_head: Callable[[RunConfig], dict[str, Any]],
    *,
    alpha: float = 0.05,
    threshold: float = 0.02,
    min_effect: float = 0.01,
    min_pairs: int = MIN_PAIRS,
    max_pairs: int = MAX_PAIRS,
    look_every: int = LOOK_EVERY,
    budget_s: float = 600.0,
    on_pair: Callable[[ConfigOutcome, Pair], None] | None = None,
    between_rounds: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    servers: Servers | None = None,
    gate: tuple[str, ...] | None = None,
    device: str | None = None,
    quota: Mapping[str, int] | None = None,
) -> ABReport:
    """Alternate base and head over `configs` until decided or out of budget (see the module doc).

    run_base / run_head run one configuration once in that variant and return its result (status "ok", or
    anything else for a failure, which ends that configuration's comparison as undecided). With `servers`,
    each pair's timed windows are interleaved instead (_play_interleaved), falling back to whole runs for a
    configuration whose two runs do not fit in device memory at once.
    `between_rounds` runs after every round but the last (the runner recycles the variants' rank processes).
    `gate` names the metrics to gate instead of the regime's (a bisect probe asks about the one that moved);
    `device` the device-side candidate to gate instead of device_metric's default for the world size.
    `quota`: per configuration's label, the most pairs it plays (at most max_pairs): a night gives a noisy
    row more pairs than a steady one (gate/relative.py's allot).
    """
    if min_pairs < stats.MIN_RUNS or max_pairs < min_pairs:
        raise ValueError(f"need {stats.MIN_RUNS} <= min_pairs <= max_pairs, got {min_pairs}, {max_pairs}")
    schedule = looks(min_pairs, max_pairs, look_every)
    mode = "windows" if servers else "runs"
    outcomes = [
        ConfigOutcome(c, label_of(c), interleave=mode, only=gate, device=device_metric(c.world_size, device))
        for c in configs
    ]
    start = clock()
    open_ = list(outcomes)
    per_test = alpha
    round_s: list[float] = []
    exhausted = False
    for rnd in range(max_pairs):
        if not open_:
            break
        # the next round's cost: the rounds after the first, which alone builds and warms both variants from
        # cold (50 s of a 100 s probe on an H200 against 27 s for each later one, results/history-h200-*)
        if round_s and clock() - start + statistics.median(round_s[1:] or round_s) > budget_s:
            exhausted = True
            break
        t0 = clock()
        for o in list(open_):
            order = "AB" if rnd % 2 == 0 else "BA"
            if servers is not None and o.interleave == "windows":
                pair = _play_interleaved(o, order, servers)
                if pair is None and o.interleave == "runs" and not o.error:
                    between_rounds and between_rounds()  # free the device before whole runs
                    pair = _play_pair(o, order, run_base, run_head)
            else:
                pair = _play_pair(o, order, run_base, run_head)
            if pair is None:
                open_.remove(o)
                continue
            if on_pair:
                on_pair(o, pair)
            if quota is not None and len(o.pairs) >= quota.get(o.label, max_pairs):
                open_.remove(o)  # its pairs are played; judged with the others at the end
        if between_rounds and open_ and rnd + 1 < max_pairs:
            between_rounds()
        round_s.append(clock() - t0)
        n = rnd + 1
        if n == 1:  # every configuration's gated metrics are known now: fix the per-test alpha
            tests = sum(len(o.gated) for o in outcomes) or 1
            # the scheduled looks, and the last judgement where the budget ends between two of them
            per_test = stats.family_alpha(alpha, tests, len(schedule) + 1)
        if n in schedule:
            for o in list(open_):
                judge(o, alpha=per_test, threshold=threshold, min_effect=min_effect)
                if o.verdict != stats.UNDECIDED:
                    open_.remove(o)
    for o in outcomes:
        if not o.error:
            judge(o, alpha=per_test, threshold=threshold, min_effect=min_effect)
    elapsed = clock() - start
    return ABReport(
        outcomes, alpha, per_test, threshold, min_effect, elapsed, exhausted, "", "", tuple(schedule)
    )
