"""What `distbench history` says of each change point: the commits either side, the size of the change with
its interval, and the `distbench bisect` command that would name the commit."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from ..compare import MIN_EFFECT
from ..metrics import METRICS
from .changepoints import Change, find_changes
from .grid import asv_workload
from .series import Point, Series

#: the fewest points a series needs before its changes are looked for (two a side)
MIN_POINTS = 4


@dataclass(frozen=True)
class Found:
    series: Series
    change: Change
    last_good: Point
    first_bad: Point
    left_out: int  # flagged points the detection did not use
    #: the whole interval lies within +-min_effect: real (a noise-free figure, such as a memory peak, moves by a
    #: few KiB when an allocator rounds differently) but too small to bisect or to fail a night on
    negligible: bool = False

    @property
    def worse(self) -> bool:
        """A regression: the figure moved the way that is worse (asv's forms are all lower-is-better)."""
        lower_is_better = self.series.asv_form or METRICS[self.series.metric].better == "lower"
        return (self.change.ratio > 1) == lower_is_better

    @property
    def actionable(self) -> bool:
        """Worse, and by enough to act on: what gets a bisect and fails the command (history.json's
        "regression" is `worse`, the direction alone, beside "negligible")."""
        return self.worse and not self.negligible

    @property
    def same_commit(self) -> bool:
        return self.last_good.commit == self.first_bad.commit


def usable_points(s: Series, include_flagged: bool) -> list[Point] | None:
    """The points a series' changes are looked for in, flagged ones left out unless `include_flagged`; None when
    they are too few (MIN_POINTS) or not all positive (changes are relative)."""
    points = [p for p in s.points if include_flagged or not p.flagged]
    return points if len(points) >= MIN_POINTS and min(p.value for p in points) > 0 else None


def analyse(
    series: list[Series],
    alpha: float,
    include_flagged: bool = False,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
) -> list[Found]:
    """The change points of every series with MIN_POINTS points or more, flagged points left out unless
    `include_flagged`; a change whose interval lies within +-`min_effect` is marked negligible."""
    found = []
    for s in series:
        points = usable_points(s, include_flagged)
        if points is None:
            continue
        for c in find_changes(
            [p.value for p in points], alpha=alpha, seed=seed, groups=[p.commit for p in points]
        ):
            small = 1 / (1 + min_effect) <= c.low and c.high <= 1 + min_effect
            found.append(
                Found(s, c, points[c.index - 1], points[c.index], len(s.points) - len(points), small)
            )
    return found


def _workload_flags(config: dict[str, Any]) -> list[str]:
    """The bisect flags of a configuration: a distbench result's own, or the asv grid's for an asv series
    (asv keeps only strategy and world size; a machine named `cpu` ran the CPU grid, docs/asv-history.md)."""
    c = dict(config)
    if "model" not in c:
        cpu = c.get("machine") == "cpu"
        c.update(asv_workload(0 if cpu else 1), device="cpu" if cpu else "cuda")
    flags = ["-s", c["strategy"], "-n", str(c["world_size"]), "-m", c["model"], "--precision", c["precision"]]
    flags += ["--micro-batch", str(c["micro_batch"])]
    for key in ("seq_len", "steps", "warmup", "windows"):
        if c.get(key) is not None:
            flags += [f"--{key.replace('_', '-')}", str(c[key])]
    if c.get("device"):
        flags += ["--device", c["device"]]
    return flags


def bisect_argv(found: Found, repo: str | None, output: str, extra: list[str]) -> list[str] | None:
    """The `distbench bisect` command line that names the commit of a regression, or None where there is no
    commit to name: an improvement, or a change between two runs of one commit (the machine, not the code)."""
    if not found.actionable or found.same_commit or "strategy" not in found.series.config:
        return None  # nothing worth naming, or a collective's bandwidth, which `distbench bisect` does not follow
    argv = ["distbench", "bisect", "--good", found.last_good.commit, "--bad", found.first_bad.commit]
    argv += ["--repo", repo] if repo else []
    return [*argv, *_workload_flags(found.series.config), *extra, "-o", output]


def _fmt(series: Series, value: float) -> str:
    return f"{value:.4g} {series.unit}"


def describe(found: Found) -> str:
    """One change in words: where, how much with its interval, and why no bisect where there is none."""
    c, s = found.change, found.series
    what = "regression" if found.worse else "improvement"
    text = (
        f"{what}: {_fmt(s, c.before)} -> {_fmt(s, c.after)}, {c.percent:+.2f}% "
        f"[{(c.low - 1) * 100:+.2f}%, {(c.high - 1) * 100:+.2f}%] (p = {c.p_value:.3f}); last good "
        f"{found.last_good.commit[:10]}, first bad {found.first_bad.commit[:10]}"
    )
    if s.ratio and found.actionable and not found.same_commit:
        text += "; a ratio against the frozen reference: its bisect compares the commits side by side"
    if found.same_commit:
        text += "; both runs of one commit: the machine or its environment moved, not the code"
    elif found.negligible:
        text += "; its whole interval lies within --min-effect: too small to bisect"
    if found.left_out:
        text += f"; {found.left_out} flagged point(s) left out"
    return text


def command_text(argv: list[str]) -> str:
    return shlex.join(argv)


def to_json(found: list[Found], commands: list[list[str] | None]) -> list[dict[str, Any]]:
    return [
        {
            "series": f.series.label,
            "metric": f.series.metric,
            "unit": f.series.unit,
            "config": f.series.config,
            "index": f.change.index,
            "last_good": f.last_good.commit,
            "first_bad": f.first_bad.commit,
            "before": f.change.before,
            "after": f.change.after,
            "ratio": f.change.ratio,
            "ratio_interval": [f.change.low, f.change.high],
            "p_value": f.change.p_value,
            "regression": f.worse,
            "negligible": f.negligible,
            "flagged_left_out": f.left_out,
            "bisect": command_text(argv) if argv else None,
        }
        for f, argv in zip(found, commands, strict=True)
    ]
