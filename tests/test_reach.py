"""What a series can find (history/reach.py, `distbench history --reach N`): the smallest step the change-point
search places at its point, checked against the search itself on fresh draws, and scaled by each series' noise."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from distbench.cli import main
from distbench.gate.relative import save_night
from distbench.history import reach
from distbench.history.changepoints import find_changes
from extras import need


@pytest.fixture(autouse=True, scope="module")
def history_extra() -> None:
    need("ruptures")


def fresh_share(before: int, after: int, sigmas: float, alpha: float) -> float:
    """The share of 100 series, drawn apart from reach's own draws, in which the search places a step of
    `sigmas` at its point: the reference a reach is checked against."""
    rng = np.random.default_rng(12345)
    hits = 0
    for i in range(100):
        sd = 0.02
        x = np.exp(rng.normal(0, sd, before + after) + np.r_[np.zeros(before), np.full(after, sigmas * sd)])
        hits += any(c.index == before for c in find_changes(x, alpha=alpha, seed=1000 + i))
    return hits / 100


def test_a_reach_is_found_most_of_the_time_and_half_of_it_is_not():
    """The smallest step, in noise sigmas, that 10 points then 4 more at alpha 0.05 find at its point: fresh
    series find a step that size about POWER of the time, and a step half that size clearly less often."""
    sigmas = reach.smallest_sigmas(10, 4, 0.05)
    assert sigmas is not None and 1.5 < sigmas < 6
    assert fresh_share(10, 4, sigmas, 0.05) >= reach.POWER - 0.12
    assert fresh_share(10, 4, sigmas / 2, 0.05) <= reach.POWER - 0.3
    # the search's resolution: one halving less would have been found POWER of the time too
    assert reach.found_share(10, 4, sigmas - reach.MAX_SIGMAS / 2**reach.HALVINGS, 0.05) < reach.POWER


def test_a_step_counts_as_found_only_at_its_point(monkeypatch):
    """A change the search places a point early is not found: a bisect from there would miss the commit."""
    from distbench.history.changepoints import Change

    def at(offset: int):
        return lambda x, alpha, seed: [Change(len(x) - 4 + offset, 1.0, 1.1, 1.1, 1.05, 1.15, 0.01)]

    monkeypatch.setattr(reach, "find_changes", at(0))
    assert reach.found_share(10, 4, 3.0, 0.05) == 1.0
    monkeypatch.setattr(reach, "find_changes", at(-1))
    assert reach.found_share(10, 4, 3.0, 0.05) == 0.0


def test_a_series_reach_is_its_noise_times_the_sigmas_and_counts_the_points_since_its_last_change():
    rng = np.random.default_rng(7)
    values = list(np.exp(rng.normal(0, 0.01, 14)))
    r = reach.reach(values, since=4, after=4, alpha=0.05)
    segment = np.log(values[4:])
    sd = float(np.median(np.abs(np.diff(segment)))) * 1.4826 / math.sqrt(2)
    assert r.points == 10
    assert r.noise == pytest.approx(math.expm1(sd))
    assert r.step == pytest.approx(math.expm1(reach.smallest_sigmas(10, 4, 0.05) * sd))
    twice = reach.reach([float(v) for v in np.exp(2 * np.log(values))], since=4, after=4, alpha=0.05)
    assert math.log1p(twice.step) == pytest.approx(2 * math.log1p(r.step))


def test_too_few_points_are_out_of_reach_and_a_noise_free_series_finds_any_step():
    # 2 + 2 points: a perfect separation's permutation p is 1/3 at best
    assert reach.smallest_sigmas(2, 2, 0.05) is None
    assert reach.reach([1.0, 1.01, 0.99], since=0, after=2, alpha=0.05).step is None
    assert reach.smallest_sigmas(1, 6, 0.05) is None and reach.smallest_sigmas(6, 1, 0.05) is None
    flat = reach.reach([2.0] * 10, since=0, after=4, alpha=0.05)
    assert (flat.noise, flat.step) == (0.0, 0.0)


def _night(i: int, ratio: float):
    from test_relative import _row, night

    return night(i, [_row(ratio)])


def test_the_command_says_what_each_series_can_find(tmp_path, capsys):
    ratios = [1.0, 1.008, 0.995, 1.004, 0.998, 1.006, 0.993, 1.002, 1.001, 0.997]
    for i, r in enumerate(ratios):
        save_night(_night(i, r), tmp_path / "nights" / f"night-{i:02d}")
    out = tmp_path / "h"
    argv = [
        "history",
        "--nights",
        str(tmp_path / "nights"),
        "--alpha",
        "0.05",
        "--reach",
        "4",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "what each series can find" in printed and "finds from 4 more" in printed
    saved = json.loads((out / "reach.json").read_text())
    assert (saved["after"], saved["power"], saved["alpha"]) == (4, reach.POWER, 0.05)
    (ratio,) = [s for s in saved["series"] if "head/reference" in s["series"]]
    expected = reach.reach(ratios, since=0, after=4, alpha=0.05)
    assert (ratio["points"], ratio["noise"], ratio["step"]) == (10, expected.noise, expected.step)
    assert f"a {expected.step * 100:.2f}% step" in printed


def test_a_reach_of_fewer_than_two_points_is_refused(tmp_path, capsys):
    assert main(["history", "--nights", str(tmp_path), "--reach", "1"]) == 2
    assert "--reach must be at least 2 points" in capsys.readouterr().out
