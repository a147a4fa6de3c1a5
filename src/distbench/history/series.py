"""The stored history as series: one metric of one configuration, point by point in the order the points
were made, each point's commit, figure, interval and whether the plausibility checks flagged it.

Two stores are read, because each keeps what the other lacks:

* asv's results directory (`.asv/results`, benchmarks/bench_training.py): one point per commit and machine,
  the nightly grid's. Figures are asv's lower-is-better forms (1 / MFU, ...), the interval asv's 99% one
  over the timed windows; Plausibility.track_warnings says which points were flagged. asv keeps no workload,
  so a series knows its strategy and world size only (the grid's workload is distbench/history/grid.py's).
* distbench's own result JSON (`distbench run -o DIR`, repeats included): one point per run, the commit from
  the result's environment fingerprint (env.git_commit), the full configuration (so a bisect command can
  name it exactly), the interval the range of its windows, flagged where it carries warnings.

Points are ordered by when they were made: asv's by the commit's date (asv's `date`); distbench's by each
result's `created`. A nightly history runs in commit order, so that is commit order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..metrics import METRICS
from ..results import config_key, load_results

#: the asv benchmark whose value counts a configuration's plausibility warnings (benchmarks/bench_training.py)
ASV_FLAGS = "Plausibility.track_warnings"


@dataclass(frozen=True)
class Point:
    commit: str
    value: float
    low: float | None = None  # the point's interval, where its store has one
    high: float | None = None
    flagged: bool = False


@dataclass
class Series:
    metric: str  # the registry metric
    label: str  # what the report calls it: metric, configuration and store
    config: dict[str, Any]  # strategy and world_size at least; a distbench result's whole config
    points: list[Point] = field(default_factory=list)
    asv_form: bool = False  # values in asv's lower-is-better form (1 / MFU for mfu)
    ratio: bool = False  # values are head / reference, measured side by side (gate/relative.py)

    @property
    def unit(self) -> str:
        m = METRICS[self.metric]
        if self.ratio:
            return "x reference"
        return m.asv.unit if self.asv_form and m.asv else m.unit


def _by_name() -> dict[str, str]:
    """asv benchmark name (without the module) -> registry metric."""
    return {m.asv.benchmark: m.name for m in METRICS.values() if m.asv is not None}


def _row(columns: list[str], row: list[Any]) -> dict[str, Any]:
    """One benchmark's row of an asv results file by column (asv drops trailing empty columns)."""
    return dict(zip(columns, row, strict=False))


def _at(column: list[Any] | None, i: int) -> Any:
    return column[i] if column is not None and i < len(column) else None


def _asv_config(metric: str, labels: list[str], machine: str) -> dict[str, Any]:
    """What an asv series knows of its configuration: bench_training's parameters (strategy and world size
    for training, collective and world size for bus bandwidth) and the machine."""
    first = "op" if METRICS[metric].source == "busbw" else "strategy"
    return {first: labels[0], "world_size": int(labels[1]), "machine": machine}


def from_asv(results_dir: str | os.PathLike[str], machine: str | None = None) -> list[Series]:
    """Every tracked series of an asv results directory (one machine's, or every machine's); ConfigError for
    a directory that is not one, or a file in it that asv did not write."""
    import itertools

    root = Path(results_dir)
    machines = [d for d in sorted(root.iterdir()) if (d / "machine.json").is_file()] if root.is_dir() else []
    if machine:
        machines = [d for d in machines if d.name == machine]
    if not machines:
        raise ConfigError(
            f"--asv {results_dir}: no asv results"
            + (f" of machine {machine}" if machine else "")
            + " (a directory with a folder per machine, each with its machine.json, as `asv run` writes "
            ".asv/results)"
        )
    from ..gate.relative import asv_ratio_benchmarks

    ratios = asv_ratio_benchmarks()
    names = {**_by_name(), **ratios}
    series: dict[tuple, Series] = {}
    for mdir in machines:
        files = []
        for f in sorted(mdir.glob("*.json")):
            if f.name == "machine.json":
                continue
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
                files.append((data["date"], f, data))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"--asv {results_dir}: {f} is not an asv results file ({e!r})") from None
        for _, _f, data in sorted(files, key=lambda t: (t[0], t[1].name)):
            columns = data.get("result_columns") or []
            rows = {k.split(".", 1)[-1]: _row(columns, v) for k, v in (data.get("results") or {}).items()}
            flags = rows.get(ASV_FLAGS)
            for bench, metric in names.items():
                row = rows.get(bench)
                if not row or row.get("result") is None:
                    continue
                params = row.get("params") or []
                for i, combo in enumerate(itertools.product(*params) if params else [()]):
                    value = _at(row["result"], i)
                    if value is None or (isinstance(value, float) and value != value):
                        continue
                    flag = _at(flags.get("result"), i) if flags and flags.get("params") == params else None
                    labels = [str(p).strip("'") for p in combo]
                    key = (mdir.name, bench, tuple(labels))
                    if key not in series:
                        label = f"{bench} {' '.join(labels)} [{mdir.name}]"
                        ratio = bench in ratios
                        series[key] = Series(
                            metric,
                            label,
                            _asv_config(metric, labels, mdir.name),
                            asv_form=not ratio,
                            ratio=ratio,
                        )
                    series[key].points.append(
                        Point(
                            commit=data["commit_hash"],
                            value=float(value),
                            low=_at(row.get("stats_ci_99_a"), i),
                            high=_at(row.get("stats_ci_99_b"), i),
                            flagged=bool(flag),
                        )
                    )
    return list(series.values())


def _window_interval(result: dict[str, Any], metric: str) -> tuple[float | None, float | None]:
    """The range of a figure that moves with the step time over the result's timed windows: proportional to
    it for a time, inversely for a rate or an efficiency."""
    st, value = result.get("step_time_s") or {}, result["metrics"][metric]
    times, step = st.get("windows") or [], result["metrics"].get("step_time_s")
    if not times or not step:
        return None, None
    xs = [value * (t / step if METRICS[metric].better == "lower" else step / t) for t in times]
    return min(xs), max(xs)


def from_results(paths: Iterable[str | os.PathLike[str]]) -> list[Series]:
    """Every tracked series of distbench result files and directories: per configuration, each metric with an
    asv track (what the nightly history follows), one point per ok run with a git commit."""
    tracked = [m for m in METRICS.values() if m.asv is not None and m.source != "busbw"]
    series: dict[tuple, Series] = {}
    runs = [r for r in load_results(list(paths)) if r["status"] == "ok"]
    for r in sorted(runs, key=lambda r: r.get("created", "")):
        commit = (r.get("env") or {}).get("git_commit")
        if not commit:
            continue
        for m in tracked:
            value = r["metrics"].get(m.name)
            if value is None:
                continue
            key = (config_key(r), m.name)
            if key not in series:
                c = r["config"]
                label = f"{m.name} {c['strategy']} ws{c['world_size']} {c['model']} {c['precision']} mb{c['micro_batch']}"
                series[key] = Series(m.name, label, dict(c))
            low, high = _window_interval(r, m.name) if m.time or m.source == "scaling" else (None, None)
            series[key].points.append(Point(commit, float(value), low, high, bool(r.get("warnings"))))
    return list(series.values())


@dataclass
class _Chain:
    """A ratio series as it is being read: the reference its last point was measured against, and the factor
    that turns a ratio against that reference into one against the series' first reference."""

    series: Series
    reference: str
    factor: float = 1.0


def from_nights(paths: Iterable[str | os.PathLike[str]]) -> list[Series]:
    """Every series of the nights under `paths` (`distbench nightly`'s night.json, gate/relative.py): per
    configuration and metric, the ratio head / reference with its interval, one point per night at head's
    commit; and head's absolute figures of the same runs. A ratio series is carried across a change of
    reference by the night's bridge, the new reference measured against the old: head/old = head/new x
    new/old, so the switch adds no step of its own. A night whose reference changed without a bridge
    starts a new series (named by its reference), rather than joining two scales."""
    from ..gate.relative import find_nights

    chains: dict[tuple, _Chain] = {}
    out: list[Series] = []
    absolute: dict[tuple, Series] = {}
    for night in find_nights(list(paths)):
        if not night.commit:
            continue
        rid = night.reference.id
        bridged = {}
        if night.bridge is not None:
            for row in night.bridge.rows:
                for metric, r in row.ratios.items():
                    bridged[(config_key({"config": row.config}), metric)] = r.ratio
        for row in night.rows:
            key = config_key({"config": row.config})
            c = row.config
            what = f"{c['strategy']} ws{c['world_size']} {c['model']} {c['precision']} mb{c['micro_batch']}"
            for metric, r in row.ratios.items():
                chain = chains.get((key, metric))
                if chain is not None and chain.reference != rid:
                    step = bridged.get((key, metric))
                    if (
                        step is not None
                        and night.bridge is not None
                        and night.bridge.previous.id == chain.reference
                    ):
                        chain.factor *= step
                        chain.reference = rid
                    else:
                        chain = None  # no measured bridge from the old reference: a new series
                if chain is None:
                    since = f" since reference {rid}" if (key, metric) in chains else ""
                    label = f"{metric} head/reference {what}{since}"
                    chain = _Chain(Series(metric, label, dict(c), ratio=True), rid)
                    chains[(key, metric)] = chain
                    out.append(chain.series)
                f = chain.factor
                chain.series.points.append(Point(night.commit, r.ratio * f, r.low * f, r.high * f))
            for metric, value in row.head.items():
                if metric not in METRICS or METRICS[metric].asv is None or value <= 0:
                    continue
                if (key, metric) not in absolute:
                    absolute[(key, metric)] = Series(metric, f"{metric} head {what} (nightly)", dict(c))
                    out.append(absolute[(key, metric)])
                absolute[(key, metric)].points.append(Point(night.commit, value))
    return out
