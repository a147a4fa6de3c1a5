"""The invariant checks fail when the property they guard is broken on purpose (tests/mutants.py).

A check that cannot fail proves nothing: each test here runs a trainer (or an export) with one defect a real
incident has, through the same job and the same assertion the invariant tests use, and expects that
assertion to fail. The unmutated run beside each passes, so the failure is the mutation's doing.
"""

from __future__ import annotations

import pytest
import torch

import mutants
from distbench.invariants.checks import (
    PARITY_RTOL,
    SINGLE_PROCESS_REFERENCE,
    assert_exported_weights_match,
    assert_losses_match,
    assert_params_and_grads_match,
    assert_resume_exact,
    assert_sync_once_per_step,
)
from distbench.jobs.checks import count_collectives

WS = 2


def _mutant(suite, job: str, mutation: str, **kwargs):
    return suite.run_job(WS, getattr(mutants, job), mutation=mutation, **kwargs)


def test_loss_parity_catches_ranks_that_never_sync_gradients(suite):
    cfg = suite.config("ddp", WS)
    ref = suite.reference(cfg)["losses"]
    assert_losses_match(suite.checkpointed_run(cfg)["losses"], ref, "ddp", against=SINGLE_PROCESS_REFERENCE)
    broken = _mutant(suite, "train", "no_grad_sync", cfg=cfg)[0]["losses"]
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(broken, ref, "ddp without gradient sync", against=SINGLE_PROCESS_REFERENCE)


def test_grad_parity_catches_a_missing_average(suite):
    """Adam is nearly invariant to a gradient scale, so losses barely move; gradients show the x2 at once."""
    cfg = suite.config("ddp", WS)
    ref = suite.reference(cfg)
    assert_params_and_grads_match(suite.checkpointed_run(cfg), ref, cfg.lr, "ddp")
    broken = _mutant(suite, "train", "sum_not_mean", cfg=cfg, return_params=True, return_grads=True)[0]
    with pytest.raises(AssertionError, match="gradient"):
        assert_params_and_grads_match(broken, ref, cfg.lr, "ddp summing gradients")


def test_accumulation_check_catches_sync_on_every_micro_batch(suite):
    one = suite.config("ddp", WS)
    one = one.replace(micro_batch=one.per_rank_batch)
    many = one.replace(micro_batch=1)
    c_one = suite.run_job(WS, count_collectives, cfg=one)[0]
    c_broken = _mutant(suite, "count_collectives", "sync_every_micro", cfg=many)[0]
    with pytest.raises(AssertionError, match="synchronised on every micro-batch"):
        assert_sync_once_per_step(c_one, c_broken, "ddp without no_sync")


def test_resume_check_catches_a_reset_optimizer(suite):
    cfg = suite.config("ddp", WS)
    run = suite.checkpointed_run(cfg)
    resumed = _mutant(suite, "train", "fresh_optimizer", cfg=cfg, resume_from=run["checkpoint"])[0]
    with pytest.raises(AssertionError, match="was not restored"):
        assert_resume_exact(resumed, run["losses"], run["save_at"], "ddp resuming with a fresh optimizer")


def test_resharding_check_catches_a_reset_optimizer(suite):
    """A DCP checkpoint saved at 2 ranks, continued at 1 with the optimizer state dropped on load."""
    saved = suite.config("fsdp_full", WS)
    run = suite.checkpointed_run(saved)
    k, ref = run["save_at"], suite.reference(saved)["losses"]
    loaded = saved.replace(world_size=1)
    kwargs = {"resume_from": run["checkpoint"], "reshard": True}
    fine = suite.train(loaded, **kwargs)[0]["losses"]
    assert_losses_match(fine, ref[k:], "fsdp_full resharded 2 to 1", against=SINGLE_PROCESS_REFERENCE)
    broken = suite.run_job(1, mutants.train, mutation="fresh_optimizer", cfg=loaded, **kwargs)[0]["losses"]
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(
            broken,
            ref[k:],
            "fsdp_full resharded 2 to 1 with a fresh optimizer",
            against=SINGLE_PROCESS_REFERENCE,
        )


def test_export_check_catches_bf16_rounded_weights(suite):
    """Exporting the bf16 compute copy instead of the fp32 masters: the loss moves by 6e-6 on this model,
    inside the parity tolerance, so only the weights give it away."""
    from distbench.invariants.export import full_state_dict_from_checkpoint, load_into_model

    cfg = suite.config("fsdp_full", WS)
    run = suite.checkpointed_run(cfg)
    ref = suite.reference(cfg.replace(steps=run["save_at"]))["params"]
    state = full_state_dict_from_checkpoint(run["checkpoint"], "fsdp_full")
    assert_exported_weights_match(load_into_model(state, cfg.model), ref, cfg.lr, "fsdp_full")
    rounded = {n: t.to(torch.bfloat16).float() for n, t in state.items()}
    with pytest.raises(AssertionError, match="exported parameter"):
        assert_exported_weights_match(load_into_model(rounded, cfg.model), ref, cfg.lr, "fsdp_full in bf16")


def test_a_loss_mismatch_names_what_it_was_compared_with():
    """The message says what the losses were held to, as the caller named it: another distbench run is not
    the single-process reference."""
    with pytest.raises(
        AssertionError, match="zero2 ws2 diverges from the same run in one micro-batch per rank"
    ):
        assert_losses_match(
            [6.0, 5.0], [6.0, 5.9], "zero2 ws2", against="the same run in one micro-batch per rank"
        )
    with pytest.raises(AssertionError, match="1 losses, the same run unsharded has 2"):
        assert_losses_match([6.0], [6.0, 5.9], "zero2 ws2", against="the same run unsharded")
    assert_losses_match(
        [6.0, 5.9], [6.0, 5.9 * (1 + PARITY_RTOL / 2)], "zero2 ws2", against=SINGLE_PROCESS_REFERENCE
    )
