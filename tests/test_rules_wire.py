"""Rules of the wire table (distbench.invariants.wire), one test each, with the tables computed by hand for a small
model of known facts, no ranks: what each strategy's policy puts on the wire at each precision and world size,
how DDP's buckets are bounded, how HSDP's replicate groups are chosen, which collectives are payload, and what
the check says when a step disagrees. tests/test_wire.py holds recorded steps of real runs to the same table."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from distbench.invariants.wire import (
    ITEMSIZE,
    ModelFacts,
    Traffic,
    assert_wire_matches,
    ddp_buckets,
    expected_traffic,
    hybrid_replicas,
    is_payload,
    wire_problems,
)

F32, BF16, F16 = "float32", "bfloat16", "float16"
MIB = 1 << 20
#: N = 1000 elements in 4 tensors, 60 elements a dim-0 row over them, the largest 500, 3 blocks (4 units).
#: padded(s) = 1000 + 60 (s - 1) + 16 x 4: 1064 on one shard, 1124 on two, 1244 on four.
M = ModelFacts(elements=1000, tensors=4, rows=60, largest=500, layers=3)


def test_a_sharded_layout_may_hold_each_tensors_dim_0_padding_and_its_alignment():
    assert (M.padded(1), M.padded(2), M.padded(4)) == (1064, 1124, 1244)


def test_traffic_bytes_are_its_elements_times_the_dtypes_size():
    assert Traffic(BF16, 2, (1000, 2248), (7, 7)).bytes == (2000, 4496)
    assert Traffic(F32, 2, (3, 5), (1, 1)).bytes == (12, 20)
    assert ITEMSIZE == {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class _Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.lin = nn.Linear(3, 4)  # weight (4, 3): 12 elements, rows of 3; bias (4,): rows of 1
        self.emb = nn.Parameter(torch.zeros(5, 2))  # 10 elements, rows of 2 ...
        self.tied = self.emb  # ... counted once
        self.scale = nn.Parameter(torch.ones(()))  # a scalar: one element, one row
        self.frozen = nn.Parameter(torch.zeros(7, 7), requires_grad=False)  # not trained: not counted


def test_model_facts_count_trainable_parameters_once_each():
    facts = ModelFacts.of(_Model(SimpleNamespace(num_hidden_layers=2)))
    assert facts == ModelFacts(elements=27, tensors=4, rows=7, largest=12, layers=2)
    # two shards may hold 27 + 7 + 16 x 4 = 98 elements: said in whole elements and bytes
    assert wire_problems([], expected_traffic("fsdp_grad", "fp32", 2, facts))[1] == (
        "reduce_scatter moved 0 bytes a step, the policy 108-392 (27-98 elements of float32)"
    )


@pytest.mark.parametrize("config", [None, SimpleNamespace(num_hidden_layers=0), SimpleNamespace()])
def test_a_model_without_transformer_blocks_has_no_wire_table(config):
    with pytest.raises(ValueError) as refused:
        ModelFacts.of(_Model(config))
    assert str(refused.value) == (
        "_Model has no transformers config (num_hidden_layers): the wire table counts FSDP units as one per "
        "transformer block plus the root; use a built-in model"
    )


@pytest.mark.parametrize(
    ("grad_bytes", "largest_bytes", "bounds"),
    [
        (4000, 2000, (1, 1)),
        (MIB, 0, (1, 1)),  # exactly the first bucket's cap: one bucket
        (MIB + 1, 0, (1, 2)),  # a byte more: a second bucket
        (MIB + 25 * MIB, 0, (2, 2)),
        (MIB + 25 * MIB + 1, 0, (2, 3)),
        (100 * MIB, 0, (4, 5)),
        (100 * MIB + 1, 0, (5, 5)),
        (100 * MIB, 1, (4, 5)),
        (100 * MIB, 25 * MIB, (2, 5)),
        # GPT-2 124M: 124,439,808 fp32 gradients, the largest the 50257 x 768 embedding
        (4 * 124_439_808, 4 * 50257 * 768, (3, 20)),
    ],
)
def test_ddp_buckets_hold_at_least_their_cap_and_at_most_cap_plus_the_largest_gradient(
    grad_bytes, largest_bytes, bounds
):
    """The first bucket closes at 1 MiB, the others at 25 MiB: at most 1 + ceil((g - 1 MiB) / 25 MiB) buckets,
    at least ceil(g / (25 MiB + largest))."""
    assert ddp_buckets(grad_bytes, largest_bytes) == bounds


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-amp"])
@pytest.mark.parametrize("ws", [1, 2])
def test_ddp_all_reduces_n_fp32_elements_whatever_the_precision(precision, ws):
    assert expected_traffic("ddp", precision, ws, M) == {"all_reduce": Traffic(F32, ws, (1000, 1000), (1, 1))}


def test_ddps_bucket_count_comes_from_its_fp32_gradients_bytes_and_its_largest_gradients():
    """N = 101 MiB / 4 fp32 gradients, the largest 25 MiB / 4 of them: at most 1 + ceil(100 MiB / 25 MiB) = 5
    buckets, at least ceil(101 MiB / (25 MiB + 25 MiB)) = 3."""
    facts = ModelFacts(elements=101 * MIB // 4, tensors=8, rows=100, largest=25 * MIB // 4, layers=2)
    assert expected_traffic("ddp", "bf16", 2, facts)["all_reduce"].count == (3, 5)


def test_single_puts_nothing_on_the_wire():
    assert expected_traffic("single", "bf16", 1, M) == {}


def test_fsdp2_full_shard_gathers_bf16_blocks_twice_and_the_root_once_and_reduces_fp32():
    assert expected_traffic("fsdp_full", "bf16", 2, M) == {
        "reduce_scatter": Traffic(F32, 2, (1000, 1124), (4, 4)),
        "all_gather": Traffic(BF16, 2, (1000, 2248), (7, 7)),
    }
    assert expected_traffic("fsdp_offload", "fp16", 2, M) == {
        "reduce_scatter": Traffic(F32, 2, (1000, 1124), (4, 4)),
        "all_gather": Traffic(F32, 2, (1000, 2248), (7, 7)),
    }


def test_fsdp2_keeping_gradients_sharded_gathers_each_unit_once():
    assert expected_traffic("fsdp_grad", "bf16-amp", 4, M) == {
        "reduce_scatter": Traffic(F32, 4, (1000, 1244), (4, 4)),
        "all_gather": Traffic(F32, 4, (1000, 1244), (4, 4)),
    }


def test_fsdp2_on_one_rank_communicates_nothing():
    assert expected_traffic("fsdp_full", "bf16", 1, M) == {}
    assert expected_traffic("fsdp_grad", "fp32", 1, M) == {}


def test_hsdp_all_reduces_the_shards_over_its_replicate_groups():
    """Four ranks, one node: 2 replicate groups of 2-rank shards; two ranks: 2 replicas of one rank (no sharded
    collective), or told replicate=1, one 2-rank shard group all-reducing over groups of one."""
    assert expected_traffic("fsdp_hybrid", "bf16", 4, M) == {
        "reduce_scatter": Traffic(F32, 2, (1000, 1124), (4, 4)),
        "all_gather": Traffic(BF16, 2, (1000, 2248), (7, 7)),
        "all_reduce": Traffic(F32, 2, (500, 562), (4, 4)),
    }
    assert expected_traffic("fsdp_hybrid", "bf16", 2, M) == {
        "all_reduce": Traffic(F32, 2, (1000, 1064), (4, 4))
    }
    assert expected_traffic("fsdp_hybrid", "fp32", 2, M, replicate=1) == {
        "reduce_scatter": Traffic(F32, 2, (1000, 1124), (4, 4)),
        "all_gather": Traffic(F32, 2, (1000, 2248), (7, 7)),
        "all_reduce": Traffic(F32, 1, (500, 562), (4, 4)),
    }
    assert expected_traffic("fsdp_hybrid", "bf16", 4, M, nodes=2)["all_reduce"].group_size == 2


def test_an_hsdp_step_that_moved_nothing_is_told_in_whole_ranks_elements_and_bytes():
    """Four ranks in 2 replicate groups: shard groups of 4 // 2 ranks, counted as whole numbers."""
    assert wire_problems([], expected_traffic("fsdp_hybrid", "bf16", 4, M)) == [
        "0 reduce_scatter collectives a step, the policy allows 4-4",
        "reduce_scatter moved 0 bytes a step, the policy 4000-4496 (1000-1124 elements of float32)",
        "0 all_gather collectives a step, the policy allows 7-7",
        "all_gather moved 0 bytes a step, the policy 2000-4496 (1000-2248 elements of bfloat16)",
        "0 all_reduce collectives a step, the policy allows 4-4",
        "all_reduce moved 0 bytes a step, the policy 2000-2248 (500-562 elements of float32)",
    ]


def test_hsdp_of_an_odd_world_on_one_node_is_one_replicate_group_of_whole_shards():
    """Three ranks: one group sharding over all three (padded(3) = 1184), all-reducing 1000 // 3 to 1184 // 3
    elements over a group of one."""
    assert expected_traffic("fsdp_hybrid", "bf16", 3, M) == {
        "reduce_scatter": Traffic(F32, 3, (1000, 1184), (4, 4)),
        "all_gather": Traffic(BF16, 3, (1000, 2368), (7, 7)),
        "all_reduce": Traffic(F32, 1, (333, 394), (4, 4)),
    }


def test_hsdp_replicate_groups_are_the_option_else_one_a_node_else_two_on_an_even_node():
    assert hybrid_replicas(8, nodes=1, replicate=4) == 4
    assert hybrid_replicas(8, nodes=2, replicate=1) == 1
    assert hybrid_replicas(8, nodes=2) == 2
    assert hybrid_replicas(12, nodes=3) == 3
    assert hybrid_replicas(4) == 2
    assert hybrid_replicas(3) == 1
    assert hybrid_replicas(1) == 1


def test_fsdp1_all_reduces_on_one_rank_and_shards_on_more():
    assert expected_traffic("fsdp1_full", "bf16", 1, M) == {
        "all_reduce": Traffic(F32, 1, (1000, 1064), (4, 4))
    }
    assert expected_traffic("fsdp1_full", "bf16", 2, M) == {
        "reduce_scatter": Traffic(F32, 2, (1000, 1124), (4, 4)),
        "all_gather": Traffic(BF16, 2, (1000, 2248), (4, 8)),
    }
    assert expected_traffic("fsdp1_grad", "fp16", 2, M) == {
        "reduce_scatter": Traffic(F32, 2, (1000, 1124), (4, 4)),
        "all_gather": Traffic(F32, 2, (1000, 1124), (4, 4)),
    }


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", F32), ("bf16", BF16), ("fp16", F16), ("bf16-amp", F32)]
)
def test_zero_1_and_2_all_reduce_and_gather_in_the_regimes_dtype(precision, dtype):
    for strategy in ("zero1", "zero2"):
        assert expected_traffic(strategy, precision, 2, M) == {
            "all_reduce": Traffic(dtype, 2, (1000, 1124), (1, 1)),
            "all_gather": Traffic(dtype, 2, (1000, 1124), (1, 1)),
        }
        assert expected_traffic(strategy, precision, 1, M) == {
            "all_reduce": Traffic(dtype, 1, (1000, 1064), (1, 1))
        }


def test_zero_3_reduce_scatters_buckets_and_gathers_each_tensor_at_most_twice():
    for strategy in ("zero3", "zero3_offload"):
        assert expected_traffic(strategy, "bf16", 2, M) == {
            "reduce_scatter": Traffic(BF16, 2, (1000, 1124), (1, 1)),
            "all_gather": Traffic(BF16, 2, (1, 2248), (1, 8)),
        }
        assert expected_traffic(strategy, "fp32", 1, M) == {
            "reduce_scatter": Traffic(F32, 1, (1000, 1064), (1, 1))
        }


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", F32), ("bf16", BF16), ("fp16", F16), ("bf16-amp", F32)]
)
def test_zero_0_all_reduces_every_gradient_once_unpadded_and_gathers_nothing(precision, dtype):
    """Stage 0 keeps every rank's whole state: one all-reduce of exactly N elements (no partition padding), no
    gather, on one rank as on two."""
    for ws in (1, 2):
        assert expected_traffic("zero0", precision, ws, M) == {
            "all_reduce": Traffic(dtype, ws, (1000, 1000), (1, 1))
        }


def test_zero_0_buckets_are_filled_past_half_a_billion_elements_uncapped():
    """Buckets close once they pass 5e8 elements, so every one but the last holds more than 5e8 (at most
    N // 5e8 + 1 of them) and none more than 5e8 plus the largest gradient (at least N / (5e8 + largest),
    rounded up): 1.2e9 elements whose largest is 6e8 take 2 or 3; 1e9 whose largest is 5e8, 1 to 3; 2.5e9
    whose largest is 1e8, 5 (4.17 rounded up) to 6."""
    big = ModelFacts(elements=1_200_000_000, tensors=2, rows=10, largest=600_000_000, layers=2)
    assert expected_traffic("zero0", "bf16", 2, big)["all_reduce"].count == (2, 3)
    exact = ModelFacts(elements=1_000_000_000, tensors=2, rows=10, largest=500_000_000, layers=2)
    assert expected_traffic("zero0", "fp32", 2, exact)["all_reduce"].count == (1, 3)
    many = ModelFacts(elements=2_500_000_000, tensors=25, rows=10, largest=100_000_000, layers=2)
    assert expected_traffic("zero0", "fp32", 4, many)["all_reduce"] == Traffic(
        F32, 4, (2_500_000_000, 2_500_000_000), (5, 6)
    )


def test_deepspeed_buckets_of_half_a_billion_elements_are_filled_greedily():
    """1.2 billion elements: 3 buckets at least, fewer than twice that (at most 5); capped at N below it."""
    big = ModelFacts(elements=1_200_000_000, tensors=2, rows=10, largest=600_000_000, layers=2)
    assert expected_traffic("zero2", "bf16", 2, big)["all_reduce"].count == (3, 5)
    assert expected_traffic("zero3", "bf16", 2, big)["reduce_scatter"].count == (3, 5)
    exact = ModelFacts(elements=1_000_000_000, tensors=2, rows=10, largest=500_000_000, layers=2)
    assert expected_traffic("zero1", "fp32", 2, exact)["all_reduce"].count == (2, 3)


def test_a_strategy_without_a_policy_is_named():
    with pytest.raises(KeyError) as refused:
        expected_traffic("fsdp3", "bf16", 2, M)
    assert (
        refused.value.args[0]
        == "no wire policy for strategy 'fsdp3': add one to distbench/invariants/wire.py"
    )


def test_payload_is_more_than_one_element_of_a_floating_dtype():
    assert is_payload({"elements": 2, "dtype": BF16})
    assert is_payload({"elements": 2, "dtype": "float64"})
    assert not is_payload({"elements": 1, "dtype": F32}), "a scalar (the loss, a norm) is control traffic"
    for dtype in ("int64", "uint8", "bool"):
        assert not is_payload({"elements": 100, "dtype": dtype}), dtype


def call(kind: str, dtype: str, elements: int, group: int = 2) -> dict[str, Any]:
    return {
        "kind": kind,
        "dtype": dtype,
        "elements": elements,
        "bytes": elements * ITEMSIZE[dtype],
        "group_size": group,
    }


WANT = {"all_reduce": Traffic(F32, 2, (1000, 1000), (1, 2))}


def test_a_step_that_follows_its_policy_has_no_problem_at_either_bound():
    assert wire_problems([call("all_reduce", F32, 1000)], WANT) == []
    assert wire_problems([call("all_reduce", F32, 400), call("all_reduce", F32, 600)], WANT) == []
    control = [
        {"kind": "all_reduce", "dtype": F32, "elements": 1, "bytes": 4, "group_size": 2},
        {"kind": "broadcast", "dtype": "int64", "elements": 8, "bytes": 64, "group_size": 2},
    ]
    assert wire_problems([call("all_reduce", F32, 1000), *control], WANT) == [], "control traffic was judged"


def test_each_disagreement_of_a_step_is_said_in_the_policys_terms():
    assert wire_problems([call("all_reduce", BF16, 1000)], WANT) == [
        "all_reduce in ['bfloat16'], the policy says float32",
        "all_reduce moved 2000 bytes a step, the policy 4000-4000 (1000-1000 elements of float32)",
    ]
    assert wire_problems([call("all_reduce", F32, 1000, group=4)], WANT) == [
        "all_reduce over groups of [4] ranks, the policy's group has 2"
    ]
    assert wire_problems([call("all_reduce", F32, 400)] * 3, WANT) == [
        "3 all_reduce collectives a step, the policy allows 1-2",
        "all_reduce moved 4800 bytes a step, the policy 4000-4000 (1000-1000 elements of float32)",
    ]
    assert wire_problems([], WANT) == [
        "0 all_reduce collectives a step, the policy allows 1-2",
        "all_reduce moved 0 bytes a step, the policy 4000-4000 (1000-1000 elements of float32)",
    ]
    assert wire_problems(
        [call("all_reduce", F32, 1000), call("all_gather", BF16, 10), call("all_gather", F32, 5)], WANT
    ) == ["all_gather: 2 collectives (40 bytes, ['bfloat16', 'float32']) where the policy has none"]


def test_a_record_is_held_to_the_policy_step_by_step_and_to_the_profilers_count():
    good = [call("all_reduce", F32, 1000)]
    assert_wire_matches({"steps": [good, good], "profiled": {"all_reduce": 1}}, WANT, "ddp ws2")  # passes
    with pytest.raises(AssertionError) as failed:
        assert_wire_matches({"steps": [], "profiled": {}}, WANT, "ddp ws2")
    assert str(failed.value) == "ddp ws2: no step recorded"
    with pytest.raises(AssertionError) as failed:
        assert_wire_matches({"steps": [good, good], "profiled": {"all_reduce": 2}}, WANT, "ddp ws2")
    assert str(failed.value) == (
        "ddp ws2: step 0 recorded collectives {'all_reduce': 1}, the profiler counted {'all_reduce': 2} in a step "
        "of the same run: the record misses collectives"
    )
    bad = [call("all_reduce", BF16, 2000, group=4)]  # 4000 bytes, as the policy's, in bf16 over 4 ranks
    with pytest.raises(AssertionError) as failed:
        assert_wire_matches({"steps": [good, bad], "profiled": {"all_reduce": 1}}, WANT, "x")
    assert str(failed.value) == (
        "x: step 1 disagrees with its precision policy: all_reduce in ['bfloat16'], the policy says float32; "
        "all_reduce over groups of [4] ranks, the policy's group has 2"
    )
