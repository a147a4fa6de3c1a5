"""Which GPU cases a 2-GPU machine runs by default: a one-GPU case skips only where its world-size-2 twin runs
(plugin.one_gpu_repeats). Fake items: the rule is pure selection, no GPU needed to check it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from distbench.testsuite.plugin import one_gpu_repeats


def case(test: str, strategy: str, world_size: int, skipped: bool = False, **params: Any) -> Any:
    """A collected GPU case as one_gpu_repeats reads it: nodeid, parameters, skip marks."""
    marks = [pytest.mark.skip(reason="planted").mark] if skipped else []
    ident = "-".join([strategy, f"ws{world_size}", "gpu", *map(str, params.values())])
    return SimpleNamespace(
        nodeid=f"tests/test_x.py::{test}[{ident}]",
        callspec=SimpleNamespace(
            params={"device_type": "cuda", "strategy": strategy, "world_size": world_size, **params}
        ),
        iter_markers=lambda name=None: iter(m for m in marks if name in (None, m.name)),
        get_closest_marker=lambda name: next((m for m in marks if m.name == name), None),
    )


def ids(items: list[Any]) -> list[str]:
    return [it.nodeid.split("::")[1] for it in items]


def test_a_one_gpu_case_skips_where_its_world_size_2_twin_runs() -> None:
    items = [case("test_parity", s, ws) for s in ("ddp", "zero3") for ws in (1, 2)]
    assert ids(one_gpu_repeats(items)) == ["test_parity[ddp-ws1-gpu]", "test_parity[zero3-ws1-gpu]"]


def test_strategies_the_cpu_tier_lacks_and_single_keep_their_one_gpu_case() -> None:
    items = [case("test_parity", s, ws) for s in ("fsdp1_full", "fsdp_offload") for ws in (1, 2)]
    items.append(case("test_parity", "single", 1))
    assert one_gpu_repeats(items) == []


def test_no_twin_no_skip_a_skipped_twin_or_other_parameters_or_another_test() -> None:
    items = [
        case("test_parity", "ddp", 1),
        case("test_parity", "ddp", 2, skipped=True),  # the twin does not run: world size 1 is the only cover
        case("test_wire", "zero2", 1, precision="fp32"),
        case("test_wire", "zero2", 2, precision="bf16"),  # another precision is no twin
        case("test_export", "fsdp_full", 1),
        case("test_parity", "fsdp_full", 2),  # another test's case is no twin
    ]
    assert one_gpu_repeats(items) == []


def test_a_one_gpu_case_already_skipped_is_left_alone() -> None:
    items = [case("test_parity", "ddp", 1, skipped=True), case("test_parity", "ddp", 2)]
    assert one_gpu_repeats(items) == []
