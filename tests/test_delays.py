"""Parity under injected delays: FSDP2 (fsdp_full, fsdp_grad) and ZeRO-3 train to the reference's losses when
a delay is put before every all-gather, every reduce-scatter, or the optimizer step (tests/delay_jobs.py).

On GPUs the delay is a device-side spin on the stream the collective is issued from, the way PyTorch's FSDP
tests delay it, so a missing stream wait shows up as wrong numbers. On CPU (gloo) nothing runs behind the
host and a host sleep can only change timing: there the tests prove the patching itself, that each site's
delay fires through the very functions the strategy calls, so the GPU run delays what it claims to.
"""

from __future__ import annotations

from typing import Any

import pytest

from delay_jobs import SITES, train_with_delays
from distbench.invariants.checks import SINGLE_PROCESS_REFERENCE, assert_losses_match

DELAYED = ("fsdp_full", "fsdp_grad", "zero3")
#: World size 2: at one rank FSDP2 issues no collectives to delay.
WS = 2
#: Per delayed call: long against the kernels of a GPT-2 124M block at sequence 256 (well under 1 ms), short
#: enough that a few hundred delayed all-gathers cost a second or two.
GPU_DELAY_S = 2e-3
CPU_DELAY_S = 1e-3


def assert_parity_under_delays(out: dict[str, Any], ref: list[float], what: str) -> None:
    """Every site's delay fired, and the losses are the reference's (fp32 parity tolerance)."""
    assert out["delays"] and all(n > 0 for n in out["delays"].values()), (
        f"{what}: delays that never fired: {out['delays']}"
    )
    assert_losses_match(out["losses"], ref, what, against=SINGLE_PROCESS_REFERENCE)


def delayed_run(
    suite: Any, strategy: str, sites: list[str], delay_s: float, plant: str | None = None
) -> tuple[dict[str, Any], list[float]]:
    cfg = suite.config(strategy, WS)
    out = suite.run_job(WS, train_with_delays, cfg=cfg, sites=sites, delay_s=delay_s, plant=plant)[0]
    return out, suite.reference(cfg)["losses"]


@pytest.mark.gpu
@pytest.mark.world_size(WS)
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("name", DELAYED)
def test_parity_with_a_delay_before(suite: Any, name: str, site: str) -> None:
    """GPU: a device-side spin before every call at one site at a time."""
    out, ref = delayed_run(suite, name, [site], GPU_DELAY_S)
    assert_parity_under_delays(out, ref, f"{name} ws{WS}, delay before {site}")


@pytest.mark.parametrize("name", ["fsdp_full", "zero3"])
def test_delays_fire_at_every_site_on_cpu(suite: Any, name: str) -> None:
    """CPU: host sleeps before every all-gather, reduce-scatter and optimizer step in one run (FSDP2 and
    ZeRO-3 patch different functions); each fires and the losses keep parity."""
    out, ref = delayed_run(suite, name, list(SITES), CPU_DELAY_S)
    assert_parity_under_delays(out, ref, f"{name} ws{WS}, host delays")


def test_delay_check_catches_delays_patched_where_nothing_calls(suite: Any) -> None:
    """FSDP2's collectives patched under the names PyTorch's tests used before FSDP2 moved to the *_single
    ones: on torch 2.13 the run delays nothing (and keeps parity), which the check must not pass."""
    out, ref = delayed_run(suite, "fsdp_full", ["all_gather", "reduce_scatter"], CPU_DELAY_S, "legacy_names")
    with pytest.raises(AssertionError, match="never fired"):
        assert_parity_under_delays(out, ref, "fsdp_full ws2, delays under legacy names")
