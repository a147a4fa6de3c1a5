"""The recipes users train with, at parity with the independent reference: gradient clipping by the global
gradient norm, each strategy clipping the way its users do (torch's clip_grad_norm_ for single, DDP and
FSDP2's DTensors, FSDP1's own, DeepSpeed's `gradient_clipping`); activation checkpointing; dropout, each
sample's masks from its own stream, whichever rank, micro-batch, recomputation or resume runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distbench.invariants.checks import (
    PARITY_RTOL,
    assert_losses_match,
    assert_params_and_grads_match,
    assert_resume_exact,
)
from distbench.workloads.dropout import SampleDropout, sample_streams

#: Far below gpt2-tiny's gradient norms on this data (about 3-4): every step is clipped, hard.
CLIP = 0.25


def _clipped(suite, strategy: str, world_size: int):
    cfg = suite.config(strategy, world_size, clip_grad_norm=CLIP)
    ref = suite.reference(cfg)
    # negative control: a clip that never bites would pass whatever the strategy does with it
    assert len(ref["grad_norms"]) == cfg.steps and min(ref["grad_norms"]) > 2 * CLIP, ref["grad_norms"]
    return cfg, ref


def test_clipping_by_the_global_norm_matches_the_reference(suite, strategy, world_size):
    cfg, ref = _clipped(suite, strategy, world_size)
    run = suite.train(cfg, return_params=True, return_grads=True)[0]
    what = f"{strategy} ws{world_size} clipped at {CLIP}"
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), what  # the global norm, pre-clip
    assert_losses_match(run["losses"], ref["losses"], what)
    assert_params_and_grads_match(run, ref, cfg.lr, what)


def test_clipping_by_a_shards_own_norm_fails_parity(suite):
    """FSDP2 ranks clipping by their local shard's norm scale each shard differently: caught by the losses."""
    if suite.device_type == "cuda":
        pytest.skip("the CPU tier's bite test covers the check")
    cfg, ref = _clipped(suite, "fsdp_full", 2)
    broken = suite.run(2, "mutants:train", mutation="local_norm_clip", cfg=cfg.to_dict())[0]
    with pytest.raises(AssertionError):
        assert_losses_match(broken["losses"], ref["losses"], "fsdp_full ws2 clipping by local shards")


@pytest.mark.strategies("single", "ddp", "fsdp_full", "fsdp_grad", "fsdp_hybrid", "zero2", "zero3")
def test_activation_checkpointing_recomputes_and_keeps_the_losses(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size, activation_checkpointing=True)
    out = suite.run(world_size, "recipe_jobs:train_counting_attention_forwards", cfg=cfg.to_dict())[0]
    # negative control: every block's attention ran forward again in backward, so recomputation really happened
    micro_steps = cfg.accum_steps * cfg.steps
    assert out["attention_modules"] > 0 and min(out["attention_forwards"]) >= 2 * micro_steps, (micro_steps, out)
    assert_losses_match(out["losses"], suite.reference(cfg)["losses"], f"{strategy} ws{world_size} with AC")


def test_activation_checkpointing_needs_a_transformers_model(suite):
    from distbench.errors import ConfigError
    from distbench.strategies.base import enable_activation_checkpointing

    with pytest.raises(ConfigError, match="activation_checkpointing_enable"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


#: A dropout rate that moves gpt2-tiny's losses a hundred times the parity tolerance and more (asserted).
DROPOUT = 0.2


def _dropped(suite, strategy: str, world_size: int, **overrides):
    cfg = suite.config(strategy, world_size, dropout=DROPOUT, **overrides)
    ref = suite.reference(cfg)
    plain = suite.reference(cfg.replace(dropout=0.0))["losses"]
    # negative control: dropout that dropped nothing would pass whatever the strategy does with the streams
    assert not np.allclose(ref["losses"], plain, rtol=100 * PARITY_RTOL, atol=0), (ref["losses"], plain)
    return cfg, ref


def test_dropout_streams_match_the_reference(suite, strategy, world_size):
    """Every sample sees its own dropout stream whichever rank and micro-batch runs it: losses, parameters and
    gradients equal the reference's, which keys the streams by each sample's place in the global batch."""
    cfg, ref = _dropped(suite, strategy, world_size)
    run = suite.checkpointed_run(cfg)
    what = f"{strategy} ws{world_size} with dropout {DROPOUT}"
    assert_losses_match(run["losses"], ref["losses"], what)
    assert_params_and_grads_match(run, ref, cfg.lr, what)


@pytest.mark.strategies("ddp")
def test_dropout_resumes_exactly(suite, strategy, world_size):
    """A resumed run draws the masks the uninterrupted run drew: the streams follow the restored step alone,
    which test_checkpoint_roundtrip shows every strategy restores, so one strategy stands for all here."""
    cfg, _ = _dropped(suite, strategy, world_size)
    run = suite.checkpointed_run(cfg)
    resumed = suite.train(cfg, resume_from=run["checkpoint"])[0]
    assert_resume_exact(resumed, run["losses"], run["save_at"], f"{strategy} ws{world_size} with dropout")


@pytest.mark.strategies("fsdp_full", "zero3")  # the wrappers whose hooks run again in the recomputation
def test_dropout_masks_survive_recomputation(suite, strategy, world_size):
    """Activation checkpointing runs each block's forward again in backward; the recomputed dropout must draw
    the forward's masks (torch restores only its global RNG for it), or gradients belong to other masks."""
    cfg, ref = _dropped(suite, strategy, world_size, activation_checkpointing=True)
    out = suite.run(world_size, "recipe_jobs:train_counting_attention_forwards", cfg=cfg.to_dict())[0]
    micro_steps = cfg.accum_steps * cfg.steps
    assert min(out["attention_forwards"], default=0) >= 2 * micro_steps, (micro_steps, out)  # it recomputed
    assert_losses_match(out["losses"], ref["losses"], f"{strategy} ws{world_size} with dropout and AC")


@pytest.mark.parametrize("mutation", ["dropout_global_rng", "dropout_local_index"])
def test_dropout_from_another_stream_fails_parity(suite, mutation):
    """Masks from torch's global RNG (the same on both ranks), or streams keyed by the rank's local sample
    index, give other masks than the reference's at world size 2: caught by the losses."""
    cfg, ref = _dropped(suite, "ddp", 2)
    broken = suite.run(2, "mutants:train", mutation=mutation, cfg=cfg.to_dict())[0]
    with pytest.raises(AssertionError):
        assert_losses_match(broken["losses"], ref["losses"], f"ddp ws2 {mutation}")


def test_sample_dropout_masks_belong_to_the_sample():
    """A sample's mask depends on the sample, not on its neighbours or its row; each sample's differs, each step's
    differs; outside sample_streams it refuses rather than fall back to the global RNG."""
    drop = SampleDropout(0.5, index=0).train()
    x = torch.ones(4, 256)
    with sample_streams(7, 3, [10, 11, 12, 13]):
        four = drop(x)
        again = drop(x)
    with sample_streams(7, 3, [12, 10]):
        two = drop(x[:2])
    with sample_streams(7, 4, [10]):
        next_step = drop(x[:1])
    assert torch.equal(four, again) and torch.equal(two[0], four[2]) and torch.equal(two[1], four[0])
    assert not torch.equal(four[0], four[1]) and not torch.equal(next_step[0], four[0])
    assert set(four.unique().tolist()) == {0.0, 2.0}  # dropped, and the survivors scaled by 1 / (1 - rate)
    with pytest.raises(RuntimeError, match="outside sample_streams"):
        drop(x)


def test_dropout_needs_dropout_modules():
    from distbench.errors import ConfigError
    from distbench.workloads.dropout import apply_dropout

    with pytest.raises(ConfigError, match="nn.Dropout"):
        apply_dropout(torch.nn.Linear(2, 2), DROPOUT)
