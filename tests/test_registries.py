"""The strategy registry and the metric registry are complete: every fact another module reads about a
strategy or a metric is in its entry, and an incomplete entry fails here (not on a GPU hours later)."""

from __future__ import annotations

import dataclasses

import pytest

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.invariants.export import EXPORTERS
from distbench.strategies import REGISTRY, default_strategies, get_spec
from distbench.strategies.spec import GRIDS, MemoryLayout, StrategySpec, check_spec


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_strategy_entry_is_complete(name):
    assert check_spec(REGISTRY[name], set(EXPORTERS)) == []


def _planted(**changes) -> StrategySpec:
    return dataclasses.replace(REGISTRY["fsdp_full"], name="planted", **changes)


@pytest.mark.parametrize("changes,needle", [
    ({"memory": None}, "no memory layout"),
    ({"memory": MemoryLayout(sharded=frozenset({"activations"}))}, "components outside"),
    ({"checkpoint": None}, "no checkpoint format"),
    ({"checkpoint": dataclasses.replace(REGISTRY["fsdp_full"].checkpoint, exporter="hdf5")}, "unknown exporter 'hdf5'"),
    ({"cpu": False}, "GPU only without saying why"),
    ({"cpu": False, "gpu_only_why": "CUDA only", "grids": frozenset({"cpu"})}, "CPU default grid"),
    ({"grids": frozenset({"nightly"})}, "unknown grid"),
    ({"target": "distbench.strategies.fsdp:NoSuchTrainer"}, "does not name a callable"),
    ({"config_check": "distbench.strategies.ds_config:no_such_check"}, "does not name a callable"),
], ids=["no-memory", "bad-component", "no-checkpoint", "unknown-exporter", "gpu-only-why", "cpu-grid", "grid",
        "target", "config-check"])
def test_an_incomplete_strategy_entry_fails(changes, needle):
    found = check_spec(_planted(**changes), set(EXPORTERS))
    assert any(needle in f for f in found), found


def test_default_grids_come_from_the_registry():
    """What `distbench run`, asv and `distbench ab` run without flags (seed 004's set on GPUs)."""
    from distbench.matrix import default_matrix

    assert default_strategies("cuda") == ["single", "ddp", "fsdp_full", "fsdp_grad", "zero2", "zero3"]
    assert default_matrix("cpu", 0).strategies == default_strategies("cpu")
    assert default_matrix("cuda", 4).strategies == default_strategies("cuda")
    for grid in GRIDS:
        assert default_strategies(grid), f"grid {grid} is empty"
    with pytest.raises(ValueError, match="unknown grid"):
        default_strategies("nightly")  # type: ignore[arg-type]


def test_user_options_are_typed():
    spec = get_spec("zero2")
    cfg = RunConfig(strategy="zero2", world_size=1, options={"ds_config": 3})
    with pytest.raises(ConfigError, match="option 'ds_config'"):
        spec.options_for(cfg)
    assert spec.options_for(cfg.replace(options={"ds_config": {"gradient_clipping": 0.5}}))["stage"] == 2
    with pytest.raises(ConfigError, match="has no option 'ds_config'"):
        get_spec("ddp").options_for(cfg.replace(strategy="ddp", options={"ds_config": {}}))


def test_only_strategies_whose_format_reshards_say_so():
    """The resharding and export tests cover strategies whose registry format supports it."""
    for name in ("fsdp_full", "fsdp_grad", "zero2", "zero3"):  # tests/test_checkpoint.py::test_resharding
        assert REGISTRY[name].checkpoint.reshards
    assert not REGISTRY["ddp"].checkpoint.reshards and REGISTRY["ddp"].checkpoint.exporter is None

