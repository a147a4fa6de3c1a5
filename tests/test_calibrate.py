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
    with pytest.raises(ValueError) as refused:
        cal.calibrate(report, default_looks=[6, 9, 12])
    assert str(refused.value) == (
        "not an A/A comparison: base 'this checkout', head 'rev=HEAD~1'; calibrate reads comparisons of a "
        "variant against itself (distbench ab with no --head)"
    )


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


def test_the_pairs_judged_are_the_rounds_trimmed_window_ratios_for_step_time_else_each_pair_s_log_ratio():
    """pair_log_ratios: the windowed step time, where every round recorded its windows, is judged on each
    round's trimmed mean of its window ratios; any other metric, or a round without windows, on ln(head/base)
    of each pair of runs."""
    rounds = [[0.01, 0.01, 0.01, 0.01, 0.01], [0.02, 0.02, 0.02, 0.02, 0.02], [-0.01] * 5]
    config = {"window_log_ratios": rounds}
    row = {"metric": "step_time_s", "base": [1.0, 1.0, 1.0], "head": [np.e, 1.0, 1.0]}
    assert cal.pair_log_ratios(config, row) == pytest.approx([0.01, 0.02, -0.01])
    assert cal.pair_log_ratios(config, {**row, "metric": "device_compute_s"}) == pytest.approx(
        [1.0, 0.0, 0.0]
    )
    for windows in (None, [], [[0.01], [], [0.02]]):
        assert cal.pair_log_ratios({"window_log_ratios": windows}, row) == pytest.approx([1.0, 0.0, 0.0])
    assert cal.pair_log_ratios({}, row) == pytest.approx([1.0, 0.0, 0.0])


def _stub_verdicts(monkeypatch, by_look) -> list:
    """Stand in stats.verdicts: at the i-th look, by_look[i](rows) gives each replay's verdict. The calls."""
    calls = []

    def verdicts(est, lo, hi, direction, *, threshold, min_effect):
        calls.append((len(est), direction, threshold, min_effect))
        return np.array(by_look[len(calls) - 1](len(est)), dtype=object)

    monkeypatch.setattr(stats, "verdicts", verdicts)
    return calls


def _replay(d, metric="step_time_s", looks=(6, 9, 12), resamples=4, seed=0):
    return cal.replay(
        np.asarray(d),
        metric,
        looks=list(looks),
        per_test_alpha=0.01,
        threshold=0.02,
        min_effect=0.01,
        resamples=resamples,
        rng=np.random.default_rng(seed),
    )


D = [0.01, -0.02, 0.005, 0.03, -0.01, 0.0]


def test_a_replay_ends_at_its_first_decision_and_counts_only_that_one(monkeypatch):
    """Each replay is judged at each look until it is decided: an alarm is a replay whose first decision is
    REGRESSION. Four replays: two alarm at the first look, one is undecided there and alarms at the second,
    one is found unchanged at the first look (its later REGRESSIONs count for nothing): 3 of 4."""
    r, u, s = stats.REGRESSION, stats.UNDECIDED, stats.UNCHANGED
    looks = [lambda k: [r, r, u, s], lambda k: [r, r, r, r], lambda k: [r, r, r, r]]
    calls = _stub_verdicts(monkeypatch, looks)
    assert _replay(D) == 0.75 and len(calls) == 3
    always = _stub_verdicts(monkeypatch, [lambda k: [r] * k] * 3)
    assert _replay(D, resamples=10) == 1.0 and len(always) == 3
    _stub_verdicts(monkeypatch, [lambda k: [u] * k, lambda k: [u] * k, lambda k: [u] * (k - 1) + [r]])
    assert _replay(D, resamples=10) == 0.1  # decided at the last look
    _stub_verdicts(monkeypatch, [lambda k: [s] * k] + [lambda k: [r] * k] * 2)
    assert _replay(D, resamples=10) == 0.0


def test_each_look_judges_the_first_pairs_drawn_by_the_gate_s_rule_for_the_metric(monkeypatch):
    """At a look of n pairs the replay takes the first n draws of every replay, the per-test alpha and the
    metric's own interval (the trimmed mean for memory), then its direction, threshold and minimum effect."""
    seen = []
    real = stats.intervals

    def intervals(d, alpha, *, trimmed):
        seen.append((d.shape, alpha, trimmed))
        return real(d, alpha, trimmed=trimmed)

    monkeypatch.setattr(stats, "intervals", intervals)
    calls = _stub_verdicts(monkeypatch, [lambda k: [stats.UNDECIDED] * k] * 3)
    assert _replay(D, resamples=5) == 0.0
    assert seen == [((5, 6), 0.01, False), ((5, 9), 0.01, False), ((5, 12), 0.01, False)]
    assert calls == [(5, -1, 0.02, 0.01)] * 3
    seen.clear()
    calls.clear()
    _replay(D, metric="mem_allocated_peak_bytes", looks=(6,), resamples=5)
    _replay(D, metric="tokens_per_s", looks=(6,), resamples=5)
    assert [t for _, _, t in seen] == [True, False] and [c[1] for c in calls] == [-1, 1]


def test_the_replays_draw_the_centred_pairs_with_silverman_s_smoothing(monkeypatch):
    """The draws are the pairs less their mean, drawn with replacement, plus normal noise of Silverman's
    bandwidth 1.06 s n^-0.2 (s the pairs' sample deviation): over many draws their mean is 0 and their
    variance the centred pairs' population variance plus the bandwidth's square."""
    drawn = []
    real = stats.intervals

    def intervals(d, alpha, *, trimmed):
        drawn.append(d)
        return real(d, alpha, trimmed=trimmed)

    monkeypatch.setattr(stats, "intervals", intervals)
    d = np.array(D) + 0.05  # a bias the replay takes out
    _replay(d, looks=(6, 12), resamples=4000, seed=3)
    draws = drawn[-1]
    assert draws.shape == (4000, 12)
    s = float(np.std(D, ddof=1))
    bandwidth = 1.06 * s * 6**-0.2
    expected_sd = (float(np.var(D)) + bandwidth**2) ** 0.5
    assert abs(float(draws.mean())) < 0.03 * expected_sd
    assert float(draws.std()) == pytest.approx(expected_sd, rel=0.02)
    assert np.array_equal(drawn[0], draws[:, :6])  # a look sees the first pairs of the same draws


def test_each_gated_metric_of_an_aa_is_replayed_with_its_own_settings_and_described(monkeypatch):
    """calibrate: one Calibration per gated metric with at least MIN_RUNS pairs (ungated ones and those with
    fewer are left out), in order; each the replay of its pairs with the A/A's looks (default_looks where the
    ab.json has none), per-test alpha, threshold, minimum effect and the seed's generator, shared in turn; its
    noise the pairs' sample deviation, its nominal rate the per-test alpha times the looks."""
    base = [1.0, 1.0, 1.0, 1.0]
    head = list(np.exp([0.01, 0.02, 0.03, 0.02]))
    report = aa(base, head, verdict=stats.REGRESSION)
    rows = report["configs"][0]["rows"]
    rows.append({"metric": "device_compute_s", "gated": False, "base": base, "head": head, "verdict": "x"})
    rows.append(
        {"metric": "device_compute_s", "gated": True, "base": base[:2], "head": head[:2], "verdict": "x"}
    )
    rows.append({"metric": "tokens_per_s", "gated": True, "base": base[:3], "head": head[:3], "verdict": "y"})
    report["per_test_alpha"], report["threshold"], report["min_effect"] = 0.2, 0.001, 0.0005
    del report["looks"]
    given = []

    def replay(d, metric, *, looks, per_test_alpha, threshold, min_effect, resamples, rng):
        given.append((list(d), metric, looks, per_test_alpha, threshold, min_effect, resamples, rng.random()))
        return 0.125

    monkeypatch.setattr(cal, "replay", replay)
    out = cal.calibrate(report, resamples=7, seed=11, default_looks=[6, 9])
    first, second = np.random.default_rng(11).random(2)
    assert [g[:7] for g in given] == [
        (pytest.approx([0.01, 0.02, 0.03, 0.02]), "step_time_s", [6, 9], 0.2, 0.001, 0.0005, 7),
        (pytest.approx([0.01, 0.02, 0.03]), "tokens_per_s", [6, 9], 0.2, 0.001, 0.0005, 7),
    ]
    assert [g[7] for g in given] == [first, second]
    label = "ddp ws2 gpt2-large bf16 mb16"
    assert out == [
        cal.Calibration(
            label,
            "step_time_s",
            4,
            stats.REGRESSION,
            pytest.approx(np.std([1, 2, 3, 2], ddof=1) / 100),
            0.125,
            0.4,
        ),
        cal.Calibration(label, "tokens_per_s", 3, "y", pytest.approx(0.01), 0.125, pytest.approx(0.4)),
    ]
    report["looks"] = [6, 9, 12]
    assert cal.calibrate(report, resamples=7, seed=11, default_looks=[6])[0].nominal == pytest.approx(0.6)
    assert given[-2][2] == [6, 9, 12]
    cal.calibrate(report, default_looks=[6])  # without a seed: seed 0, as the command's --seed default
    assert given[-2][6:] == (cal.RESAMPLES, np.random.default_rng(0).random())


def test_an_aa_verdict_count_comes_with_its_clopper_pearson_interval():
    """observed: (A/A verdicts that were REGRESSION, verdicts, the exact 95% interval), whose closed forms at
    the ends are (0, 1 - 0.025^(1/n)) for none and (0.025^(1/n), 1) for all, 1 - 0.975^(1/n) the low end for
    one; no verdicts at all: (0, 0, (0, 1))."""

    def of(*verdicts: str) -> list[cal.Calibration]:
        return [cal.Calibration("c", "step_time_s", 6, v, 0.01, 0.0, 0.01) for v in verdicts]

    r, u = stats.REGRESSION, stats.UNCHANGED
    k, n, (lo, hi) = cal.observed(of(u, u, u, u))
    assert (k, n, lo) == (0, 4, 0.0) and hi == pytest.approx(1 - 0.025**0.25)
    k, n, (lo, hi) = cal.observed(of(r, r, r, r))
    assert (k, n, hi) == (4, 4, 1.0) and lo == pytest.approx(0.025**0.25)
    k, n, (lo, hi) = cal.observed(of(u, r, u, stats.UNDECIDED))
    assert (k, n) == (1, 4) and lo == pytest.approx(1 - 0.975**0.25) and 0.5 < hi < 1
    assert cal.observed([]) == (0, 0, (0.0, 1.0))
    k, n, (lo, hi) = cal.observed(of(r))
    assert (k, n, hi) == (1, 1, 1.0) and lo == pytest.approx(0.025)


def test_the_family_rate_is_the_chance_of_any_alarm_over_independent_metrics():
    """family_rate = 1 - prod(1 - rate): 0.1 and 0.2 give 1 - 0.9 x 0.8 = 0.28; none gives 0."""

    def of(*rates: float) -> list[cal.Calibration]:
        return [cal.Calibration("c", "step_time_s", 6, "unchanged", 0.01, r, 0.01) for r in rates]

    assert cal.family_rate(of(0.1, 0.2)) == pytest.approx(0.28)
    assert cal.family_rate(of(0.5)) == pytest.approx(0.5)
    assert cal.family_rate([]) == 0.0
