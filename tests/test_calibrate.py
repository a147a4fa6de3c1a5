"""`distbench calibrate`: the gate's false-alarm rate replayed at the noise of real A/A comparisons."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from distbench.gate import calibrate as cal
from distbench.gate import stats


@pytest.mark.parametrize("pairs", [3, 4, 6, 9, 12])
@pytest.mark.parametrize("trimmed", [False, True])
def test_the_vectorised_intervals_are_the_gates_own(trimmed, pairs):
    """The replay must judge exactly as the gate does: each row's interval equals the scalar function's."""
    rng = np.random.default_rng(pairs)
    d = rng.standard_t(3, size=(50, pairs)) * 0.02
    est, lo, hi = stats.intervals(d, 0.01, trimmed=trimmed)
    scalar = stats.trimmed_log_ratio_effect if trimmed else stats.log_ratio_effect
    for i, row in enumerate(d):
        e = scalar(row, 0.01)
        assert (est[i], lo[i], hi[i]) == pytest.approx((e.estimate, e.low, e.high), rel=1e-9, abs=1e-12)


def test_the_vectorised_verdicts_are_the_gates_own():
    rng = np.random.default_rng(1)
    est = rng.normal(0, 0.03, 400)
    half = np.abs(rng.normal(0, 0.02, 400))
    for direction in (-1, 1):
        got = stats.verdicts(est, est - half, est + half, direction, threshold=0.02, min_effect=0.01)
        for e, h, v in zip(est, half, got, strict=True):
            effect = stats.Effect(6, e, e - h, e + h, 0.99, 0.0, 1.0, 0.0)
            assert v == stats.verdict(effect, direction, threshold=0.02, min_effect=0.01)


def aa(
    base: list[float], head: list[float], *, metric: str = "step_time_s", verdict: str = "unchanged"
) -> dict:
    """A minimal ab.json of one A/A configuration."""
    return {
        "base": "this checkout",
        "head": "this checkout",
        "alpha": 0.05,
        "per_test_alpha": 0.05 / 4,
        "threshold": 0.02,
        "min_effect": 0.01,
        "looks": [6, 9, 12],
        "configs": [
            {
                "label": "ddp ws2 gpt2-large bf16 mb16",
                "window_log_ratios": None,
                "rows": [{"metric": metric, "gated": True, "base": base, "head": head, "verdict": verdict}],
            }
        ],
    }


def test_a_quiet_machine_replays_within_the_alpha_spent():
    rng = np.random.default_rng(2)
    base = list(0.3 * np.exp(rng.normal(0, 0.005, 12)))
    head = list(0.3 * np.exp(rng.normal(0, 0.005, 12)))
    (c,) = cal.calibrate(aa(base, head), default_looks=[6, 9, 12])
    assert c.pairs == 12 and c.false_alarm <= 2 * c.nominal


def test_a_biased_aa_is_counted_as_an_alarm_and_replayed_centred():
    """An A/A whose head ran 3% slower in every pair: its own verdict is a false alarm, which observed()
    counts; the replay centres the pairs, so it measures the rule at this noise, not the bias."""
    base = [0.300, 0.301, 0.299, 0.300, 0.302, 0.300]
    head = [b * 1.03 for b in base]
    rows = cal.calibrate(aa(base, head, verdict=stats.REGRESSION), default_looks=[6, 9, 12])
    assert rows[0].false_alarm == 0.0
    k, n, (lo, hi) = cal.observed(rows)
    assert (k, n) == (1, 1) and 0.0 < lo < hi == 1.0


def test_a_comparison_of_two_variants_is_refused():
    report = aa([0.3] * 6, [0.3] * 6)
    report["head"] = "rev=HEAD~1"
    with pytest.raises(ValueError, match="not an A/A comparison"):
        cal.calibrate(report, default_looks=[6, 9, 12])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distbench.cli", "calibrate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # `distbench calibrate` as a process, twice (~4 s on 2 cores)
def test_the_command_reports_aa_runs_skips_the_others_and_names_a_damaged_file(tmp_path):
    rng = np.random.default_rng(4)
    good = aa(list(0.3 * np.exp(rng.normal(0, 0.01, 6))), list(0.3 * np.exp(rng.normal(0, 0.01, 6))))
    (tmp_path / "aa").mkdir()
    (tmp_path / "aa" / "ab.json").write_text(json.dumps(good))
    plant = dict(good, head="tree=/tmp/plant")
    (tmp_path / "plant").mkdir()
    (tmp_path / "plant" / "ab.json").write_text(json.dumps(plant))
    out = _cli(str(tmp_path), "--resamples", "200", "--json", str(tmp_path / "cal.json"))
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "skipped" in text and "not an A/A comparison" in text
    assert "0 false alarm(s) in 1 gated metric verdicts" in text
    saved = json.loads((tmp_path / "cal.json").read_text())
    assert len(saved["rows"]) == 1 and saved["rows"][0]["metric"] == "step_time_s"

    (tmp_path / "aa" / "ab.json").write_text("{not json")
    bad = _cli(str(tmp_path / "aa"))
    assert bad.returncode == 2 and "not a readable ab.json" in bad.stderr and "ab.json" in bad.stderr
    none = _cli(str(tmp_path / "plant"))
    assert none.returncode == 2 and "no A/A comparison" in none.stderr
