"""One precision regime for every strategy: under bf16-amp each strategy computes its matmuls in bf16 while
its layer norms see fp32 and its parameters stay fp32 (distbench.invariants.regime.EXPECTED, written from
torch.autocast's op lists), so a table of strategies compares the strategies, not three precision policies.
Under "bf16" the wrappers' own policies differ, which the last test records."""

from __future__ import annotations

from typing import Any

import pytest

import mutants
from distbench.invariants.regime import regime_differences
from distbench.jobs.checks import record_regime
from distbench.strategies import REGISTRY, get_spec


def cpu_strategies() -> list[str]:
    return [s for s in REGISTRY if get_spec(s).unsupported_reason("cpu", 1) is None]


def regime(suite: Any, strategy: str, precision: str, mutation: str | None = None) -> dict[str, list[str]]:
    ws = 1 if get_spec(strategy).max_world_size == 1 else 2
    cfg = suite.config(strategy, ws, precision=precision)
    if mutation:
        return suite.run_job(ws, mutants.record_regime, mutation=mutation, cfg=cfg)[0]
    return suite.run_job(ws, record_regime, cfg=cfg)[0]


@pytest.mark.parametrize("name", cpu_strategies())
def test_bf16_amp_is_one_regime_for_every_strategy(suite: Any, name: str) -> None:
    """At two ranks (single at one): the matmuls in bf16, layer norms and parameters in fp32."""
    assert regime_differences("bf16-amp", regime(suite, name, "bf16-amp")) == []


def test_the_regime_check_catches_a_strategy_that_leaves_autocast_off(suite: Any) -> None:
    """DeepSpeed without its torch_autocast section turns the autocast around its engine off: zero2 then
    trains in fp32 while the table says bf16-amp."""
    differences = regime_differences("bf16-amp", regime(suite, "zero2", "bf16-amp", "ds_autocast_off"))
    assert differences and differences[0].startswith("matmul: ['float32']")


def test_the_wrappers_own_bf16_policies_are_different_regimes(suite: Any) -> None:
    """Why bf16-amp exists: under "bf16" FSDP2 computes from bf16 copies of its parameters, so its layer norms
    see bf16 where DDP's autocast keeps them in fp32, and DeepSpeed holds its parameters in bf16."""
    assert regime_differences("bf16-amp", regime(suite, "ddp", "bf16")) == []
    assert any(
        d.startswith("layer_norm") for d in regime_differences("bf16-amp", regime(suite, "fsdp_full", "bf16"))
    )
    assert any(
        d.startswith("parameters") for d in regime_differences("bf16-amp", regime(suite, "zero2", "bf16"))
    )


def test_a_bf16_amp_deepspeed_job_leaves_the_next_jobs_wire_alone(suite: Any) -> None:
    """DeepSpeed marks torch_autocast initialized for the whole process: unreset, every later ZeRO-2 engine of
    the rank reduced in its parameters' dtype and a planted bf16 communication_data_type went unseen."""
    from test_wire import assert_plant_fails

    assert regime_differences("bf16-amp", regime(suite, "zero2", "bf16-amp")) == []
    assert_plant_fails(suite, "ds_bf16_communication", "zero2", 2, "fp32")
