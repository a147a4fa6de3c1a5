"""Rules of the invariants' assertions (invariants/checks.py) stated on small tensors and lists, no ranks: the
tolerance each check allows, exactly at its bound and just past it, and what each failure says. The bite tests
(test_invariants_bite.py) show each check failing on a defective trainer; these hold the bounds themselves,
which a trained model only brushes."""

from __future__ import annotations

import math

import pytest
import torch

from distbench.invariants import checks


def fails(check, *args, **kwargs) -> str:
    """The check's AssertionError message (the test fails if it passes)."""
    with pytest.raises(AssertionError) as e:
        check(*args, **kwargs)
    return str(e.value)


# ---- loss parity --------------------------------------------------------------------------------------------


def test_losses_match_within_1e_5_relative_and_1e_6_absolute() -> None:
    """fp32 with deterministic kernels differs between strategies by reduction order only: |loss - ref| <=
    1e-6 + 1e-5 |ref| per step (PARITY_ATOL, PARITY_RTOL)."""
    assert (checks.PARITY_RTOL, checks.PARITY_ATOL) == (1e-5, 1e-6)
    ok = checks.assert_losses_match
    ok([4.0 + 4.0e-5, 0.0 + 0.9e-6], [4.0, 0.0], "ddp", against="x")
    for losses in ([4.0 + 4.3e-5, 0.0], [4.0, 1.1e-6]):
        message = fails(ok, losses, [4.0, 0.0], "ddp ws2", against=checks.SINGLE_PROCESS_REFERENCE)
        assert "ddp ws2 diverges from the single-process reference" in message


def test_a_run_with_other_steps_than_its_reference_fails_naming_both_counts() -> None:
    message = fails(checks.assert_losses_match, [1.0, 2.0], [1.0, 2.0, 3.0], "zero2", against="the ddp run")
    assert message == "zero2: 2 losses, the ddp run has 3"


def test_fp16_runs_match_in_skipped_steps_and_loss_scales_exactly_and_losses_within_the_stated_rtol() -> None:
    """Overflow skips and loss scales are equal, not close; each loss within its step's rtol of the reference's,
    the bound included, relative to the reference's magnitude (a negative loss too)."""
    ref = {"skipped_steps": [2], "loss_scales": [65536.0, 32768.0, 32768.0], "losses": [2.0, -2.0, 4.0]}
    run = {**ref, "losses": [2.5, -2.5, 4.0]}
    checks.assert_loss_scaling_matches(run, ref, 0.25, "fsdp fp16")
    checks.assert_loss_scaling_matches(
        {**run, "losses": [2.0, -2.0, 5.0]}, ref, [0.0, 0.0, 0.25], "fsdp fp16"
    )
    message = fails(
        checks.assert_loss_scaling_matches, {**run, "losses": [2.0, -2.0, 5.01]}, ref, [0, 0, 0.25], "f"
    )
    assert message.startswith(
        "f diverges from the single-process reference at step 2: loss 5.01, the reference's 4.0 (relative "
        "difference 2.52e-01, allowed 2.50e-01); all losses [2.0, -2.0, 5.01] against [2.0, -2.0, 4.0]"
    )
    message = fails(checks.assert_loss_scaling_matches, {**run, "losses": [2.0, -2.6, 4.0]}, ref, 0.25, "f")
    assert "at step 1: loss -2.6, the reference's -2.0" in message
    assert fails(checks.assert_loss_scaling_matches, {**run, "skipped_steps": []}, ref, 1.0, "f").startswith(
        "f skipped steps [], the reference [2]"
    )
    other_scales = {**run, "loss_scales": [65536.0, 65536.0, 32768.0]}
    assert fails(checks.assert_loss_scaling_matches, other_scales, ref, 1.0, "f").startswith(
        "f ran with loss scales [65536.0, 65536.0, 32768.0], the reference with [65536.0, 32768.0, 32768.0]"
    )
    shorter = {**run, "losses": [2.0, -2.0]}
    assert fails(checks.assert_loss_scaling_matches, shorter, ref, 1.0, "f").startswith("f: 2 losses")
    with pytest.raises(ValueError):  # one rtol a step: a list of another length is the caller's error
        checks.assert_loss_scaling_matches(run, ref, [0.25, 0.25], "f")


# ---- bf16 against the fp32 reference ------------------------------------------------------------------------


def test_rms_is_over_every_element_of_every_tensor() -> None:
    assert checks.rms({"a": torch.tensor([3.0, 4.0]), "b": torch.zeros(1, 1)}) == pytest.approx(
        math.sqrt(25 / 3)
    )
    assert checks.rms({"a": torch.tensor([1.0, -1.0], dtype=torch.bfloat16)}) == pytest.approx(1.0)


def bf16_case(offset: float) -> tuple[dict, dict, dict]:
    """init holds 1 + 2^-8, which bf16 rounds to 1 (a rounding of 2^-8); the reference moves it by 0.02, so the
    allowed rms is sqrt((2^-8)^2 + (0.5 x 0.02)^2) = 0.010735; the run's parameter lies `offset` x that away."""
    init = {"w": torch.tensor([1.0 + 2**-8])}
    ref = {"w": init["w"] + 0.02}
    allowed = math.hypot(2**-8, 0.5 * 0.02)
    run = {"w": ref["w"] + offset * allowed}
    losses = [2.0, 1.0]
    return {"losses": losses, "params": run}, {"losses": losses, "params": ref}, init


def test_bf16_parameters_may_differ_by_the_rounding_of_the_initial_weights_and_half_the_movement() -> None:
    """The bf16 rounding of the initial weights and BF16_MOVEMENT_FRACTION (0.5) of the reference's movement,
    added in quadrature: 0.99 of that passes, 1.01 fails (their sum would pass it, either alone fail 0.99)."""
    assert checks.BF16_MOVEMENT_FRACTION == 0.5
    checks.assert_bf16_matches_fp32_reference(*bf16_case(0.99), "zero2 bf16")
    checks.assert_bf16_matches_fp32_reference(*bf16_case(-0.99), "zero2 bf16")
    exact = {
        "w": torch.tensor([1.0])
    }  # no rounding; moved 0.5, allowed 0.25, the run 0.25 away: at the bound
    at_bound = {"losses": [1.0], "params": {"w": torch.tensor([1.75])}}
    checks.assert_bf16_matches_fp32_reference(
        at_bound, {"losses": [1.0], "params": {"w": torch.tensor([1.5])}}, exact, "z"
    )
    message = fails(checks.assert_bf16_matches_fp32_reference, *bf16_case(1.01), "zero2 bf16")
    assert message == (
        "zero2 bf16: parameters 0.0108 (rms) from the fp32 reference's, allowed 0.0107 (bf16 rounding of the "
        "initial weights 0.00391, the reference moved 0.02): updates lost, as bf16 master weights lose them"
    )


def test_bf16_losses_are_held_to_two_bf16_epsilons_and_parameter_names_to_the_references() -> None:
    """BF16_LOSS_RTOL 1.6e-2 relative, no absolute floor; the same parameters as the reference."""
    assert checks.BF16_LOSS_RTOL == 1.6e-2
    run, ref, init = bf16_case(0.0)
    checks.assert_bf16_matches_fp32_reference({**run, "losses": [2.0 * 1.0159, 1.0]}, ref, init, "z")
    message = fails(
        checks.assert_bf16_matches_fp32_reference, {**run, "losses": [2.0 * 1.0161, 1.0]}, ref, init, "z"
    )
    assert "z diverges from the fp32 reference beyond bf16's precision" in message
    zero_ref = {**ref, "losses": [0.0, 1.0]}
    assert "beyond bf16's precision" in fails(
        checks.assert_bf16_matches_fp32_reference, {**run, "losses": [1e-9, 1.0]}, zero_ref, init, "z"
    )
    assert fails(checks.assert_bf16_matches_fp32_reference, {**run, "losses": [2.0]}, ref, init, "z") == (
        "z: 1 losses, reference has 2"
    )
    extra = {**run, "params": {**run["params"], "b": torch.zeros(1)}}
    assert fails(checks.assert_bf16_matches_fp32_reference, extra, ref, init, "z") == (
        "z: parameter names differ from the reference's"
    )


# ---- parameters and gradients ----------------------------------------------------------------------------


def test_tensors_are_close_within_atol_plus_rtol_of_the_reference_by_torchs_rule() -> None:
    """|t - ref| <= atol + rtol |ref| elementwise, the bound included; equal infinities are close, a NaN or
    another dtype or shape is not; a failure names the check, the tensor and what torch found."""
    want = {"w": torch.tensor([4.0, -4.0, 0.0, float("inf")])}
    close = checks.assert_tensors_close
    close({"w": torch.tensor([4.5, -4.5, 0.25, float("inf")])}, want, "p", rtol=0.0625, atol=0.25)
    message = fails(
        close, {"w": torch.tensor([4.5, -4.5, 0.26, float("inf")])}, want, "ddp param", 0.0625, 0.25
    )
    assert message.startswith("ddp param w: ")
    assert fails(close, {"w": torch.tensor([4.0, -4.0, 0.0, float("nan")])}, want, "p", 0.1, 0.1)
    finite = {"w": torch.tensor([1.0, 2.0])}
    assert fails(close, {"w": finite["w"].double()}, finite, "p", 0.1, 0.1)  # equal values, another dtype
    assert fails(close, {"w": finite["w"][None]}, finite, "p", 0.1, 0.1)  # equal values, another shape
    assert fails(close, {"w": -finite["w"]}, finite, "p", 0.1, 0.1)  # the opposite sign
    names = fails(
        close, {"w": want["w"], "x": want["w"]}, {"w": want["w"], "v": want["w"]}, "ddp param", 0.1, 0.1
    )
    assert names == "ddp param names differ: missing ['v'], extra ['x']"


def test_parameters_are_held_to_a_hundredth_of_a_step_and_gradients_to_1e_4_of_themselves() -> None:
    """Parameters: rtol PARITY_RTOL, atol lr / 100 plus steps x update_rtol x lr; gradients: rtol 1e-4 and a
    floor of grad_atol_of_max (1e-5) of the largest reference gradient (by magnitude, of any tensor)."""
    lr = 0.5
    ref = {
        "params": {"w": torch.tensor([0.0])},
        "grads": {"g": torch.tensor([0.0, -64.0]), "h": torch.tensor([2.0])},
    }

    def run(param: float, grad: float = 0.0, h: float = 2.0) -> dict:
        return {
            "params": {"w": torch.tensor([param])},
            "grads": {"g": torch.tensor([grad, -64.0]), "h": torch.tensor([h])},
        }

    check = checks.assert_params_and_grads_match
    check(run(0.005), ref, lr, "ddp")
    assert fails(check, run(0.0051), ref, lr, "ddp").startswith("ddp parameter w: ")
    check(run(0.005 + 3 * 0.01 * lr), ref, lr, "ddp", update_rtol=0.01, steps=3)
    fails(check, run(0.0051), ref, lr, "ddp", steps=3)  # steps alone allow nothing more
    fails(check, run(0.0051), ref, lr, "ddp", update_rtol=0.01)  # nor an update error without steps
    fails(check, run(0.006 + 3 * 0.01 * lr), ref, lr, "ddp", update_rtol=0.01, steps=3)
    check(run(0.0, grad=64 * 1e-5 * 0.99), ref, lr, "ddp")
    assert fails(check, run(0.0, grad=64 * 1e-5 * 1.01), ref, lr, "ddp").startswith("ddp gradient g: ")
    check(run(0.0, grad=64 * 1e-3 * 0.99), ref, lr, "ddp", grad_atol_of_max=1e-3)
    check(run(0.0, h=2.0 * (1 + 1e-4) + 64e-5 * 0.99), ref, lr, "ddp")
    fails(check, run(0.0, h=2.0 * (1 + 1e-4) + 64e-5 * 1.05), ref, lr, "ddp")


def test_an_exported_models_weights_are_held_to_the_parameters_tolerance() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    lr = 0.01
    checks.assert_exported_weights_match(model, {"weight": torch.tensor([[1.0 + 0.99e-4, -1.0]])}, lr, "hf")
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.995e-4, -1.0]]))  # against 0: lr / 100 alone
    checks.assert_exported_weights_match(model, {"weight": torch.tensor([[0.0, -1.0]])}, lr, "hf")
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.02e-4, -1.0]]))
    fails(checks.assert_exported_weights_match, model, {"weight": torch.tensor([[0.0, -1.0]])}, lr, "hf")
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    message = fails(
        checks.assert_exported_weights_match,
        model,
        {"weight": torch.tensor([[1.0 + 1.2e-4, -1.0]])},
        lr,
        "hf",
    )
    assert message.startswith("hf exported parameter weight: ")


# ---- LoRA, resume, collectives ----------------------------------------------------------------------------


def test_lora_trains_every_adapter_and_leaves_every_base_weight_bitwise_as_it_was() -> None:
    """Every base weight bitwise equal to its initial value (not even weight decay may touch it), every
    adapter (.lora_A., .lora_B.) moved; a failure counts them and names the first three, sorted."""
    init = {
        "h.0.attn.weight": torch.tensor([1.0]),
        "h.0.attn.lora_A.default.weight": torch.tensor([0.5]),
        "h.0.attn.lora_B.default.weight": torch.tensor([0.0]),
    }
    trained = {
        **init,
        "h.0.attn.lora_A.default.weight": torch.tensor([0.4]),
        "h.0.attn.lora_B.default.weight": torch.tensor([0.1]),
    }
    checks.assert_only_adapters_trained(trained, init, "ddp lora")
    decayed = {**trained, "h.0.attn.weight": torch.tensor([1.0 - 1e-7])}
    assert fails(checks.assert_only_adapters_trained, decayed, init, "ddp lora") == (
        "ddp lora: 1 frozen base weights changed, e.g. ['h.0.attn.weight']"
    )
    b_still = {**trained, "h.0.attn.lora_B.default.weight": torch.tensor([0.0])}
    assert fails(checks.assert_only_adapters_trained, b_still, init, "ddp lora") == (
        "ddp lora: 1 adapters never moved, e.g. ['h.0.attn.lora_B.default.weight']"
    )
    a_still = {**trained, "h.0.attn.lora_A.default.weight": torch.tensor([0.5])}
    assert "adapters never moved, e.g. ['h.0.attn.lora_A.default.weight']" in fails(
        checks.assert_only_adapters_trained, a_still, init, "ddp lora"
    )
    layers = {
        f"h.{i}.attn.{part}": torch.tensor([1.0]) for i in range(4) for part in ("weight", "lora_A.x.weight")
    }
    all_moved = {n: t + 1 for n, t in layers.items()}
    assert fails(checks.assert_only_adapters_trained, all_moved, layers, "m") == (
        "m: 4 frozen base weights changed, e.g. ['h.0.attn.weight', 'h.1.attn.weight', 'h.2.attn.weight']"
    )
    assert fails(checks.assert_only_adapters_trained, layers, layers, "m") == (
        "m: 4 adapters never moved, e.g. ['h.0.attn.lora_A.x.weight', 'h.1.attn.lora_A.x.weight', "
        "'h.2.attn.lora_A.x.weight']"
    )
    plain = {"h.0.attn.weight": torch.tensor([1.0]), "h.0.lora_A_like.weight": torch.tensor([1.0])}
    assert (
        fails(checks.assert_only_adapters_trained, plain, plain, "x") == "x: the model has no LoRA adapters"
    )
    assert fails(checks.assert_only_adapters_trained, {**trained, "extra": torch.zeros(1)}, init, "x") == (
        "x: parameter names differ from the initial model's"
    )


def test_a_resumed_run_continues_bitwise_from_the_step_it_was_saved_at() -> None:
    uninterrupted = [4.0, 3.5, 3.25, 3.125]
    checks.assert_resume_exact({"start_step": 2, "losses": [3.25, 3.125]}, uninterrupted, 2, "fsdp")
    assert fails(
        checks.assert_resume_exact, {"start_step": 1, "losses": [3.25, 3.125]}, uninterrupted, 2, "fsdp"
    ) == ("fsdp: resumed at step 1, saved at 2")
    message = fails(
        checks.assert_resume_exact, {"start_step": 2, "losses": [3.25, 3.1250001]}, uninterrupted, 2, "fsdp"
    )
    assert message == (
        "fsdp: losses after resume [3.25, 3.1250001] differ from the uninterrupted run [3.25, 3.125]: optimizer "
        "state, LR schedule, RNG or data position was not restored"
    )


def test_gradient_reductions_are_all_reduces_plus_reduce_scatters_once_per_step_however_many_micro_batches() -> (
    None
):
    """DDP and HSDP's replicate dimension all-reduce, FSDP reduce-scatters; all-gathers are not reductions.
    Accumulating issues as many per step as one micro-batch does, and at least one."""
    assert checks.grad_collectives({"all_reduce": 2, "reduce_scatter": 3, "all_gather": 7}) == 5
    assert (
        checks.grad_collectives({"reduce_scatter": 3}) == 3
        and checks.grad_collectives({"all_reduce": 2}) == 2
    )
    one = {"all_reduce": 1.0, "all_gather": 4.0}
    checks.assert_sync_once_per_step(one, {"all_reduce": 1.0, "all_gather": 16.0}, "ddp")
    assert fails(checks.assert_sync_once_per_step, one, {"all_reduce": 4.0}, "ddp accum 4") == (
        "ddp accum 4 issued {'all_reduce': 4.0} collectives per step while accumulating, {'all_reduce': 1.0, "
        "'all_gather': 4.0} without: gradients are synchronised on every micro-batch"
    )
    assert fails(checks.assert_sync_once_per_step, {"all_gather": 2.0}, {"all_gather": 2.0}, "fsdp") == (
        "fsdp issued no gradient collective per step: {'all_gather': 2.0}"
    )
    checks.assert_sync_once_per_step({"reduce_scatter": 1.0}, {"reduce_scatter": 1.0}, "fsdp")
