"""The memory model beyond this machine: a rank's training state for a 7B-parameter transformer (llama-7b, bf16)
at 8, 16 and 64 GPUs of 8 a node, predicted by invariants/memory.py and counted with nothing allocated.

The count does not use the model: FSDP2's is fully_shard's own layout on the meta device, rank 0 of a fake
process group (tests/fake_ranks.py), fsdp_hybrid on the mesh of its nodes; ZeRO's applies DeepSpeed's
partitioning (tests/zero_partitions.py, which the scale tier holds against real engines at 8 gloo ranks) to the
model's parameter shapes, with DeepSpeed's bf16 element sizes: parameters and gradients 2 bytes, the fp32
master partition and AdamW's two moments 12. Offload strategies keep no state on the device, and FSDP1 needs
CUDA: they are not counted. Buffers (DeepSpeed's buckets) are in neither figure.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import mutants
from distbench.cli import main
from distbench.config import RunConfig
from distbench.invariants.memory import analytic_bytes
from distbench.workloads import count_params, get_model
from fake_ranks import fsdp2_state_bytes, trainer_at
from zero_partitions import engine_elements, zero_elements

MODEL, PER_NODE, WORLD_SIZES = "llama-7b", 8, (8, 16, 64)
#: The count and the model may differ by padding alone: DeepSpeed's, at most 2 x world size elements a group
#: or world size a parameter; FSDP2's, less than world size rows a parameter (none for llama-7b at these sizes).
RTOL = 1e-3
FSDP2 = ("fsdp_full", "fsdp_grad", "fsdp_hybrid")
ZERO = {"zero1": 1, "zero2": 2, "zero3": 3}


def _nodes(ws: int) -> int:
    return max(1, ws // PER_NODE)


@functools.cache
def _numels(model: str) -> tuple[int, ...]:
    return tuple(p.numel() for p in get_model(model).build(0, "meta").parameters())


@functools.cache
def counted(strategy: str, ws: int, replicate: int | None = None) -> dict[str, int]:
    """Rank 0's state bytes of MODEL at `ws` ranks, counted (see the module docstring); `replicate`:
    fsdp_hybrid's option."""
    if strategy in FSDP2:
        options = {} if replicate is None else {"replicate": replicate}
        cfg = RunConfig(
            strategy=strategy, world_size=ws, model=MODEL, global_batch=ws, micro_batch=1, options=options
        )
        with trainer_at(cfg, 0, nodes=_nodes(ws), device="meta") as trainer:
            return fsdp2_state_bytes(trainer)
    stage, numels = ZERO[strategy], list(_numels(MODEL))
    elements = zero_elements(stage, numels, ws)
    grads = sum(numels) if stage == 1 else elements["partition"]
    return {"params": 2 * elements["held"], "grads": 2 * grads, "optimizer": 12 * elements["partition"]}


def assert_model_matches_count(strategy: str, ws: int, replicate: int | None = None) -> None:
    """Every component the model predicts is within RTOL of the count."""
    count = counted(strategy, ws, replicate)
    predicted = analytic_bytes(strategy, sum(_numels(MODEL)), ws, "bf16", _nodes(ws), replicate)
    gib = 2**30
    print(
        f"{strategy} ws{ws}: predicted {sum(predicted.values()) / gib:.3f} GiB, counted "
        f"{sum(count.values()) / gib:.3f} GiB ("
        + ", ".join(f"{k} {predicted[k] / gib:.3f}/{count[k] / gib:.3f}" for k in count)
        + ")"
    )
    for k, c in count.items():
        assert abs(predicted[k] - c) <= RTOL * c, (
            f"{strategy} ws{ws} {MODEL}: the memory model predicts {predicted[k] / gib:.3f} GiB of {k} per "
            f"rank, the count is {c / gib:.3f} GiB"
        )


@pytest.mark.parametrize("strategy_name", [*FSDP2, *ZERO])
@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_memory_model_matches_the_count_at_cluster_sizes(strategy_name, ws):
    assert_model_matches_count(strategy_name, ws)


@pytest.mark.parametrize("ws,replicate", [(8, 8), (16, 4)], ids=["8x1", "4x4"])
def test_memory_model_follows_the_hybrid_replicate_option(ws, replicate):
    """fsdp_hybrid told its replicate groups, across the nodes' default: 8 replicas of one rank at 8 (the
    whole state on each), 4 x 4 at 16 over 2 nodes."""
    assert_model_matches_count("fsdp_hybrid", ws, replicate)


@pytest.mark.parametrize("ws", [8, 64])
def test_the_count_catches_a_model_reading_the_hybrid_mesh_backwards(ws):
    """The model taking HSDP's replicate dimension for its shard group (mutants hybrid_dims_swapped, planted in
    the model alone: the count is taken first): 2 x 4 at 8 ranks, where it predicts twice the state; 8 x 8 at
    64 (8 nodes), where the two are the same."""
    counted("fsdp_hybrid", ws)
    with mutants.mutated("hybrid_dims_swapped"):
        if ws == 64:
            assert_model_matches_count("fsdp_hybrid", ws)
            return
        with pytest.raises(AssertionError, match="the memory model predicts"):
            assert_model_matches_count("fsdp_hybrid", ws)


@pytest.mark.scale
@pytest.mark.world_size(8)
@pytest.mark.parametrize("strategy_name", list(ZERO), ids=lambda s: f"{s}-ws8")
def test_deepspeeds_partitions_follow_the_rules_the_count_uses(suite, strategy_name):
    """At 8 gloo ranks, gpt2-uneven (70,920 parameters: its flat group and each of its dimensions need
    padding at 8), every rank's engine holds the elements zero_elements says."""
    cfg = suite.config(strategy_name, 8, model="gpt2-uneven", global_batch=16, micro_batch=1)
    expected = zero_elements(ZERO[strategy_name], list(_numels("gpt2-uneven")), 8)
    for rank, got in enumerate(suite.run_job(8, engine_elements, cfg=cfg)):
        assert got == expected, (
            f"{strategy_name} rank {rank} of 8: the engine holds {got}, the rules say {expected}"
        )


def test_llama_7b_has_7b_parameters():
    """Llama-2-7B's published count, so that the model the checks above use is the size they claim."""
    assert count_params(get_model(MODEL).build(0, "meta")) == 6_738_415_616


def assert_recommend_agrees_with_the_count(ws: int, gib: float, out: Path) -> None:
    """`distbench recommend --predict` on `ws` GPUs of `gib` GiB says a counted strategy fits exactly when its
    counted state does, and recommends one that fits."""
    argv = [
        "recommend",
        "-m",
        MODEL,
        "-n",
        str(ws),
        "--predict",
        "--gpu-memory-gib",
        str(gib),
        "-o",
        str(out),
    ]
    assert main(argv) in (0, 1)
    saved = json.loads((out / "recommendation.json").read_text())
    for row in saved["ranked"]:
        if row["strategy"] in (*FSDP2, *ZERO):
            fits = sum(counted(row["strategy"], ws).values()) <= gib * 2**30
            assert row["fits"] == fits, (
                f"recommend --predict says {row['strategy']} {'fits' if row['fits'] else 'does not fit'} "
                f"{ws} GPUs of {gib} GiB; by the count it {'does' if fits else 'does not'}"
            )
    assert saved["recommendation"] is None or saved["recommendation"]["fits"]


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def test_recommend_answers_for_clusters_as_the_count_does(ws, tmp_path):
    """24 GiB GPUs, where fsdp_hybrid (8), zero1 and DDP do not fit and the others do."""
    assert_recommend_agrees_with_the_count(ws, 24.0, tmp_path)


def test_the_recommend_check_catches_a_cluster_taken_for_one_node(monkeypatch, tmp_path):
    """recommend predicting as if the 64 GPUs were one node (fsdp_hybrid 2 x 32, not 8 x 8 across 8 nodes):
    fsdp_hybrid's 12.55 GiB a GPU then reads 3.14, and it "fits" 10 GiB GPUs."""
    import distbench.invariants.memory as memory

    model = memory.analytic_bytes
    monkeypatch.setattr(memory, "analytic_bytes", lambda s, n, ws, p, nodes: model(s, n, ws, p, nodes=1))
    with pytest.raises(AssertionError, match="says fsdp_hybrid fits 64 GPUs of 10.0 GiB"):
        assert_recommend_agrees_with_the_count(64, 10.0, tmp_path)
