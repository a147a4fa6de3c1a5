"""The interleaved A/B gate: base and head alternate run by run on the same GPUs until each configuration
is decided or the time budget runs out.

Each configuration gets pairs of runs, one of each variant, in alternating order (AB, BA, AB, ...), so slow
drift (SM clocks moved 1665-1875 MHz under load on H200) and order effects cancel within pairs. Rounds go
over every undecided configuration; after `min_pairs` rounds, and every `look_every` rounds after that, each
configuration is judged (gate/stats.py) and leaves the rotation once every gated metric is decided.
Between rounds both variants get fresh rank processes, so a bias of one process is noise across pairs
rather than a difference between the variants (an A/A run on one pair of long-lived pools flagged a 30%
difference in host CPU time per step). The
family-wise false-alarm rate `alpha` is divided over configurations, gated metrics and the looks the
schedule allows.

Gated metrics follow the configuration's regime, read from the base's first run (the roles are each metric's
`ab` in distbench/metrics.py):
    always                 step_time_s (the window wall clock per step: what users get)
    with a device sample   device_compute_s (kernels other than NCCL: the quiet device-side figure)
    host-bound             host_cpu_s (the training thread's CPU time per step)
    on GPUs                mem_allocated_peak_bytes (nearly exact from run to run, so any change of at least
                           min_effect is found in the first look)
Reported beside them, not gated: tokens_per_s, step_gcycles (cycles per step, where NVML read the clock),
device_comm_s and busy_ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import RunConfig
from ..metrics import METRICS, names
from . import stats


@dataclass
class Pair:
    order: str  # "AB" or "BA"
    base: dict[str, Any]
    head: dict[str, Any]


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

    @property
    def verdict(self) -> str:
        if self.error:
            return stats.UNDECIDED
        gated = [r.verdict for r in self.rows if r.gated]
        for v in (stats.REGRESSION, stats.UNDECIDED, stats.IMPROVEMENT):
            if v in gated:
                return v
        return stats.UNCHANGED if gated else stats.UNDECIDED


def label_of(cfg: RunConfig) -> str:
    return f"{cfg.strategy} ws{cfg.world_size} {cfg.model} {cfg.precision} mb{cfg.micro_batch}"


def gated_metrics(first_base: dict[str, Any]) -> tuple[str, ...]:
    """The registry's gated metrics (`ab` "gate", and "gate-host-bound" unless the configuration is
    device-bound) that the base's first run has, in registry order."""
    m = first_base.get("metrics") or {}
    host_bound = (first_base.get("regime") or {}).get("regime") != "device-bound"
    roles = ("gate", "gate-host-bound") if host_bound else ("gate",)
    return tuple(k for k, metric in METRICS.items() if metric.ab in roles and m.get(k))


def looks(min_pairs: int, max_pairs: int, look_every: int) -> list[int]:
    """The pair counts at which configurations are judged."""
    return sorted({*range(min_pairs, max_pairs + 1, look_every), max_pairs})


def judge(outcome: ConfigOutcome, *, alpha: float, threshold: float, min_effect: float) -> None:
    """Fill outcome.rows from its pairs."""
    outcome.rows = []
    for metric in (*outcome.gated, *[m for m in names(ab="report") if m not in outcome.gated]):
        base = [p.base["metrics"].get(metric) for p in outcome.pairs]
        head = [p.head["metrics"].get(metric) for p in outcome.pairs]
        if any(v is None or v <= 0 for v in base + head):
            continue
        gated = metric in outcome.gated
        row = Row(outcome.label, metric, gated, base, head, stats.UNDECIDED)
        if len(base) >= stats.MIN_RUNS:
            row.effect = stats.paired_effect(base, head, alpha)
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
    """One run of each variant in `order`, recorded in `o`; None (and `o.error`) when a run failed."""
    first, second = (run_base, run_head) if order == "AB" else (run_head, run_base)
    r1 = first(o.cfg)
    r2 = second(o.cfg) if r1.get("status") == "ok" else r1
    base, head = (r1, r2) if order == "AB" else (r2, r1)
    bad = [(side, r) for side, r in (("base", base), ("head", head)) if r.get("status") != "ok"]
    if bad:
        side, r = bad[0]
        o.error = f"{side} run failed ({r.get('status')}): {(r.get('error') or '').splitlines()[:1]}"
        return None
    pair = Pair(order, base, head)
    o.pairs.append(pair)
    if not o.gated:
        o.gated = gated_metrics(base)
        o.regime = base.get("regime")
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
        return {stats.REGRESSION: 1, stats.UNDECIDED: 3}.get(self.status, 0)


def run_ab(
    configs: list[RunConfig],
    run_base: Callable[[RunConfig], dict[str, Any]],
    run_head: Callable[[RunConfig], dict[str, Any]],
    *,
    alpha: float = 0.05,
    threshold: float = 0.02,
    min_effect: float = 0.01,
    min_pairs: int = 6,
    max_pairs: int = 12,
    look_every: int = 3,
    budget_s: float = 600.0,
    on_pair: Callable[[ConfigOutcome, Pair], None] | None = None,
    between_rounds: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ABReport:
    """Alternate base and head over `configs` until decided or out of budget (see the module doc).

    run_base / run_head run one configuration once in that variant and return its result (status "ok", or
    anything else for a failure, which ends that configuration's comparison as undecided).
    `between_rounds` runs after every round but the last (the runner recycles the variants' rank processes).
    """
    if min_pairs < stats.MIN_RUNS or max_pairs < min_pairs:
        raise ValueError(f"need {stats.MIN_RUNS} <= min_pairs <= max_pairs, got {min_pairs}, {max_pairs}")
    schedule = looks(min_pairs, max_pairs, look_every)
    outcomes = [ConfigOutcome(c, label_of(c)) for c in configs]
    start = clock()
    open_ = list(outcomes)
    per_test = alpha
    round_s: list[float] = []
    exhausted = False
    for rnd in range(max_pairs):
        if not open_:
            break
        if round_s and clock() - start + statistics.median(round_s) > budget_s:
            exhausted = True
            break
        t0 = clock()
        for o in list(open_):
            pair = _play_pair(o, "AB" if rnd % 2 == 0 else "BA", run_base, run_head)
            if pair is None:
                open_.remove(o)
            elif on_pair:
                on_pair(o, pair)
        if between_rounds and open_ and rnd + 1 < max_pairs:
            between_rounds()
        round_s.append(clock() - t0)
        n = rnd + 1
        if n == 1:  # every configuration's gated metrics are known now: fix the per-test alpha
            tests = sum(len(o.gated) for o in outcomes) or 1
            per_test = stats.family_alpha(alpha, tests, len(schedule))
        if n in schedule:
            for o in list(open_):
                judge(o, alpha=per_test, threshold=threshold, min_effect=min_effect)
                if o.verdict != stats.UNDECIDED:
                    open_.remove(o)
    for o in outcomes:
        if not o.error:
            judge(o, alpha=per_test, threshold=threshold, min_effect=min_effect)
    return ABReport(outcomes, alpha, per_test, threshold, min_effect, clock() - start, exhausted, "", "")
