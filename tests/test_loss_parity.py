"""Invariants: every strategy trains the same model to the same loss, parameters and gradients as an
independent reference, and does so deterministically.

The reference is a hand-written single-process loop accumulating gradients over the same global batch
(distbench.invariants.reference); it shares only the model init and the data with the code under test.
"""

from __future__ import annotations

import numpy as np
import torch

from distbench.suite import PARITY_ATOL, PARITY_RTOL


def test_loss_parity(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size)
    ref = suite.reference(cfg)["losses"]
    run = suite.checkpointed_run(cfg)
    per_rank = run["per_rank_losses"]
    assert all(r == per_rank[0] for r in per_rank), f"ranks report different global losses: {per_rank}"
    losses = run["losses"]
    assert len(losses) == cfg.steps
    np.testing.assert_allclose(
        losses, ref, rtol=PARITY_RTOL, atol=PARITY_ATOL,
        err_msg=f"{strategy} at world size {world_size} diverges from the single-process reference",
    )
    assert losses[-1] < losses[0], f"loss did not decrease over {cfg.steps} steps: {losses}"


def _assert_tensors_close(got: dict, want: dict, what: str, rtol: float, atol: float) -> None:
    assert set(got) == set(want), f"{what} names differ: missing {set(want) - set(got)}, extra {set(got) - set(want)}"
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_param_and_grad_parity(suite, strategy, world_size):
    """After N steps the gathered full parameters, and the last step's gradients, match the reference.

    Tolerances: AdamW moves a parameter by at most about lr per step, and a parameter whose gradient is
    identically zero in exact arithmetic (GPT-2's attention key bias) moves by amplified rounding noise; the
    absolute floor for parameters is 1% of one step's largest update (lr/100), while a strategy that fails
    to synchronise gradients moves parameters by ~lr. Gradients: rtol 1e-4 with a floor of 1e-5 of the
    largest reference gradient, tight enough that a missing 1/world_size averaging (x2) fails.
    """
    cfg = suite.config(strategy, world_size)
    ref = suite.reference(cfg)
    run = suite.checkpointed_run(cfg)
    _assert_tensors_close(run["params"], ref["params"], "parameter", rtol=PARITY_RTOL, atol=cfg.lr / 100)
    gmax = max(float(g.abs().max()) for g in ref["grads"].values())
    _assert_tensors_close(run["grads"], ref["grads"], "gradient", rtol=1e-4, atol=1e-5 * gmax)


def test_rerun_is_bitwise_identical(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size)
    first = suite.checkpointed_run(cfg)["losses"]
    second = suite.train(cfg)[0]["losses"]
    assert first == second, f"{strategy} ws{world_size} is not deterministic: {first} vs {second}"
