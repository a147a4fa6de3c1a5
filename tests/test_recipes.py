"""The recipes users train with, at parity with the independent reference: gradient clipping by the global
gradient norm, each strategy clipping the way its users do (torch's clip_grad_norm_ for single, DDP and
FSDP2's DTensors, FSDP1's own, DeepSpeed's `gradient_clipping`); activation checkpointing; LoRA fine-tuning
through peft, against a reference that writes LoRA out by hand."""

from __future__ import annotations

import pytest
import torch

from distbench.invariants.checks import (
    assert_losses_match,
    assert_only_adapters_trained,
    assert_params_and_grads_match,
)
from recipe_jobs import LORA

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


@pytest.mark.strategies("single", "ddp", "fsdp_full", "fsdp_grad", "fsdp1_full", "fsdp1_grad", "zero2", "zero3")
def test_lora_trains_the_adapters_alone_at_parity(suite, strategy, world_size):
    """LoRA through peft: the losses, every parameter and the adapters' gradients are the reference's (which
    writes LoRA out by hand), the base weights are their initial values and every adapter moved."""
    cfg = suite.config(strategy, world_size, **LORA)
    ref = suite.reference(cfg)
    run = suite.checkpointed_run(cfg)
    what = f"{strategy} ws{world_size} with LoRA rank {cfg.lora_rank}"
    assert_losses_match(run["losses"], ref["losses"], what)
    assert_params_and_grads_match(run, ref, cfg.lr, what)
    assert_only_adapters_trained(run["params"], ref["initial"], what)


def test_lora_with_the_base_left_trainable_fails(suite):
    """A LoRA run whose base weights train too (the model set trainable again after peft froze it): the base
    weights move and the losses leave the reference's."""
    if suite.device_type == "cuda":
        pytest.skip("the CPU tier's bite test covers the check")
    cfg = suite.config("ddp", 2, **LORA)
    ref = suite.reference(cfg)
    broken = suite.run(2, "mutants:train", mutation="lora_base_trainable", cfg=cfg.to_dict(), return_params=True)[0]
    with pytest.raises(AssertionError, match="frozen base weights changed"):
        assert_only_adapters_trained(broken["params"], ref["initial"], "ddp ws2 with the base trainable")
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(broken["losses"], ref["losses"], "ddp ws2 with the base trainable")


def test_lora_without_gradient_sync_fails_parity(suite):
    """DDP ranks that never all-reduce the adapters' gradients train different adapters: caught by the losses."""
    if suite.device_type == "cuda":
        pytest.skip("the CPU tier's bite test covers the check")
    cfg = suite.config("ddp", 2, **LORA)
    broken = suite.run(2, "mutants:train", mutation="no_grad_sync", cfg=cfg.to_dict())[0]
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(broken["losses"], suite.reference(cfg)["losses"], "ddp ws2 LoRA without gradient sync")
