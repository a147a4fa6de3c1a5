"""Which GPU cases a 2-GPU machine runs by default: a one-GPU case skips only where its world-size-2 twin runs
(plugin.one_gpu_repeats), and a case marked nightly_gpu from its world size up waits for the nightly GPU job
(plugin.nightly_gpu_cases); an exclusive case that needs a quiet host is planned as one (plugin._case). Fake
items: the rules are pure selection, no GPU needed to check them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from distbench.testsuite.plugin import nightly_gpu_cases, one_gpu_repeats


def case(
    test: str, strategy: str, world_size: int, skipped: bool = False, nightly_from: int = 0, **params: Any
) -> Any:
    """A collected GPU case as the rules read it: nodeid, parameters, skip marks, a nightly_gpu mark."""
    marks = [pytest.mark.skip(reason="planted").mark] if skipped else []
    marks += [pytest.mark.nightly_gpu(nightly_from, "planted why").mark] if nightly_from else []
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


def test_a_case_marked_nightly_gpu_skips_from_its_world_size_up_with_the_way_to_run_it() -> None:
    items = [case("test_claim", "ddp", ws, nightly_from=2) for ws in (1, 2, 4)]
    items += [case("test_claim", "zero2", 2, skipped=True, nightly_from=2), case("test_other", "ddp", 2)]
    chosen = nightly_gpu_cases(items)
    assert ids([it for it, _ in chosen]) == ["test_claim[ddp-ws2-gpu]", "test_claim[ddp-ws4-gpu]"]
    assert chosen[0][1] == "planted why; `--world-sizes 2` runs it here (the nightly GPU job does)"


def test_an_exclusive_case_that_needs_a_quiet_host_is_planned_as_one() -> None:
    """`exclusive(quiet_host=True)` reaches the plan (schedule.Case.quiet_host), which keeps such a case out of
    the solo lane; a plain `exclusive` case does not ask for it."""
    from distbench.testsuite.plugin import _case

    quiet, plain = case("test_mfu", "single", 1), case("test_spin", "single", 1)
    for item, mark in ((quiet, pytest.mark.exclusive(quiet_host=True)), (plain, pytest.mark.exclusive)):
        item.get_closest_marker = lambda name, m=mark.mark: m if name == m.name else None
    assert _case(quiet, {}).exclusive and _case(quiet, {}).quiet_host
    assert _case(plain, {}).exclusive and not _case(plain, {}).quiet_host
