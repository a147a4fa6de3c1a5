"""Invariant: a sharded checkpoint exports to a plain model and a transformers directory that reloads,
the exported weights are the reference's after the same steps, and they give the loss the training run
reported for its next step.

The loss alone is a weak check: exporting bf16-rounded weights instead of the fp32 masters moved the tiny
CPU model's loss by 6e-6, inside the parity tolerance, while each weight moved by up to 2^-9 of itself."""

from __future__ import annotations

import pytest

from distbench.invariants.checks import PARITY_RTOL, assert_exported_weights_match
from distbench.invariants.export import (
    full_state_dict_from_checkpoint,
    global_batch_loss,
    load_into_model,
    merge_lora,
    save_and_reload_pretrained,
)
from recipe_jobs import LORA


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("zero3", "fsdp_full", "zero0")
# zero0's exporter (the stage-0 model file) runs nightly: the default tier's zero0 time is its bf16 round trip
@pytest.mark.default_cases("zero3-ws1", "zero3-ws2", "fsdp_full-ws1", "fsdp_full-ws2")
def test_export_to_plain_and_pretrained(suite, strategy, world_size, tmp_path):
    cfg = suite.config(strategy, world_size)
    run = suite.checkpointed_run(cfg)
    k = run["save_at"]
    state = full_state_dict_from_checkpoint(run["checkpoint"], strategy)
    plain = load_into_model(state, cfg.model)
    ref = suite.reference(cfg.replace(steps=k))["params"]  # the LR schedule does not depend on `steps`
    assert_exported_weights_match(plain, ref, cfg.lr, f"{strategy} ws{world_size}")
    want = run["losses"][k]  # the loss of the weights after k steps on step k's batch
    assert global_batch_loss(plain, cfg, k) == pytest.approx(want, rel=PARITY_RTOL)
    reloaded = save_and_reload_pretrained(plain, tmp_path / "pretrained")
    assert global_batch_loss(reloaded, cfg, k) == pytest.approx(want, rel=PARITY_RTOL)


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("zero3", "fsdp_full")
@pytest.mark.default_cases("fsdp_full-ws2", "zero3-ws2")
def test_lora_merged_export(suite, strategy, world_size, tmp_path):
    """A LoRA run's checkpoint, its adapters merged into the base weights (peft's merge_and_unload): the
    merged weights are the reference's base plus alpha / rank * B A, and the plain model, saved and reloaded
    with no peft in sight, gives the loss the run reported for its next step."""
    cfg = suite.config(strategy, world_size, **LORA)
    run = suite.checkpointed_run(cfg)
    k = run["save_at"]
    merged = merge_lora(full_state_dict_from_checkpoint(run["checkpoint"], strategy), cfg)
    ref = suite.reference(cfg.replace(steps=k))["merged"]
    assert_exported_weights_match(merged, ref, cfg.lr, f"{strategy} ws{world_size} LoRA merged")
    want = run["losses"][k]
    assert global_batch_loss(merged, cfg, k) == pytest.approx(want, rel=PARITY_RTOL)
    reloaded = save_and_reload_pretrained(merged, tmp_path / "merged")
    assert global_batch_loss(reloaded, cfg, k) == pytest.approx(want, rel=PARITY_RTOL)
