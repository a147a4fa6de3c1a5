"""Rules that decide what a row of the table is called: the precision regime (invariants/regime.py: every
promised dtype, and only those), the host-speed finding (plausibility.py: a flag unless the figure has an
interval, not merely the key of one), and which world size a new lane serves (testsuite/schedule.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from distbench.invariants.regime import EXPECTED, DtypeRecorder, regime_differences, regime_of
from distbench.plausibility import annotate
from distbench.testsuite.schedule import LANE_START_S, Seats, Unit, next_world_size
from properties import cases
from test_plausibility import clean, run, with_host

CLEAN = {"matmul": ["bfloat16"], "layer_norm": ["float32"], "parameters": ["float32"]}


def test_the_promised_regime_is_clean_and_a_mixed_one_is_not() -> None:
    """A run whose matmuls ran in bf16 and in fp32 (one layer left outside autocast) is a mixed regime, not
    bf16-amp; so is one that is missing a part, or has none of a part recorded."""
    assert EXPECTED["bf16-amp"] == CLEAN
    assert regime_differences("bf16-amp", CLEAN) == []
    mixed = {**CLEAN, "matmul": ["bfloat16", "float32"]}
    assert regime_differences("bf16-amp", mixed) == [
        "matmul: ['bfloat16', 'float32'] where bf16-amp computes in ['bfloat16']"
    ]
    for part in CLEAN:
        assert len(regime_differences("bf16-amp", {**CLEAN, part: []})) == 1
        missing = {k: v for k, v in CLEAN.items() if k != part}
        assert regime_differences("bf16-amp", missing) == [
            f"{part}: None where bf16-amp computes in {CLEAN[part]}"
        ]
    every_part_off = {"matmul": ["float32"], "layer_norm": ["bfloat16"], "parameters": ["bfloat16"]}
    assert [d.split(":")[0] for d in regime_differences("bf16-amp", every_part_off)] == list(CLEAN)


def dispatch(recorder: DtypeRecorder, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Hand `op` to the recorder as torch's dispatcher does under the mode, without the torch._dynamo guard
    torch wraps every mode's __torch_dispatch__ in (one level: what it wrapped is the method as the class
    defines it): its first call imports torch._dynamo (1.4 s here), which the slow test below pays to run the
    mode end to end."""
    guarded = DtypeRecorder.__torch_dispatch__
    return guarded.__wrapped__(recorder, op, (), args, kwargs)  # type: ignore[attr-defined]


def test_the_recorder_keeps_each_matmuls_output_dtype_and_each_layer_norms_input_dtype() -> None:
    """mm and addmm: the dtype of what they return (the compute dtype of the matmul with the weights);
    native_layer_norm: the dtype of its input; any other op is not recorded; names as EXPECTED spells them
    ("bfloat16", not "torch.bfloat16"). Every op runs with its keyword arguments and its result is returned as
    it is."""
    rec = DtypeRecorder()
    a, w, b = torch.ones(2, 4), torch.ones(4, 4), torch.ones(4)
    out = dispatch(rec, torch.ops.aten.addmm.default, b, a, w, beta=0.5)
    assert torch.equal(out, torch.full((2, 4), 4.5))  # 0.5 x 1 + 4: beta reached the op
    assert dispatch(rec, torch.ops.aten.mm.default, a.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    normed, _, _ = dispatch(
        rec, torch.ops.aten.native_layer_norm.default, a.bfloat16(), [4], None, None, 1e-5
    )
    assert normed.dtype == torch.bfloat16 and normed.shape == (2, 4)
    assert torch.equal(
        dispatch(rec, torch.ops.aten.add.Tensor, a.half(), a.half()), torch.full((2, 4), 2.0).half()
    )
    assert rec.seen == {"matmul": {"float32", "bfloat16"}, "layer_norm": {"bfloat16"}}


def test_a_regime_is_each_parts_dtypes_sorted_with_the_parameters() -> None:
    regime = regime_of(
        {"matmul": {"float32", "bfloat16"}, "layer_norm": {"float32"}},
        [torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(2)],
    )
    assert regime == {
        "matmul": ["bfloat16", "float32"],
        "layer_norm": ["float32"],
        "parameters": ["bfloat16", "float32"],
    }


@pytest.mark.slow  # the first op under a TorchDispatchMode takes ~10 s here (torch's lazy set-up)
def test_the_recorder_keeps_every_dtype_it_saw() -> None:
    """What the check is given is every dtype of every matmul and layer norm run, sorted, with the parameters'.
    (test_regime's runs exercise it on every strategy, in their ranks.)"""
    w = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    with DtypeRecorder() as rec:
        w(x)  # fp32 addmm
        with torch.autocast("cpu", dtype=torch.bfloat16):
            w(x)  # bf16
        torch.nn.functional.layer_norm(x, (4,))
        torch.nn.functional.layer_norm(x.bfloat16(), (4,))
    regime = regime_of(rec.seen, [w.weight, w.bias.bfloat16()])
    assert regime == {
        "matmul": ["bfloat16", "float32"],
        "layer_norm": ["bfloat16", "float32"],
        "parameters": ["bfloat16", "float32"],
    }


def moved_host(interval: Any) -> dict[str, Any]:
    """A host-bound run whose host moved x1.47 (test_plausibility's case), with `interval` as its figure's."""
    r = with_host(run("ddp", 2, 1800, spread=0.3), [[0.0070, 0.0103], [0.0071, 0.0101]])
    r["step_time_s"]["interval"] = interval
    return r


def test_the_host_speed_is_a_flag_unless_the_figure_has_an_interval() -> None:
    """results.py writes `interval: None` for a figure timed in fewer than six windows: the key is there and
    there is no interval, so the finding is a flag, not a reason beside an interval."""
    no_intervals: tuple[Any, ...] = (None, [])
    for no_interval in no_intervals:
        r = moved_host(no_interval)
        results = [*clean()[:6], r]
        annotate(results)
        assert r["notes"] == [] and any(
            w.startswith("the host ran at different speeds") for w in r["warnings"]
        )
    r = moved_host([0.13, 0.16])
    annotate([*clean()[:6], r])
    assert r["warnings"] == [] and any(
        n.startswith("its interval is wide because the host ran at different speeds") for n in r["notes"]
    )


def units(draw_costs: list[tuple[int, float]]) -> list[Unit]:
    return [Unit(ws, [f"t{i}"], cost) for i, (ws, cost) in enumerate(draw_costs)]


@cases(60)
@example(pending=[(1, 5.0), (2, 30.0)], waiting={}, serving={}, devices=2, taken=[])  # the larger is ws2
@example(pending=[(1, 5.0), (1, 5.0), (2, 1.0)], waiting={1: 2}, serving={}, devices=2, taken=[])
@example(pending=[(1, LANE_START_S)], waiting={}, serving={1: 1}, devices=2, taken=[])  # work = one start
@given(
    pending=st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.floats(0.5, 60.0)), max_size=12),
    waiting=st.dictionaries(st.sampled_from([1, 2, 4]), st.integers(0, 3)),
    serving=st.dictionaries(st.sampled_from([1, 2, 4]), st.integers(0, 4)),
    devices=st.integers(1, 4),
    taken=st.lists(st.sampled_from([1, 2]), max_size=3),
)
def test_a_new_lane_serves_the_world_size_with_the_most_waiting_work_it_can_start(
    pending: list[tuple[int, float]],
    waiting: dict[int, int],
    serving: dict[int, int],
    devices: int,
    taken: list[int],
) -> None:
    """Among the world sizes with more pending units than lanes already starting for them, whose pending seconds
    exceed what the lanes at work on them do in a lane's start, and that have as many devices with a free
    seat as ranks: the one with the most pending seconds. None when there is none."""
    seats = Seats.of(devices=devices, seats=1)
    for ws in taken:
        seats.take(ws)
    work = units(pending)
    cost: dict[int, float] = {}
    count: dict[int, int] = {}
    for ws, c in pending:
        cost[ws] = cost.get(ws, 0.0) + c
        count[ws] = count.get(ws, 0) + 1
    eligible = [
        ws
        for ws in cost
        if count[ws] > waiting.get(ws, 0)
        and cost[ws] > LANE_START_S * serving.get(ws, 0)
        and len(seats.open_devices(ws)) >= ws
    ]
    chosen = next_world_size(work, waiting, seats, serving)
    if not eligible:
        assert chosen is None
    else:
        assert chosen in eligible and cost[chosen] == max(cost[ws] for ws in eligible)
