"""The lane plan (distbench.schedule): small world sizes packed onto disjoint slots, a group kept in one lane,
cases that need every slot after the lanes, exclusive ones alone and last, skipped ones first."""

from __future__ import annotations

from distbench.schedule import Case, Lane, next_start, plan


def cases(spec: str, ws: int, n: int, **kw: bool) -> list[Case]:
    return [Case(f"t.py::{spec}{i}-ws{ws}", ws, spec, **kw) for i in range(n)]


def test_small_world_sizes_fill_floor_n_over_w_lanes_and_a_group_stays_in_one():
    ws1 = cases("ddp", 1, 3) + cases("zero3", 1, 2) + cases("fsdp", 1, 2) + cases("single", 1, 1)
    ws2 = cases("ddp", 2, 2) + cases("zero3", 2, 1)
    p = plan(ws1 + ws2 + cases("ddp", 4, 2), slots=4)
    assert [lane.world_size for lane in p.lanes] == [1, 1, 1, 1, 2, 2]
    for group in ("ddp", "zero3", "fsdp", "single"):
        holding = [
            lane for lane in p.lanes if any(f"::{group}" in n for n in lane.nodeids) and lane.world_size == 1
        ]
        assert len(holding) == 1, f"group {group} split over {len(holding)} lanes"
    assert sorted(n for lane in p.lanes for n in lane.nodeids) == sorted(c.nodeid for c in ws1 + ws2)
    assert p.whole == [c.nodeid for c in cases("ddp", 4, 2)]
    assert p.worth_it


def test_a_lane_keeps_collection_order():
    mixed = [Case("a::1", 1, "x"), Case("a::2", 1, "y"), Case("a::3", 1, "x"), Case("a::4", 1, "y")]
    p = plan(mixed, slots=1 + 1)
    assert sorted(lane.nodeids for lane in p.lanes) == [["a::1", "a::3"], ["a::2", "a::4"]]


def test_exclusive_cases_run_alone_last_and_skipped_ones_first():
    p = plan(
        [
            Case("b::ws2", 2, "g", exclusive=True),
            Case("b::ws1", 1, "g", exclusive=True),
            Case("s::skip", 1, "g", inert=True),
            *cases("ddp", 1, 2),
        ],
        slots=2,
    )
    assert p.alone == ["b::ws1", "b::ws2"]  # world size 1 first: each world size's pool is built once
    assert p.first == ["s::skip"]
    assert all("b::" not in n and "s::" not in n for lane in p.lanes for n in lane.nodeids)


def test_one_lane_is_not_worth_a_process():
    assert not plan(cases("ddp", 1, 5), slots=2).worth_it  # one group: one lane
    assert not plan(cases("ddp", 2, 5) + cases("zero3", 2, 5), slots=2).worth_it  # every slot: no lane
    assert plan(cases("ddp", 1, 1) + cases("zero3", 1, 1), slots=2).worth_it


def test_a_lane_starts_when_its_slots_are_free_and_smaller_ones_overtake_it():
    pending = [Lane(2, ["x"]), Lane(1, ["y"])]
    assert next_start(pending, [3]) == (1, [3])
    assert next_start(pending, [3, 0, 2]) == (0, [0, 2])
    assert next_start([Lane(4, ["z"])], [0, 1, 2]) is None
