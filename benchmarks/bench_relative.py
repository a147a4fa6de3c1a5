"""The nightly's ratios against a frozen reference, per strategy x world size, tracked by asv.

`distbench nightly` measures the grid interleaved against a reference and writes night.json
(distbench/gate/relative.py); this module reads the night that DISTBENCH_ASV_NIGHT names and records, for each
configuration and each metric the night judged, the ratio head / reference. Each pair's ratio is one of asv's
samples, so asv's statistics (median, 99% interval, quartiles) are the night's spread, as bench_training's
windows are for the absolute figures. On a cloud VM these are the series that hold still where the host's
speed moves the absolute ones (docs/history.md, "Which series to watch").

Run it after the nightly, for the commit it measured:

    DISTBENCH_ASV_NIGHT=nights/2026-12-02/night.json asv run --python=same --set-commit-hash HASH -b bench_relative

Without DISTBENCH_ASV_NIGHT (or for a configuration the night did not run) every track is skipped (n/a), so
that the absolute grid's `asv run` stays as it was. A ratio across a change of reference is chained by
`distbench history --nights`, which reads the bridge; asv stores each night's ratio as measured.
"""

from __future__ import annotations

import os as _os
from typing import Any

from distbench.gate.relative import asv_ratio_benchmarks as _asv_ratio_benchmarks
from distbench.gate.relative import load_night as _load_night
from distbench.metrics import METRICS as _METRICS

from .bench_training import STRATEGIES, WORLD_SIZES

ENV = "DISTBENCH_ASV_NIGHT"


def setup_cache() -> dict[str, Any]:
    """The night's ratios by strategy/world size and metric, with its reference; {} without a night."""
    path = _os.environ.get(ENV)
    if not path:
        return {}
    night = _load_night(path)
    rows = {
        f"{r.config['strategy']}/{r.config['world_size']}": {m: list(x.pairs) for m, x in r.ratios.items()}
        for r in night.rows
    }
    return {"rows": rows, "reference": night.reference.id}


class _Relative:
    params = (STRATEGIES, WORLD_SIZES)
    param_names = ("strategy", "world_size")

    def setup(self, cache: dict[str, Any], strategy: str, world_size: int) -> None:
        if not cache:
            raise NotImplementedError(f"no night: set {ENV} to a `distbench nightly` night.json")
        row = cache["rows"].get(f"{strategy}/{world_size}")
        if row is None:
            raise NotImplementedError("the night did not run this configuration")
        self.row = row


def _track(metric: str) -> Any:
    """The asv track of one metric's ratio: each pair's head / reference as a sample."""
    m = _METRICS[metric]

    def track(self: _Relative, cache: dict[str, Any], strategy: str, world_size: int) -> dict[str, Any]:
        pairs = self.row.get(metric)
        if not pairs:
            raise NotImplementedError(f"the night has no {metric} ratio here (not measured, or not judged)")
        return {"samples": pairs, "number": 1}

    doc = (
        f"{m.description.rstrip('.')}: head / the frozen reference, measured side by side (`distbench "
        "nightly`). Samples: each pair's ratio; lower is better."
    )
    track.__doc__ = track.pretty_source = doc  # type: ignore[attr-defined]
    track.__name__ = f"track_{metric}"
    track.__qualname__ = f"Relative.track_{metric}"
    track.unit = "x reference"  # type: ignore[attr-defined]
    track.version = f"ratio:{metric}:1"  # type: ignore[attr-defined]
    track.pretty_name = f"Ratio to the reference: {metric}"  # type: ignore[attr-defined]
    return track


Relative = type(
    "Relative",
    (_Relative,),
    {
        "__module__": __name__,
        **{name.split(".")[1]: _track(metric) for name, metric in _asv_ratio_benchmarks().items()},
    },
)
