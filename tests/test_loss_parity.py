"""Invariant: every strategy trains the same model to the same loss as an independent reference.

The reference is a hand-written single-process loop accumulating gradients over the same global batch
(distbench.invariants.reference), sharing only the model init and the data with the code under test.
"""

from __future__ import annotations

import numpy as np

from distbench.suite import PARITY_ATOL, PARITY_RTOL


def test_loss_parity(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size)
    ref = suite.reference(cfg)["losses"]
    outs = suite.train(cfg)
    per_rank = [o["losses"] for o in outs]
    assert all(r == per_rank[0] for r in per_rank), f"ranks report different global losses: {per_rank}"
    losses = per_rank[0]
    assert len(losses) == cfg.steps
    np.testing.assert_allclose(
        losses, ref, rtol=PARITY_RTOL, atol=PARITY_ATOL,
        err_msg=f"{strategy} at world size {world_size} diverges from the single-process reference",
    )
    assert losses[-1] < losses[0], f"loss did not decrease over {cfg.steps} steps: {losses}"


def test_rerun_is_bitwise_identical(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size, steps=3)
    first = suite.train(cfg)[0]["losses"]
    second = suite.train(cfg)[0]["losses"]
    assert first == second, f"{strategy} ws{world_size} is not deterministic: {first} vs {second}"
