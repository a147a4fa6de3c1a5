"""Rules of the A/B gate's interleaved pair (gate/ab.py's _play_interleaved, what `distbench ab` runs by
default): in which order the two variants set up, take turns window by window (ABBA) and finish; what a
failed or out-of-memory piece leaves behind. Scripted servers stand in for the variants: no ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest

from distbench.config import RunConfig
from distbench.gate import ab
from distbench.metrics import names

CFG = RunConfig(
    strategy="ddp", world_size=2, model="gpt2-tiny", steps=7, windows=3
)  # windows of 3, 2, 2 steps


class Servers:
    """gate/ab.py's Servers: records every request posted, in order; replies as scripted per (side, op), a
    window's step time otherwise 0.1 s for base and 0.11 s for head (0.105 and 0.12 from the second on)."""

    def __init__(self, fail: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.fail = fail or {}
        self.posted: list[tuple[str, dict[str, Any]]] = []
        self.windows = {"base": 0, "head": 0}

    def post(self, side: str, request: dict[str, Any]) -> None:
        self.posted.append((side, request))

    def reply(self, side: str) -> dict[str, Any]:
        op = self.posted[-1][1]["op"]
        if (side, op) in self.fail:
            return self.fail[(side, op)]
        if op == "window":
            step_s = {"base": (0.1, 0.105), "head": (0.11, 0.12)}[side][min(self.windows[side], 1)]
            self.windows[side] += 1
            return {"status": "ok", "step_s": step_s}
        if op == "finish":
            regime = {"regime": "device-bound" if side == "base" else "host-bound"}
            metrics = {"step_time_s": 0.1, "host_instructions": 1e9, "device_compute_s": 0.05}
            return {"status": "ok", "side": side, "metrics": metrics, "regime": regime}
        return {"status": "ok"}

    def ops(self) -> list[str]:
        """Each request as side:op (and its steps for a window)."""
        return [f"{s}:{r['op']}" + (f"{r['steps']}" if r["op"] == "window" else "") for s, r in self.posted]


def outcome() -> ab.ConfigOutcome:
    return ab.ConfigOutcome(CFG, ab.label_of(CFG), interleave="windows")


@pytest.mark.parametrize(
    "order, expected",
    [
        ("AB", "base:setup head:setup base:window3 head:window3 head:window2 base:window2 base:window2 "
               "head:window2 base:finish head:finish"),
        ("BA", "head:setup base:setup head:window3 base:window3 base:window2 head:window2 head:window2 "
               "base:window2 head:finish base:finish"),
    ],
)  # fmt: skip
def test_an_interleaved_pair_sets_up_both_then_takes_turns_abba_then_finishes(
    order: str, expected: str
) -> None:
    """The pair's first variant sets up first; then the windows alternate ABBA (adjacent windows of the two
    meet the same state of the host), each of the configuration's window_steps; then both finish. The pair
    holds each side's finished result and ln(head / base) of each window's step time."""
    servers, o = Servers(), outcome()
    pair = ab._play_interleaved(o, order, servers)
    assert servers.ops() == expected.split()
    assert all(r["cfg"] == CFG.to_dict() for _, r in servers.posted if r["op"] == "setup")
    assert pair is not None and pair.order == order and o.pairs == [pair]
    assert (pair.base["side"], pair.head["side"]) == ("base", "head")
    assert pair.window_log_ratios == pytest.approx(
        [math.log(0.11 / 0.1), math.log(0.12 / 0.105), math.log(0.12 / 0.105)]
    )
    assert o.error is None and o.interleave == "windows"
    # the configuration's regime and gated metrics are the base's first run's: device-bound, so no host figure
    assert o.regime == {"regime": "device-bound"} and o.gated == ("step_time_s", "device_compute_s")


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_a_setup_that_fails_finishes_the_other_and_ends_the_configuration_naming_its_side(order: str) -> None:
    """The side whose setup failed is named with its status and error line; the other, set up, is finished
    (its ranks freed); nothing else is asked of either."""
    failed = {"status": "error", "error": "Traceback (most recent call last):\n  File x\nValueError: bad cfg"}
    servers, o = Servers({("head", "setup"): failed}), outcome()
    assert ab._play_interleaved(o, order, servers) is None
    setups = ["base:setup", "head:setup"] if order == "AB" else ["head:setup", "base:setup"]
    assert servers.ops() == [*setups, "base:finish"]
    assert (o.failed, o.error, o.interleave, o.pairs) == (
        "head",
        "head run failed (error): ValueError: bad cfg",
        "windows",
        [],
    )


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_when_both_setups_fail_the_pairs_first_side_is_named_and_none_is_finished(order: str) -> None:
    servers = Servers(
        {("base", "setup"): {"status": "error", "error": "b"}, ("head", "setup"): {"status": "error"}}
    )
    o = outcome()
    assert ab._play_interleaved(o, order, servers) is None
    assert servers.ops() == (["base:setup", "head:setup"] if order == "AB" else ["head:setup", "base:setup"])
    first = "base" if order == "AB" else "head"
    assert o.failed == first
    assert o.error == ("base run failed (error): b" if first == "base" else "head run failed (error): ")


def test_two_runs_that_do_not_fit_in_memory_at_once_fall_back_to_whole_runs_without_an_error() -> None:
    """An out-of-memory setup (either side) or window: the configuration plays whole runs from then on, and
    says why; it is not a failure."""
    oom = {"status": "oom", "error": "CUDA out of memory"}
    for fail, note, ops in (
        ({("head", "setup"): oom}, "the two runs do not fit in device memory at once", ["base:setup", "head:setup", "base:finish"]),
        ({("base", "setup"): oom, ("head", "setup"): {"status": "error"}}, "the two runs do not fit in device memory at once", ["base:setup", "head:setup"]),
        ({("head", "window"): oom}, "the two runs ran out of device memory side by side", ["base:setup", "head:setup", "base:window3", "head:window3", "base:finish"]),
    ):  # fmt: skip
        servers, o = Servers(fail), outcome()
        assert ab._play_interleaved(o, "AB", servers) is None
        assert (o.interleave, o.note, o.error, o.failed) == ("runs", note, None, None)
        assert servers.ops() == ops


@pytest.mark.parametrize("side", ["base", "head"])
def test_a_window_that_fails_finishes_the_other_side_and_names_its_own(side: str) -> None:
    servers, o = Servers({(side, "window"): {"status": "error", "error": "rank 1 died"}}), outcome()
    assert ab._play_interleaved(o, "BA", servers) is None
    other = "head" if side == "base" else "base"
    first = ["head:setup", "base:setup", "head:window3"]
    assert servers.ops() == (
        first + [f"{other}:finish"] if side == "head" else first + ["base:window3", "head:finish"]
    )
    assert (o.failed, o.error, o.interleave) == (side, f"{side} run failed (error): rank 1 died", "windows")


def test_a_failure_without_words_is_named_by_its_status_alone() -> None:
    o = outcome()
    ab._failed(o, "base", {"status": "oom"})
    assert (o.failed, o.error) == ("base", "base run failed (oom): ")


@pytest.mark.parametrize("order, first", [("AB", "base"), ("BA", "head")])
def test_a_whole_run_pair_whose_first_run_fails_does_not_run_the_second(order: str, first: str) -> None:
    """Whole runs (a variant without windows in pieces, or a fallback): the pair's first variant runs first;
    when it fails the other is not run, and the failure is named by the side that failed (a BA pair once
    named base for head's failed run)."""
    ran: list[str] = []

    def run(side: str):
        def go(cfg: RunConfig) -> dict[str, Any]:
            ran.append(side)
            return {"status": "error", "error": f"{side} broke"} if side == first else {"status": "ok"}

        return go

    o = outcome()
    assert ab._play_pair(o, order, run("base"), run("head")) is None
    assert ran == [first]
    assert (o.failed, o.error) == (first, f"{first} run failed (error): {first} broke")


def test_a_judgement_has_a_row_for_each_gated_metric_then_the_device_candidates_and_the_reported_ones() -> (
    None
):
    """Beside the gated metrics, the rows report every device-side candidate (ab "device") and every metric
    whose A/B role is "report", in registry order; metrics with no A/B role get no row, and neither does a
    metric some run lacks or has at 0."""
    metrics = {name: 1.0 + i / 100 for i, name in enumerate(names())}
    base = {"status": "ok", "metrics": {**metrics, "busy_ratio": 0.0}}
    head = {"status": "ok", "metrics": {k: v * 1.001 for k, v in metrics.items() if k != "host_cycles"}}
    o = outcome()
    o.pairs = [ab.Pair("AB" if i % 2 == 0 else "BA", base, head) for i in range(4)]
    o.gated = ("step_time_s", "mem_allocated_peak_bytes")
    ab.judge(o, alpha=0.05, threshold=0.02, min_effect=0.01)
    assert [(r.metric, r.gated) for r in o.rows] == [
        ("step_time_s", True),
        ("mem_allocated_peak_bytes", True),
        ("device_compute_s", False),
        ("device_compute_mean_s", False),
        ("device_compute_floor_s", False),
        ("tokens_per_s", False),
        ("host_cpu_s", False),
        ("step_gcycles", False),
        ("device_comm_s", False),
    ]
    assert all(r.label == o.label == "ddp ws2 gpt2-tiny fp32 mb2" for r in o.rows)
    assert all(r.effect is not None and len(r.base) == 4 for r in o.rows)
    o.pairs = o.pairs[:2]  # fewer pairs than an interval needs (stats.MIN_RUNS): every row undecided
    ab.judge(o, alpha=0.05, threshold=0.02, min_effect=0.01)
    assert len(o.rows) == 9 and all(r.verdict == "undecided" and r.effect is None for r in o.rows)


def clocked_runs(run_s: float):
    """run_base and run_head on a fake clock: each run takes `run_s` seconds and gives the same figures."""
    now = [1000.0]  # a monotonic clock starts anywhere

    def run(cfg: RunConfig) -> dict[str, Any]:
        now[0] += run_s
        return {"status": "ok", "metrics": {"step_time_s": 0.1}}

    return run, (lambda: now[0])


def test_whole_runs_alternate_without_servers_within_ten_minutes_by_default() -> None:
    """Without servers a configuration plays whole runs ("runs" in the report). The default budget is 600 s:
    no round starts that would end past it (rounds of 100.1 s: five, the sixth would end at 600.6 s)."""
    run, clock = clocked_runs(50.05)
    report = ab.run_ab([CFG], run, run, min_pairs=6, max_pairs=12, look_every=3, clock=clock)
    (o,) = report.outcomes
    assert o.interleave == "runs" and len(o.pairs) == 5 and report.budget_exhausted
    assert report.elapsed_s == pytest.approx(500.5)
    run, clock = clocked_runs(50.0)  # a sixth round ends at 600 s exactly: within the budget
    report = ab.run_ab([CFG], run, run, min_pairs=6, max_pairs=12, look_every=3, clock=clock)
    assert len(report.outcomes[0].pairs) == 6 and report.budget_exhausted is False


def test_nothing_to_compare_is_undecided_at_the_alpha_asked() -> None:
    run, clock = clocked_runs(1.0)
    report = ab.run_ab([], run, run, alpha=0.1, clock=clock)
    assert (report.status, report.per_test_alpha, report.budget_exhausted) == ("undecided", 0.1, False)
    assert report.alpha == 0.1 and (report.base_desc, report.head_desc) == ("", "")  # the caller names them


def test_interleaved_rounds_alternate_which_variant_goes_first_and_a_failed_pair_is_not_replayed() -> None:
    """Rounds alternate the pair's order, AB then BA then AB: round 1 sets up base first. A configuration whose
    interleaved pair failed (not for memory) ends there: no whole runs are tried in its place."""
    ran: list[str] = []

    def run(cfg: RunConfig) -> dict[str, Any]:
        ran.append("run")
        return {"status": "ok", "metrics": {"step_time_s": 0.1}}

    servers = Servers()
    ab.run_ab([CFG], run, run, servers=servers, min_pairs=3, max_pairs=3)
    setups = [side for side, r in servers.posted if r["op"] == "setup"]
    assert setups == ["base", "head", "head", "base", "base", "head"] and ran == []
    servers = Servers({("head", "setup"): {"status": "error", "error": "no"}})
    recycled: list[int] = []
    report = ab.run_ab(
        [CFG], run, run, servers=servers, min_pairs=3, max_pairs=3, between_rounds=lambda: recycled.append(1)
    )
    assert ran == [] and recycled == [] and report.outcomes[0].error == "head run failed (error): no"


CFG1 = RunConfig(strategy="single", world_size=1, model="gpt2-tiny", steps=7, windows=3)


def recorded_runs(fail: RunConfig | None = None, step_s: dict[str, float] | None = None):
    """run_base and run_head that record (side, configuration's label) in order; `fail`'s runs fail."""
    ran: list[tuple[str, str]] = []

    def side(name: str):
        def run(cfg: RunConfig) -> dict[str, Any]:
            ran.append((name, ab.label_of(cfg)))
            if cfg == fail:
                return {"status": "error", "error": "cannot"}
            noise = 1 + 0.2 * (len(ran) % 3 - 1)  # pairs 20% apart either way: no configuration is decided
            return {"status": "ok", "metrics": {"step_time_s": (step_s or {}).get(name, 0.1) * noise}}

        return run

    return ran, side("base"), side("head")


def test_each_pair_is_reported_a_failed_configuration_leaves_the_others_and_a_quota_caps_its_pairs() -> None:
    """on_pair sees every pair played with its configuration; a configuration whose run fails leaves the
    rotation and the next one is still played; a quota (per label, relative.allot's) is the most pairs that
    configuration plays, the others going on to max_pairs."""
    ran, base, head = recorded_runs(fail=CFG)
    seen: list[tuple[str, str]] = []
    report = ab.run_ab(
        [CFG, CFG1], base, head, min_pairs=3, max_pairs=5, look_every=5,
        on_pair=lambda o, pair: seen.append((o.label, pair.order)), quota={ab.label_of(CFG1): 4},
    )  # fmt: skip
    failed, quoted = report.outcomes
    assert failed.error == "base run failed (error): cannot" and failed.pairs == []
    assert len(quoted.pairs) == 4 and seen == [(quoted.label, o) for o in ("AB", "BA", "AB", "BA")]
    assert ran[:3] == [("base", failed.label), ("base", quoted.label), ("head", quoted.label)]
    _, base, head = recorded_runs()
    report = ab.run_ab(
        [CFG, CFG1], base, head, min_pairs=3, max_pairs=5, look_every=5, quota={ab.label_of(CFG1): 3}
    )
    assert [len(o.pairs) for o in report.outcomes] == [5, 3]  # CFG has no quota: max_pairs


def test_the_variants_are_recycled_between_rounds_but_not_after_the_last() -> None:
    _, base, head = recorded_runs()
    recycled: list[int] = []
    ab.run_ab([CFG], base, head, min_pairs=3, max_pairs=3, between_rounds=lambda: recycled.append(1))
    assert recycled == [1, 1]


def test_the_per_test_alpha_is_fixed_after_the_first_round_whatever_happens_after() -> None:
    """The family's alpha over the gated metrics of every configuration and the scheduled looks plus one
    (a last judgement where the budget ends between looks): one metric, looks at 6, 9 and 12 pairs:
    0.05 / 1 / 4, even when a quota of one pair ends the comparison after its first round."""
    _, base, head = recorded_runs()
    report = ab.run_ab([CFG], base, head, quota={ab.label_of(CFG): 1})
    assert report.per_test_alpha == 0.0125 and report.looks == (6, 9, 12)
    _, base, head = recorded_runs(fail=CFG)  # nothing gated at all (the one run failed): counted as one test
    assert ab.run_ab([CFG], base, head).per_test_alpha == 0.0125


def test_a_configuration_that_falls_back_to_whole_runs_plays_them_in_the_rounds_order() -> None:
    """Two runs that do not fit in memory at once: the round's pair is played as whole runs at once, in the
    round's order (round 1: base first), after the variants' ranks are recycled."""
    ran, base, head = recorded_runs()
    recycled: list[int] = []
    servers = Servers({("head", "setup"): {"status": "oom", "error": "out of memory"}})
    report = ab.run_ab(
        [CFG],
        base,
        head,
        servers=servers,
        min_pairs=3,
        max_pairs=3,
        between_rounds=lambda: recycled.append(1),
    )
    assert [side for side, _ in ran] == ["base", "head", "head", "base", "base", "head"]
    assert report.outcomes[0].interleave == "runs" and len(report.outcomes[0].pairs) == 3 and recycled[0] == 1


def test_a_configuration_is_named_by_its_strategy_size_model_precision_micro_batch_and_checkpointing() -> (
    None
):
    assert ab.label_of(CFG) == "ddp ws2 gpt2-tiny fp32 mb2"
    assert ab.label_of(CFG.replace(activation_checkpointing=True, precision="bf16-amp")) == (
        "ddp ws2 gpt2-tiny bf16-amp mb2 +AC"
    )
