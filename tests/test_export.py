"""Invariant: a sharded checkpoint exports to a plain model and a transformers directory that reloads,
and the exported weights give the loss the training run reported for its next step."""

from __future__ import annotations

import pytest

from distbench.invariants.checks import PARITY_RTOL
from distbench.invariants.export import (
    full_state_dict_from_checkpoint,
    global_batch_loss,
    load_into_model,
    save_and_reload_pretrained,
)
from distbench.strategies import get_spec


@pytest.mark.strategies("zero3", "fsdp_full")
def test_export_to_plain_and_pretrained(suite, strategy, world_size, tmp_path):
    cfg = suite.config(strategy, world_size)
    run = suite.checkpointed_run(cfg)
    k = run["save_at"]
    state = full_state_dict_from_checkpoint(run["checkpoint"], get_spec(strategy).family)
    plain = load_into_model(state, cfg.model)
    want = run["losses"][k]  # the loss of the weights after k steps on step k's batch
    assert global_batch_loss(plain, cfg, k) == pytest.approx(want, rel=PARITY_RTOL)
    reloaded = save_and_reload_pretrained(plain, tmp_path / "pretrained")
    assert global_batch_loss(reloaded, cfg, k) == pytest.approx(want, rel=PARITY_RTOL)
