"""The recipes users train with, at parity with the independent reference: gradient clipping by the global
gradient norm, each strategy clipping the way its users do (torch's clip_grad_norm_ for single, DDP and
FSDP2's DTensors, FSDP1's own, DeepSpeed's `gradient_clipping`)."""

from __future__ import annotations

import pytest

from distbench.invariants.checks import assert_losses_match, assert_params_and_grads_match

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
