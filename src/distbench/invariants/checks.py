"""The invariants' assertions, shared by the tests that assert them and the tests that prove they can fail.

Each check raises AssertionError with a message naming the configuration and what diverged. Tolerances
follow the policy in DESIGN.md: fp32 with TF32 off and deterministic kernels, so only reduction order
differs between strategies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: Loss parity: fp32, TF32 off, deterministic kernels; only reduction order differs.
PARITY_RTOL = 1e-5
PARITY_ATOL = 1e-6


def assert_losses_match(losses: list[float], reference: list[float], what: str) -> None:
    """Per-step losses equal the reference's within the parity tolerance."""
    assert len(losses) == len(reference), f"{what}: {len(losses)} losses, reference has {len(reference)}"
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL, atol=PARITY_ATOL,
                               err_msg=f"{what} diverges from the single-process reference")


def assert_tensors_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                         rtol: float, atol: float) -> None:
    """Same names, and every tensor close to the reference's."""
    assert set(got) == set(want), (
        f"{what} names differ: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}")
    for name, ref in want.items():
        def msg(m: str, n: str = name) -> str:
            return f"{what} {n}: {m}"

        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol, msg=msg)


def assert_params_and_grads_match(run: dict[str, Any], ref: dict[str, Any], lr: float, what: str) -> None:
    """Final full parameters and last-step gradients against the reference.

    AdamW moves a parameter by at most about lr per step, and a parameter whose gradient is identically zero
    in exact arithmetic (GPT-2's attention key bias) moves by amplified rounding noise: the absolute floor for
    parameters is 1% of one step's largest update (lr/100), while a strategy that fails to synchronise
    gradients moves parameters by ~lr. Gradients: rtol 1e-4 with a floor of 1e-5 of the largest reference
    gradient, tight enough that a missing 1/world_size averaging (x2) fails.
    """
    assert_tensors_close(run["params"], ref["params"], f"{what} parameter", rtol=PARITY_RTOL, atol=lr / 100)
    gmax = max(float(g.abs().max()) for g in ref["grads"].values())
    assert_tensors_close(run["grads"], ref["grads"], f"{what} gradient", rtol=1e-4, atol=1e-5 * gmax)


def assert_only_adapters_trained(params: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                                 what: str) -> None:
    """LoRA trained what it should: every base weight bitwise equal to its initial value (frozen, so not even
    weight decay may touch it) and every adapter moved from its own. Parity with the reference alone would
    miss a defect the reference shared; this is stated against the initial weights."""
    adapters = {n for n in initial if ".lora_A." in n or ".lora_B." in n}
    assert adapters, f"{what}: the model has no LoRA adapters"
    assert set(params) == set(initial), f"{what}: parameter names differ from the initial model's"
    moved = [n for n in sorted(set(initial) - adapters) if not torch.equal(params[n], initial[n])]
    assert not moved, f"{what}: {len(moved)} frozen base weights changed, e.g. {moved[:3]}"
    still = [n for n in sorted(adapters) if torch.equal(params[n], initial[n])]
    assert not still, f"{what}: {len(still)} adapters never moved, e.g. {still[:3]}"


def assert_exported_weights_match(model: torch.nn.Module, ref_params: dict[str, torch.Tensor], lr: float,
                                  what: str) -> None:
    """An exported model's weights against the reference's after the same steps, with the parameter
    tolerances of assert_params_and_grads_match: fp32 master weights pass, bf16-rounded ones (2^-9 of each
    weight) do not, although they barely move the loss."""
    got = {n: t.detach().float() for n, t in model.state_dict().items()}
    assert_tensors_close(got, ref_params, f"{what} exported parameter", rtol=PARITY_RTOL, atol=lr / 100)


def assert_resume_exact(resumed: dict[str, Any], uninterrupted: list[float], saved_at: int, what: str) -> None:
    """A run resumed from the checkpoint of step `saved_at` continues bitwise like the uninterrupted run."""
    assert resumed["start_step"] == saved_at, f"{what}: resumed at step {resumed['start_step']}, saved at {saved_at}"
    assert resumed["losses"] == uninterrupted[saved_at:], (
        f"{what}: losses after resume {resumed['losses']} differ from the uninterrupted run "
        f"{uninterrupted[saved_at:]}: optimizer state, LR schedule, RNG or data position was not restored")


def grad_collectives(counts: dict[str, float]) -> float:
    """Gradient reductions per step: all-reduce (DDP, HSDP's replicate dim) plus reduce-scatter (FSDP)."""
    return counts.get("all_reduce", 0) + counts.get("reduce_scatter", 0)


def assert_sync_once_per_step(without_accum: dict[str, float], with_accum: dict[str, float], what: str) -> None:
    """Accumulating k micro-batches issues as many gradient collectives per step as one micro-batch does."""
    assert grad_collectives(without_accum) >= 1, f"{what} issued no gradient collective per step: {without_accum}"
    assert grad_collectives(with_accum) == grad_collectives(without_accum), (
        f"{what} issued {with_accum} collectives per step while accumulating, {without_accum} without: "
        "gradients are synchronised on every micro-batch")
