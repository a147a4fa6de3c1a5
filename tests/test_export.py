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
    save_and_reload_pretrained,
)


@pytest.mark.strategies("zero3", "fsdp_full")
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
