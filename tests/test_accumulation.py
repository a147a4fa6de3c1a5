"""Invariant: gradient accumulation communicates once per optimizer step, and changes nothing else.

DDP must skip the gradient all-reduce (no_sync) and FSDP2 the reduce-scatter
(set_requires_gradient_sync(False)) on all but the last micro-batch: the count of gradient collectives
per optimizer step is the same with k micro-batches as with one. Counted from the c10d ops the profiler
records, not from timing.
"""

from __future__ import annotations

import pytest

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.invariants.checks import assert_losses_match, assert_sync_once_per_step
from distbench.jobs.checks import count_collectives
from distbench.testsuite.suite import Suite


@pytest.mark.strategies("ddp", "fsdp_full", "fsdp_grad", "fsdp_hybrid", "fsdp_offload")
def test_gradient_sync_once_per_step(suite, strategy, world_size):
    if world_size < 2:
        pytest.skip("one rank has no gradient collectives to count")
    one = suite.config(strategy, world_size)
    one = one.replace(micro_batch=one.per_rank_batch)  # no accumulation
    many = one.replace(micro_batch=1)  # accumulate over every sample of the rank
    assert many.accum_steps > 1
    c_one = suite.run_job(world_size, count_collectives, cfg=one)[0]
    c_many = suite.run_job(world_size, count_collectives, cfg=many)[0]
    assert_sync_once_per_step(c_one, c_many, f"{strategy} ws{world_size} ({many.accum_steps} micro-batches)")


@pytest.mark.default_cases(
    "ddp-ws2",
    "fsdp_full-ws2",
    "fsdp_grad-ws2",
    "fsdp_hybrid-ws2",
    "zero2-ws2",
    "zero3-ws2",
    "zero3_offload-ws2",
)
def test_accumulation_preserves_losses(suite, strategy, world_size):
    """The same global batch in k > 1 micro-batches per rank (the tier's default run, shared with the parity
    tests) gives the losses of one micro-batch per rank."""
    many = suite.config(strategy, world_size)
    assert many.accum_steps > 1
    one = many.replace(micro_batch=many.per_rank_batch)
    a = suite.train(one)[0]["losses"]
    b = suite.checkpointed_run(many)["losses"]
    assert_losses_match(
        b,
        a,
        f"{strategy} ws{world_size} accumulating {many.accum_steps} micro-batches",
        against="the same run in one micro-batch per rank",
    )


@pytest.mark.strategies("fsdp_grad", "fsdp_full")
def test_shard_grad_op_gathers_its_parameters_once_per_step_while_accumulating(suite, strategy, world_size):
    """fsdp_grad keeps its parameters unsharded between the micro-batches of a step, as FSDP1's SHARD_GRAD_OP
    does in no_sync: its all-gathers per step do not grow with the micro-batches. fsdp_full reshards after
    every forward and backward, so they do."""
    if world_size < 2:
        pytest.skip("one rank gathers nothing")
    one = suite.config(strategy, world_size)
    one = one.replace(micro_batch=one.per_rank_batch)
    many = one.replace(micro_batch=1)
    assert many.accum_steps > 1
    gathers = [
        suite.run_job(world_size, count_collectives, cfg=c)[0].get("all_gather", 0) for c in (one, many)
    ]
    if strategy == "fsdp_grad":
        assert gathers[1] == gathers[0], (
            f"{strategy}: {gathers} all-gathers per step without/with accumulation"
        )
    else:
        assert gathers[1] > gathers[0], (
            f"{strategy}: {gathers} all-gathers per step without/with accumulation"
        )


@pytest.mark.strategies("fsdp_full")
def test_full_shard_gathers_each_block_twice_and_the_root_once(suite, strategy, world_size):
    """FULL_SHARD re-gathers each block for backward; the root (embeddings and head) stays gathered from its
    forward into backward, as FSDP2 and torchtitan leave it: a resharded root would be gathered again first
    thing in backward, with nothing to overlap it."""
    from distbench.strategies.base import transformer_blocks
    from distbench.workloads import get_model

    if world_size < 2:
        pytest.skip("one rank gathers nothing")
    cfg = suite.config(strategy, world_size)
    cfg = cfg.replace(micro_batch=cfg.per_rank_batch)
    blocks = len(transformer_blocks(get_model(cfg.model).build(cfg.seed, "meta")))
    gathers = suite.run_job(world_size, count_collectives, cfg=cfg)[0].get("all_gather", 0)
    assert gathers == 2 * blocks + 1, f"{gathers} all-gathers per step for {blocks} blocks and the root"


@pytest.mark.parametrize("tier", ["cpu", "cuda"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_every_world_size_accumulates_two_micro_batches_and_no_more(tier, ranks):
    """The tiers' runs accumulate at every world size (the parity tests cover accumulation), and a
    world-size-1 run on a 4-GPU machine takes the 2 micro-batches it takes on one GPU, not the 8 a batch
    shared with world size 4 would give it."""
    cfg = Suite(tier).config("ddp", ranks)
    assert cfg.accum_steps == 2, cfg


@pytest.mark.parametrize(("saved", "loaded"), [(1, 2), (1, 4), (2, 4), (4, 1), (4, 8), (8, 1)])
def test_a_run_resized_to_another_world_size_keeps_its_global_batch(saved, loaded):
    """A resume at another size (resharding) trains on the same samples each step: the global batch stays,
    the micro-batch shrinks only where the new size would overshoot it."""
    cfg = Suite("cuda").config("zero3", saved)
    moved = cfg.resized(loaded)
    assert (moved.world_size, moved.global_batch) == (loaded, cfg.global_batch)
    assert moved.micro_batch == min(cfg.micro_batch, cfg.global_batch // loaded)
    assert moved.micro_batch * loaded * moved.accum_steps == cfg.global_batch


def test_a_run_too_small_for_the_new_world_size_is_refused():
    with pytest.raises(ConfigError, match="does not divide"):
        RunConfig(strategy="ddp", world_size=1, global_batch=2, micro_batch=2).resized(4)
