"""The invariants' assertions, shared by the tests that assert them and the tests that prove they can fail.

Each check raises AssertionError with a message naming the configuration and what diverged. Tolerances
follow the suite's precision policy (docs: what is asserted): fp32 with TF32 off and deterministic kernels, so only reduction order
differs between strategies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: Loss parity: fp32, TF32 off, deterministic kernels; only reduction order differs.
PARITY_RTOL = 1e-5
PARITY_ATOL = 1e-6


#: What most parity checks compare with: invariants/reference.py's run of the same configuration.
SINGLE_PROCESS_REFERENCE = "the single-process reference"


def assert_losses_match(losses: list[float], reference: list[float], what: str, *, against: str) -> None:
    """Per-step losses equal `reference`'s within the parity tolerance. `against` names what `reference` is
    (SINGLE_PROCESS_REFERENCE, or another run's description), so that a failure says what it compared with."""
    assert len(losses) == len(reference), f"{what}: {len(losses)} losses, {against} has {len(reference)}"
    np.testing.assert_allclose(
        losses,
        reference,
        rtol=PARITY_RTOL,
        atol=PARITY_ATOL,
        err_msg=f"{what} diverges from {against}",
    )


def assert_loss_scaling_matches(
    run: dict[str, Any], reference: dict[str, Any], rtol: float | list[float], what: str
) -> None:
    """fp16: the same steps skipped for an overflow, the same loss scale at every step (powers of two: equal, not
    close), and per-step losses within `rtol` (fp16's tolerance, which the caller states; one per step where it
    grows with the steps)."""
    assert run["skipped_steps"] == reference["skipped_steps"], (
        f"{what} skipped steps {run['skipped_steps']}, the reference {reference['skipped_steps']}"
    )
    assert run["loss_scales"] == reference["loss_scales"], (
        f"{what} ran with loss scales {run['loss_scales']}, the reference with {reference['loss_scales']}"
    )
    assert len(run["losses"]) == len(reference["losses"]), f"{what}: {len(run['losses'])} losses"
    rtols = rtol if isinstance(rtol, list) else [rtol] * len(run["losses"])
    for step, (loss, ref, tol) in enumerate(zip(run["losses"], reference["losses"], rtols, strict=True)):
        assert abs(loss - ref) <= tol * abs(ref), (
            f"{what} diverges from the single-process reference at step {step}: loss {loss!r}, the reference's "
            f"{ref!r} (relative difference {abs(loss - ref) / abs(ref):.2e}, allowed {tol:.2e}); all losses "
            f"{run['losses']} against {reference['losses']}"
        )


#: bf16 keeps 8 significant bits: a relative rounding error of at most 2^-8 (eps_bf16 = 2^-7 = 7.8e-3).
#: Losses of a bf16 run against the fp32 reference: rtol 1.6e-2, about two eps_bf16, which is torch.testing's
#: default for bf16 and what PyTorch's own FSDP mixed-precision tests hold bf16 losses to. A loss is a mean
#: over thousands of tokens of fp32 cross-entropy of bf16 logits: the roundings of the logits (each within
#: 2^-8 relative, through a network whose depth compounds them) average out rather than add, so the loss
#: moves far less than one eps (1e-5 relative on gpt2-tiny on CPU); two eps leave room for GPU kernels.
BF16_LOSS_RTOL = 1.6e-2
#: Parameters of a bf16 run may differ from the fp32 reference's by the bf16 rounding of the initial weights
#: (DeepSpeed's bf16 mode builds its fp32 masters from the bf16 model: measured on CPU, exactly that) and by
#: this fraction of how far the reference's parameters moved, added in quadrature (independent errors).
#: With fp32 master weights the rest is Adam updates flipped by bf16 noise in the gradient (measured: 2% of
#: the movement); with bf16 master weights every update below half an ulp of its weight is rounded away,
#: which at a learning rate below that half ulp is most of the movement.
BF16_MOVEMENT_FRACTION = 0.5


def rms(tensors: dict[str, torch.Tensor]) -> float:
    """Root mean square over every element of every tensor (each tensor's norm accumulated by torch, their
    squares summed in float64: no float64 copy of a model's parameters)."""
    n = sum(t.numel() for t in tensors.values())
    return (sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in tensors.values()) / n) ** 0.5


def assert_bf16_matches_fp32_reference(
    run: dict[str, Any], ref: dict[str, Any], init: dict[str, torch.Tensor], what: str
) -> None:
    """A bf16 run (bf16 compute, fp32 master weights, fp32 gradient reduction) against the fp32 reference of
    the same workload: per-step losses within BF16_LOSS_RTOL; final full parameters within the bf16
    rounding of `init` (the initial weights) plus BF16_MOVEMENT_FRACTION of the reference's movement from
    `init`, as root mean squares over all parameters."""
    assert len(run["losses"]) == len(ref["losses"]), (
        f"{what}: {len(run['losses'])} losses, reference has {len(ref['losses'])}"
    )
    np.testing.assert_allclose(
        run["losses"],
        ref["losses"],
        rtol=BF16_LOSS_RTOL,
        atol=0,
        err_msg=f"{what} diverges from the fp32 reference beyond bf16's precision",
    )
    names = sorted(ref["params"])
    assert set(run["params"]) == set(names), f"{what}: parameter names differ from the reference's"
    error = rms({n: run["params"][n].float() - ref["params"][n] for n in names})
    moved = rms({n: ref["params"][n] - init[n].float() for n in names})
    rounding = rms({n: init[n].float() - init[n].bfloat16().float() for n in names})
    allowed = (rounding**2 + (BF16_MOVEMENT_FRACTION * moved) ** 2) ** 0.5
    assert error <= allowed, (
        f"{what}: parameters {error:.3g} (rms) from the fp32 reference's, allowed {allowed:.3g} (bf16 rounding "
        f"of the initial weights {rounding:.3g}, the reference moved {moved:.3g}): updates lost, as bf16 master "
        "weights lose them"
    )


def assert_tensors_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, rtol: float, atol: float
) -> None:
    """Same names, and every tensor close to the reference's."""
    assert set(got) == set(want), (
        f"{what} names differ: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}"
    )
    for name, ref in want.items():
        t = got[name]
        if (
            t.dtype == ref.dtype
            and t.shape == ref.shape
            and bool(torch.all((t - ref).abs_() <= atol + rtol * ref.abs()))
        ):
            continue  # close: one pass, where torch.testing.assert_close took seconds a model on 2 threads

        def msg(m: str, n: str = name) -> str:
            return f"{what} {n}: {m}"

        # torch's rule (equal infs, ...) and its message
        torch.testing.assert_close(t, ref, rtol=rtol, atol=atol, msg=msg)


def assert_params_and_grads_match(
    run: dict[str, Any],
    ref: dict[str, Any],
    lr: float,
    what: str,
    *,
    update_rtol: float = 0.0,
    steps: int = 0,
    grad_atol_of_max: float = 1e-5,
) -> None:
    """Final full parameters and last-step gradients against the reference.

    AdamW moves a parameter by at most about lr per step, and a parameter whose gradient is identically zero
    in exact arithmetic (GPT-2's attention key bias) moves by amplified rounding noise: the absolute floor for
    parameters is 1% of one step's largest update (lr/100), while a strategy that fails to synchronise
    gradients moves parameters by ~lr. Gradients: rtol 1e-4 with a floor of 1e-5 of the largest reference
    gradient (`grad_atol_of_max`), tight enough that a missing 1/world_size averaging (x2) fails.
    `update_rtol`: a relative error each of `steps` updates may carry by design (a clip coefficient from a
    norm summed on the host), adding up to update_rtol * lr per step; the last step's gradients, taken at
    those parameters, then differ by more than rounding, which the caller states in `grad_atol_of_max`.
    """
    atol = lr / 100 + steps * update_rtol * lr
    assert_tensors_close(run["params"], ref["params"], f"{what} parameter", rtol=PARITY_RTOL, atol=atol)
    gmax = max(float(g.abs().max()) for g in ref["grads"].values())
    assert_tensors_close(
        run["grads"], ref["grads"], f"{what} gradient", rtol=1e-4, atol=grad_atol_of_max * gmax
    )


def assert_only_adapters_trained(
    params: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], what: str
) -> None:
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


def assert_exported_weights_match(
    model: torch.nn.Module, ref_params: dict[str, torch.Tensor], lr: float, what: str
) -> None:
    """An exported model's weights against the reference's after the same steps, with the parameter
    tolerances of assert_params_and_grads_match: fp32 master weights pass, bf16-rounded ones (2^-9 of each
    weight) do not, although they barely move the loss."""
    got = {n: t.detach().float() for n, t in model.state_dict().items()}
    assert_tensors_close(got, ref_params, f"{what} exported parameter", rtol=PARITY_RTOL, atol=lr / 100)


def assert_resume_exact(
    resumed: dict[str, Any], uninterrupted: list[float], saved_at: int, what: str
) -> None:
    """A run resumed from the checkpoint of step `saved_at` continues bitwise like the uninterrupted run."""
    assert resumed["start_step"] == saved_at, (
        f"{what}: resumed at step {resumed['start_step']}, saved at {saved_at}"
    )
    assert resumed["losses"] == uninterrupted[saved_at:], (
        f"{what}: losses after resume {resumed['losses']} differ from the uninterrupted run "
        f"{uninterrupted[saved_at:]}: optimizer state, LR schedule, RNG or data position was not restored"
    )


def grad_collectives(counts: dict[str, float]) -> float:
    """Gradient reductions per step: all-reduce (DDP, HSDP's replicate dim) plus reduce-scatter (FSDP)."""
    return counts.get("all_reduce", 0) + counts.get("reduce_scatter", 0)


def assert_sync_once_per_step(
    without_accum: dict[str, float], with_accum: dict[str, float], what: str
) -> None:
    """Accumulating k micro-batches issues as many gradient collectives per step as one micro-batch does."""
    assert grad_collectives(without_accum) >= 1, (
        f"{what} issued no gradient collective per step: {without_accum}"
    )
    assert grad_collectives(with_accum) == grad_collectives(without_accum), (
        f"{what} issued {with_accum} collectives per step while accumulating, {without_accum} without: "
        "gradients are synchronised on every micro-batch"
    )
