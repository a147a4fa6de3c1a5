"""A night measured against a frozen reference: the nightly grid's configurations interleaved with a reference
variant (gate/ab.py's run_ab), a fixed number of pairs each, stored as head/reference ratios with their
intervals beside both sides' absolute figures (`distbench nightly`, docs/reference-runs.md).

Why ratios: on a cloud VM the host's speed moves host-bound rows 5-30% from night to night (seed 004's
repeats on 2x H200), so an absolute history cannot see a 10% host-side regression there. Head and reference
take turns window by window on the same host, so both meet its speed and the ratio keeps still.

Why a set number of pairs rather than the gate's early stop: a history needs a figure with an interval
every night, for every gated metric, and one of comparable width from night to night; a gate stops a
configuration as soon as it is decided, which leaves a decided row with three pairs and another with twelve.
The number is each configuration's own (`allot`): as many as its pairs' spread over the last nights needs for
a ratio within its regime's bound, so the ZeRO rows, whose pairs spread most, get more than DDP's.

A night stores (`Night`, schema distbench.night/1, one night.json per night):
- per configuration (`NightRow`): each gated and reported metric's ratio head/reference with its interval
  and the ratio of every pair (asv's samples: benchmarks/bench_relative.py), and the medians of head's
  and the reference's runs beside them;
- the reference's identity (`Reference.id`), so that a history sees the night it changed;
- on such a night, a `bridge`: the new reference measured against the previous one, the same way, so that
  history/series.py chains the series across the switch (ratio head/new x new/old) instead of showing a step;
- where the reference could not run, `reference_error` naming it, and head's absolute figures alone.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import RunConfig
from ..errors import ConfigError
from . import stats
from .ab import ABReport, ConfigOutcome, Servers, judge, label_of, run_ab
from .variants import Variant, git

SCHEMA = "distbench.night/1"
#: asv's class of ratio tracks (benchmarks/bench_relative.py): one track per metric a night may gate.
ASV_CLASS = "Relative"
NIGHT_FILE = "night.json"
#: The fewest pairs a configuration gets in a night (the t interval over 4 pairs is 3.2 standard errors wide
#: either way, against 4.3 over 3), and the most `allot` gives a noisy one. On one H200 a pair of seed 004's
#: GPT-2 124M rows took 14 s on average (six rows of 3 pairs: 245-268 s a night,
#: results/relative-nightly-h200-2026-12-02).
PAIRS, MAX_PAIRS = 4, 12
#: What a night's step-time ratio should keep within of the truth, at about Z standard errors (`allot`): the
#: bounds docs/reference-runs.md holds a row's nights to.
DEVICE_BOUND, HOST_BOUND, Z = 0.01, 0.02, 2.0
#: The earlier nights whose pairs say how much a configuration's pairs spread.
ALLOT_NIGHTS = 5


def asv_ratio_benchmarks() -> dict[str, str]:
    """asv benchmark name (class.method) of each ratio track -> its registry metric: the metrics a night can
    gate (the gate's, the host-bound rows', the device-side candidates)."""
    from ..metrics import names

    gated = (*names(ab="gate"), *names(ab="gate-host-bound"), *names(ab="device"))
    return {f"{ASV_CLASS}.track_{m}": m for m in gated}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ratio(_Strict):
    """One metric of one configuration: head / reference, with the interval the gate's statistics give."""

    ratio: Annotated[float, Field(gt=0)]  # exp(mean log ratio over pairs)
    low: Annotated[float, Field(gt=0)]
    high: Annotated[float, Field(gt=0)]
    level: Annotated[float, Field(gt=0, lt=1)]
    gated: bool  # one of the metrics the gate decides on for this configuration's regime
    verdict: str  # the gate's verdict at this night's alpha, for the log: a history judges the series
    pairs: list[Annotated[float, Field(gt=0)]]  # head / reference of each pair (its windows' for step time)
    #: step time of interleaved pairs: head / reference of each pair's adjacent windows, whose trimmed mean
    #: `pairs` holds; their spread within a pair (window noise: more windows average it) against the pairs'
    #: spread (each pair's fresh processes too: only more pairs do) says which a row needs
    windows: list[list[Annotated[float, Field(gt=0)]]] = []


class NightRow(_Strict):
    """One configuration of a night."""

    label: str
    config: dict[str, Any]  # RunConfig.to_dict(), as JSON
    pairs: Annotated[int, Field(ge=0)]
    interleave: Literal["windows", "runs", "none"]  # "none": head ran alone
    regime: str | None = None
    head: dict[str, float] = {}  # median of head's runs per metric
    reference: dict[str, float] = {}  # median of the reference's runs per metric
    ratios: dict[str, Ratio] = {}
    error: str | None = None
    failed: Literal["reference", "head"] | None = None  # whose run failed, with `error`


class Reference(_Strict):
    """What a night was measured against: the variant as written, in words, and its identity."""

    spec: str
    describe: str
    id: Annotated[str, Field(min_length=1)]


class Bridge(_Strict):
    """The night's reference measured against the previous night's (head: new, reference: previous)."""

    previous: Reference
    rows: list[NightRow]


class Night(_Strict):
    """One night.json."""

    schema_: Literal["distbench.night/1"] = Field(alias="schema")
    created: str  # ISO 8601, UTC: the history's order
    commit: str | None  # head's git commit: the history's point
    head: str  # head's variant, in words
    reference: Reference
    reference_error: str | None = None  # the reference could not start or run: ratios are missing
    pairs: Annotated[int, Field(ge=stats.MIN_RUNS)]  # asked per configuration
    alpha: Annotated[float, Field(gt=0, lt=1)]
    budget_s: Annotated[float, Field(gt=0)]
    elapsed_s: Annotated[float, Field(ge=0)]
    rows: list[NightRow]
    bridge: Bridge | None = None


class NightFileError(ConfigError):
    """A night file that cannot be read or is damaged; the message names it."""


def reference_id(v: Variant, spec: str) -> str:
    """A reference's identity: the commit its code is at (rev= resolved, tree='s HEAD, else this runner's own),
    its interpreter's real path and its environment, hashed; two nights with the same id measured against the
    same thing."""
    parts = [f"python={os.path.realpath(v.python)}", *(f"env.{k}={x}" for k, x in sorted(v.env.items()))]
    parts += [f"path={p}" for p in v.path]
    try:
        if v.rev:
            parts.append("commit=" + git("rev-parse", f"{v.rev}^{{commit}}"))
        else:  # its tree, or the distbench this runner is (a reference that moves with it is no reference)
            parts.append(
                "commit=" + git("rev-parse", "HEAD", cwd=v.tree or Path(__file__).resolve().parents[2])
            )
    except ConfigError:
        parts.append(f"spec={spec}")  # not a git checkout: the spec as written is all there is
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each metric over the ok runs that have it."""
    keys = sorted(
        {k for r in runs for k, v in (r.get("metrics") or {}).items() if isinstance(v, int | float)}
    )
    out = {}
    for k in keys:
        xs = [float(r["metrics"][k]) for r in runs if isinstance(r["metrics"].get(k), int | float)]
        if xs and all(math.isfinite(x) for x in xs):
            out[k] = statistics.median(xs)
    return out


def row_of(o: ConfigOutcome) -> NightRow:
    """A played configuration as a night stores it: every judged metric's ratio and both sides' medians."""
    ratios = {}
    for r in o.rows:
        if r.effect is None:
            continue
        windows = [p.window_log_ratios for p in o.pairs]
        within: list[list[float]] = []
        if r.metric == "step_time_s" and all(windows):
            per_pair = [math.exp(x) for x in stats.round_log_ratios([w for w in windows if w])]
            within = [[math.exp(x) for x in w] for w in windows if w]
        else:
            per_pair = [h / b for b, h in zip(r.base, r.head, strict=True)]
        e = r.effect
        ratios[r.metric] = Ratio(
            ratio=1 + e.estimate,
            low=1 + e.low,
            high=1 + e.high,
            level=e.level,
            gated=r.gated,
            verdict=r.verdict,
            pairs=per_pair,
            windows=within,
        )
    error = o.error.replace("base run", "reference run") if o.error else None
    return NightRow(
        label=o.label,
        config=o.cfg.to_dict(),
        pairs=len(o.pairs),
        interleave="windows" if o.interleave == "windows" else "runs",
        regime=(o.regime or {}).get("regime"),
        head=medians([p.head for p in o.pairs]),
        reference=medians([p.base for p in o.pairs]),
        ratios=ratios,
        error=error,
        failed="reference" if o.failed == "base" else "head" if o.failed == "head" else None,
    )


def night_rows(report: ABReport, alpha: float) -> list[NightRow]:
    """The night's rows of a played comparison (the reference as run_ab's base), each judged once more at
    `alpha` alone: a night's ratios are points of a history, whose change points are judged over the whole
    series (history/changepoints.py), not verdicts to divide a false-alarm rate over."""
    for o in report.outcomes:
        if not o.error and len(o.pairs) >= stats.MIN_RUNS:
            judge(o, alpha=alpha, threshold=report.threshold, min_effect=report.min_effect)
    return [row_of(o) for o in report.outcomes]


def measure(
    configs: list[RunConfig],
    run_reference: Callable[[RunConfig], dict[str, Any]],
    run_head: Callable[[RunConfig], dict[str, Any]],
    *,
    pairs: int = PAIRS,
    alpha: float = 0.05,
    budget_s: float = 1800.0,
    servers: Servers | None = None,
    quota: dict[str, int] | None = None,
) -> list[NightRow]:
    """Every configuration interleaved against the reference for `pairs` pairs, or its own number in `quota`
    (by label: `allot`), fewer only where the budget ends first (each row says how many it got), judged once at
    the end (`night_rows`). The schedule of `distbench nightly`, which plays it through commands/ab.py's
    servers with the same pairs."""
    every = {label_of(c): (quota or {}).get(label_of(c), pairs) for c in configs}
    report = run_ab(
        configs,
        run_reference,
        run_head,
        alpha=alpha,
        budget_s=budget_s,
        servers=servers,
        **pair_plan(pairs, every),
    )
    return night_rows(report, alpha)


def pair_plan(pairs: int, quota: dict[str, int]) -> dict[str, Any]:
    """run_ab's pair arguments for a night whose configurations play `quota` pairs each (by label, every one of
    them listed; `pairs` the fewest): none is judged before the most of them is played (min = max =
    look_every), so none stops early."""
    most = max([pairs, *quota.values()])
    return {"min_pairs": most, "max_pairs": most, "look_every": most, "quota": quota}


def allot(
    labels: list[str], nights: list[Night], least: int = PAIRS, most: int = MAX_PAIRS
) -> dict[str, int]:
    """Per configuration label, the pairs tonight gives it: enough that its step-time ratio's standard error is
    1/Z of its regime's bound (DEVICE_BOUND, HOST_BOUND), from how its pairs' ratios spread about their own
    night's mean over the last ALLOT_NIGHTS nights (pooled), rounded up to an even number so that as many pairs
    play AB as BA (an order effect cancels); `least` where no earlier night has two pairs of it.
    On one H200 the six rows' pairs spread 0.7-4.6% so pooled (results/relative-nightly-h200-2026-12-02): three
    pairs each kept four rows within 1.1% over three nights and left the two ZeRO rows 3.0-3.3% out."""
    out = {}
    for label in labels:
        squares, df, regime = 0.0, 0, None
        for n in nights[-ALLOT_NIGHTS:]:
            row = next((r for r in n.rows if r.label == label), None)
            ratio = row.ratios.get("step_time_s") if row else None
            if row is None or ratio is None or len(ratio.pairs) < 2:
                continue
            logs = [math.log(x) for x in ratio.pairs]
            mean = statistics.fmean(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            df += len(logs) - 1
            regime = row.regime or regime
        if df == 0:
            out[label] = least
            continue
        bound = DEVICE_BOUND if regime == "device-bound" else HOST_BOUND
        need = math.ceil((Z * math.sqrt(squares / df) / bound) ** 2)
        out[label] = min(most, max(least, need + need % 2))
    return out


def head_alone(
    configs: list[RunConfig],
    run_head: Callable[[RunConfig], dict[str, Any]],
    runs: int,
    between: Callable[[], None] | None = None,
) -> list[NightRow]:
    """Head's absolute figures where the reference cannot run: `runs` runs of each configuration."""
    rows = []
    for cfg in configs:
        got, error = [], None
        for i in range(runs):
            r = run_head(cfg)
            if r.get("status") != "ok":
                error = f"head run failed ({r.get('status')}): {str(r.get('error') or '')[:300]}"
                break
            got.append(r)
            if between and i + 1 < runs:
                between()
        regime = (got[0].get("regime") or {}).get("regime") if got else None
        rows.append(
            NightRow(
                label=label_of(cfg),
                config=cfg.to_dict(),
                pairs=len(got),
                interleave="none",
                regime=regime,
                head=medians(got),
                error=error,
            )
        )
    return rows


def save_night(night: Night, out_dir: str | os.PathLike[str]) -> Path:
    from ..results import write_json_atomic

    return write_json_atomic(Path(out_dir) / NIGHT_FILE, night.model_dump(mode="json", by_alias=True))


def load_night(path: str | os.PathLike[str]) -> Night:
    """A night file, validated; NightFileError naming it and what is wrong."""
    import json

    p = Path(path)
    try:
        return Night.model_validate(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NightFileError(f"{p}: cannot read a night file ({e})") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise NightFileError(f"{p} is a damaged {SCHEMA} file: {loc}: {err['msg'].lower()}") from None


def find_nights(paths: list[str | os.PathLike[str]]) -> list[Night]:
    """Every night under `paths` (files, or directories searched for night.json), oldest first."""
    return [night for _, night in find_night_files(paths)]


def find_night_files(paths: list[str | os.PathLike[str]], none_ok: bool = False) -> list[tuple[Path, Night]]:
    """`find_nights` with each night's file, for a reader that names a night by where it lies; `none_ok`: a
    directory without nights is no error (before the first night)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise NightFileError(f"no nights at {p}")
        found = sorted(p.rglob(NIGHT_FILE)) if p.is_dir() else [p]
        if not found and not none_ok:
            raise NightFileError(
                f"no {NIGHT_FILE} under {p} (`distbench nightly -o DIR` writes one per night)"
            )
        files += found
    return sorted(((f, load_night(f)) for f in files), key=lambda t: t[1].created)
