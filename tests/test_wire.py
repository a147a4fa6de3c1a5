"""Invariant: what each strategy puts on the wire follows its precision policy (distbench/invariants/wire.py).

Every collective of a training step is recorded from the dispatcher (invariants/collectives.py) and held to a
table written from the strategy's declared policy: the dtype of each kind of collective (FSDP2 under bf16
all-gathers bf16 parameters and reduce-scatters fp32 gradients, DDP under autocast all-reduces fp32, ZeRO
reduces in the regime's dtype), how many a step and how many bytes (N parameter elements per pass, plus
padding). A bf16 reduction under an fp32-reduce policy passes every loss test at 2 ranks; here it fails.
"""

from __future__ import annotations

from typing import Any

import pytest

import mutants
from distbench.config import RunConfig
from distbench.invariants.wire import POLICIES, ModelFacts, assert_wire_matches, expected_traffic
from distbench.jobs.checks import record_collectives
from distbench.strategies import REGISTRY, get_spec
from distbench.workloads import get_model

#: The precisions each tier checks. fp32 on the GPU tier would repeat the CPU tier's: torch-native strategies
#: and DeepSpeed put the same dtypes on NCCL as on gloo; DeepSpeed's fp16 runs on GPUs only.
PRECISIONS = {"cpu": ("fp32", "bf16", "fp16", "bf16-amp"), "cuda": ("bf16", "fp16", "bf16-amp")}


def wire_config(suite: Any, strategy: str, world_size: int, precision: str) -> RunConfig:
    """The tier's workload with one micro-batch a step, so a step's collectives are one pass's."""
    cfg = suite.config(strategy, world_size, precision=precision)
    return cfg.replace(micro_batch=cfg.per_rank_batch)


def expected(cfg: RunConfig) -> dict[str, Any]:
    facts = ModelFacts.of(get_model(cfg.model).build(cfg.seed, "meta"))
    return expected_traffic(
        cfg.strategy, cfg.precision, cfg.world_size, facts, replicate=cfg.options.get("replicate")
    )


def assert_every_rank(records: list[dict[str, Any]], cfg: RunConfig, what: str) -> None:
    want = expected(cfg)
    for rank, record in enumerate(records):
        assert_wire_matches(record, want, f"{what} rank {rank}")


def test_every_strategy_has_a_wire_policy() -> None:
    assert sorted(POLICIES) == sorted(REGISTRY)


_records: dict[str, list[dict[str, Any]]] = {}


def recorded(suite: Any, cfg: RunConfig) -> list[dict[str, Any]]:
    """Every rank's record of cfg's collectives, once a session (the bites' unplanted runs are the matrix's)."""
    key = f"{suite.device_type} {sorted(cfg.to_dict().items())!r}"
    if key not in _records:
        _records[key] = suite.run_job(cfg.world_size, record_collectives, cfg=cfg)
    return _records[key]


@pytest.mark.up_to_world_size(2)
@pytest.mark.slow  # ~20 s of ranks on 2 cores (the default tier runs the bites' configurations)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-amp"])
def test_collectives_follow_the_precision_policy(
    suite: Any, strategy: str, world_size: int, precision: str
) -> None:
    """Every strategy at world sizes 1 and 2, every precision it runs there (PRECISIONS): the policy is per
    collective, whatever the count of ranks (--world-sizes 4 runs it at 4 too). On one rank
    DDP, HSDP, FSDP1 (NO_SHARD) and DeepSpeed's reductions still run, over a group of one; FSDP2's sharded
    collectives and DeepSpeed's all-gathers do not (wire.py)."""
    reason = get_spec(strategy).unsupported_reason(suite.device_type, world_size, precision=precision)
    if reason:
        pytest.skip(reason)
    if precision not in PRECISIONS[suite.device_type]:
        pytest.skip(f"{precision} is checked on the CPU tier (PRECISIONS)")
    if (
        suite.device_type == "cuda"
        and precision == "fp16"
        and get_spec(strategy).trainer_module != "deepspeed"
    ):
        pytest.skip("a torch-native fp16 policy puts on NCCL what it puts on gloo: checked on the CPU tier")
    cfg = wire_config(suite, strategy, world_size, precision)
    assert_every_rank(recorded(suite, cfg), cfg, f"{strategy} ws{world_size} {precision}")


@pytest.mark.parametrize("replicate", [1, 2])
def test_hsdp_traffic_follows_its_replicate_option(suite: Any, replicate: int) -> None:
    """fsdp_hybrid at 2 ranks told its replicate groups: 1 x 2 reduce-scatters and all-gathers over both ranks
    and all-reduces over groups of one; 2 x 1 (the one-node default) only all-reduces, over both."""
    cfg = wire_config(suite, "fsdp_hybrid", 2, "bf16").replace(options={"replicate": replicate})
    want = expected(cfg)
    assert ("reduce_scatter" in want) == (replicate == 1) and want["all_reduce"].group_size == replicate
    assert_every_rank(recorded(suite, cfg), cfg, f"fsdp_hybrid ws2 replicate={replicate}")


#: (mutation, strategy, precision): each plants a reduction in bf16 under a policy that reduces in fp32, or a
#: second reduction of every gradient (numerically harmless: the ranks' values already agree).
PLANTS = [
    ("bf16_reduce_dtype", "fsdp_full", "bf16"),
    ("bf16_compress_hook", "ddp", "bf16"),
    ("ds_bf16_communication", "zero2", "fp32"),
    ("all_reduce_twice", "ddp", "bf16"),
]


def assert_plant_fails(suite: Any, mutation: str, strategy: str, world_size: int, precision: str) -> None:
    """The configuration passes as it is and fails with the mutation planted."""
    cfg = wire_config(suite, strategy, world_size, precision)
    what = f"{strategy} ws{world_size} {precision}"
    assert_every_rank(recorded(suite, cfg), cfg, what)
    broken = suite.run_job(world_size, mutants.record_collectives, mutation=mutation, cfg=cfg)
    with pytest.raises(AssertionError, match="disagrees with its precision policy"):
        assert_every_rank(broken, cfg, f"{what} with {mutation}")


@pytest.mark.parametrize("mutation, strategy_name, precision", PLANTS)
def test_wire_check_catches_planted_defects(
    suite: Any, mutation: str, strategy_name: str, precision: str
) -> None:
    """CPU, 2 ranks."""
    assert_plant_fails(suite, mutation, strategy_name, 2, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("mutation, strategy_name, precision", PLANTS)
def test_wire_check_catches_planted_defects_on_gpus(
    suite: Any, world_size: int, mutation: str, strategy_name: str, precision: str
) -> None:
    """NCCL, at every world size of the GPU tier. FSDP2 on one GPU reduce-scatters nothing to plant in."""
    if strategy_name.startswith("fsdp") and world_size == 1:
        pytest.skip("FSDP2 issues no reduce-scatter over a shard group of one rank")
    assert_plant_fails(suite, mutation, strategy_name, world_size, precision)
