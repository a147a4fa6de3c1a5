"""The recipes users train with, at parity with the independent reference: gradient clipping by the global
gradient norm, each strategy clipping the way its users do (torch's clip_grad_norm_ for single, DDP and
FSDP2's DTensors, FSDP1's own, DeepSpeed's `gradient_clipping`); activation checkpointing; dropout, each
sample's masks from its own stream, whichever rank, micro-batch, recomputation or resume runs it; fp16 with
dynamic loss scaling, an overflow planted from outside skipping the same step everywhere; LoRA fine-tuning
through peft, against a reference that writes LoRA out by hand; and these recipes in the combinations users run
(COMBINATIONS), through the same checks against a reference that applies them in one hand-written order."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import mutants
import recipe_jobs
import tier_cases
from distbench.config import RunConfig
from distbench.invariants.checks import (
    BF16_LOSS_RTOL,
    PARITY_RTOL,
    SINGLE_PROCESS_REFERENCE,
    assert_bf16_matches_fp32_reference,
    assert_loss_scaling_matches,
    assert_losses_match,
    assert_only_adapters_trained,
    assert_params_and_grads_match,
    assert_resume_exact,
)
from distbench.runtime.pool import JobError
from distbench.strategies import REGISTRY, get_spec
from distbench.strategies.fsdp1 import LORA_ONE_RANK_WHY
from distbench.workloads.dropout import SampleDropout, sample_streams
from recipe_jobs import BF16, LORA, refuses_lora

#: Far below gpt2-tiny's gradient norms on this data (about 3-4): every step is clipped, hard.
CLIP = 0.25


def _clip_reference(suite, cfg):
    """The reference of a clipped configuration, asserted to clip at every step."""
    ref = suite.reference(cfg)
    # negative control: a clip that never bites would pass whatever the strategy does with it
    assert len(ref["grad_norms"]) == cfg.steps and min(ref["grad_norms"]) > 2 * CLIP, ref["grad_norms"]
    return ref


def _clipped(suite, strategy: str, world_size: int):
    cfg = suite.config(strategy, world_size, clip_grad_norm=CLIP)
    return cfg, _clip_reference(suite, cfg)


#: The pre-clip global norm against the reference's, relative. On the device both sum squares in a tree and
#: agree to 1e-5. Where the gradients live on the host (offload), torch's CPU norm sums fp32 squares in long
#: runs: over GPT-2 124M-shaped random tensors it reads 4.8e-5 low against float64, and on an H200 fsdp_offload's
#: five clipped steps of GPT-2 124M differed from the device reference by 3.9e-5 to 6.7e-4. A norm taken over a
#: shard of the gradient instead of all of it is off by tens of percent, which both tolerances catch.
NORM_RTOL = 1e-5
HOST_NORM_RTOL = 2e-3
#: The last step's gradients are taken at parameters that carry that error: on an H200, fsdp_offload's
#: (GPT-2 124M, five clipped steps) differed from the reference's by up to 8.4e-5 of the largest gradient
#: (1.4e-5 on the embedding), over the 1e-5 the device strategies hold. A gradient off by a missing
#: 1/world_size average is off by half of itself.
HOST_GRAD_ATOL_OF_MAX = 5e-4


def _norms_on_host(strategy: str) -> bool:
    """Whether torch's clip_grad_norm_ sums the strategy's gradients on the host (FSDP2's offload)."""
    spec = get_spec(strategy)  # DeepSpeed clips by its own; its offload keeps the norm on the device
    return spec.trainer_module == "fsdp" and dict(spec.defaults).get("offload", False)


def _check_accumulated_clip(suite, cfg, run: dict[str, Any]) -> None:
    """Clipping by the global norm of the whole step's accumulated gradient: the pre-clip norms, losses,
    parameters and last gradients of the reference, which clips once per step by its own rule."""
    # negative control: each rank accumulates micro-batches, so clipping them one by one would differ
    assert cfg.accum_steps >= 2, cfg
    ref = _clip_reference(suite, cfg)
    what = (
        f"{cfg.strategy} ws{cfg.world_size} accumulating {cfg.accum_steps} micro-batches, clipped at {CLIP}"
    )
    on_host = _norms_on_host(cfg.strategy)
    rel = HOST_NORM_RTOL if on_host else NORM_RTOL
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rel), what  # the global norm, pre-clip
    assert_losses_match(run["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
    # the clip coefficient carries the norm's error into every update: 1.2e-5 on one of GPT-2's 38.6M embedding
    # weights after five steps of fsdp_offload on an H200, over the device strategies' lr / 100 floor
    assert_params_and_grads_match(
        run,
        ref,
        cfg.lr,
        what,
        update_rtol=rel if on_host else 0.0,
        steps=cfg.steps,
        grad_atol_of_max=HOST_GRAD_ATOL_OF_MAX if on_host else 1e-5,
    )


def test_clipping_by_a_shards_own_norm_fails_parity(suite):
    """FSDP2 ranks clipping by their local shard's norm scale each shard differently: caught by the losses."""
    if suite.device_type == "cuda":
        pytest.skip("the CPU tier's bite test covers the check")
    cfg, ref = _clipped(suite, "fsdp_full", 2)
    broken = suite.run_job(2, mutants.train, mutation="local_norm_clip", cfg=cfg)[0]
    with pytest.raises(AssertionError):
        assert_losses_match(
            broken["losses"],
            ref["losses"],
            "fsdp_full ws2 clipping by local shards",
            against=SINGLE_PROCESS_REFERENCE,
        )


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("single", "ddp", "fsdp_full", "fsdp_grad", "fsdp_hybrid", "zero2", "zero3")
@pytest.mark.default_cases("ddp-ws2", "fsdp_full-ws2", "zero3-ws2")
def test_activation_checkpointing_recomputes_and_keeps_the_losses(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size, activation_checkpointing=True)
    out = suite.run_job(world_size, recipe_jobs.train_counting_attention_forwards, cfg=cfg)[0]
    # negative control: every block's attention ran forward again in backward, so recomputation really happened
    micro_steps = cfg.accum_steps * cfg.steps
    assert out["attention_modules"] > 0 and min(out["attention_forwards"]) >= 2 * micro_steps, (
        micro_steps,
        out,
    )
    assert_losses_match(
        out["losses"],
        suite.reference(cfg)["losses"],
        f"{strategy} ws{world_size} with AC",
        against=SINGLE_PROCESS_REFERENCE,
    )


def test_activation_checkpointing_needs_a_transformers_model(suite):
    from distbench.errors import ConfigError
    from distbench.strategies.base import enable_activation_checkpointing

    with pytest.raises(ConfigError, match="activation_checkpointing_enable"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


#: A dropout rate that moves gpt2-tiny's losses a hundred times the parity tolerance and more (asserted).
DROPOUT = 0.2


def _dropout_reference(suite, cfg):
    """The reference of a configuration with dropout, asserted to move the losses."""
    ref = suite.reference(cfg)
    plain = suite.reference(cfg.replace(dropout=0.0))["losses"]
    # negative control: dropout that dropped nothing would pass whatever the strategy does with the streams
    assert not np.allclose(ref["losses"], plain, rtol=100 * PARITY_RTOL, atol=0), (ref["losses"], plain)
    return ref


def _dropped(suite, strategy: str, world_size: int, **overrides):
    cfg = suite.config(strategy, world_size, dropout=DROPOUT, **overrides)
    return cfg, _dropout_reference(suite, cfg)


@pytest.mark.up_to_world_size(2)
@pytest.mark.default_cases("ddp-ws2", "fsdp_full-ws2", "zero3-ws2")
def test_dropout_streams_match_the_reference(suite, strategy, world_size):
    """Every sample sees its own dropout stream whichever rank and micro-batch runs it: losses, parameters and
    gradients equal the reference's, which keys the streams by each sample's place in the global batch."""
    cfg, ref = _dropped(suite, strategy, world_size)
    run = suite.train(cfg, return_params=True, return_grads=True)[0]
    what = f"{strategy} ws{world_size} with dropout {DROPOUT}"
    assert_losses_match(run["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
    assert_params_and_grads_match(run, ref, cfg.lr, what)


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("fsdp_full")  # a wrapper whose hooks run again in the recomputation
@pytest.mark.default_cases("fsdp_full-ws2")
def test_dropout_masks_survive_recomputation(suite, strategy, world_size):
    """Activation checkpointing runs each block's forward again in backward; the recomputed dropout must draw
    the forward's masks (torch restores only its global RNG for it), or gradients belong to other masks."""
    cfg, ref = _dropped(suite, strategy, world_size, activation_checkpointing=True)
    out = suite.run_job(world_size, recipe_jobs.train_counting_attention_forwards, cfg=cfg)[0]
    micro_steps = cfg.accum_steps * cfg.steps
    assert min(out["attention_forwards"], default=0) >= 2 * micro_steps, (micro_steps, out)  # it recomputed
    assert_losses_match(
        out["losses"],
        ref["losses"],
        f"{strategy} ws{world_size} with dropout and AC",
        against=SINGLE_PROCESS_REFERENCE,
    )


@pytest.mark.parametrize("mutation", ["dropout_global_rng", "dropout_local_index"])
def test_dropout_from_another_stream_fails_parity(suite, mutation):
    """Masks from torch's global RNG (the same on both ranks), or streams keyed by the rank's local sample
    index, give other masks than the reference's at world size 2: caught by the losses."""
    cfg, ref = _dropped(suite, "ddp", 2)
    broken = suite.run_job(2, mutants.train, mutation=mutation, cfg=cfg)[0]
    with pytest.raises(AssertionError):
        assert_losses_match(
            broken["losses"], ref["losses"], f"ddp ws2 {mutation}", against=SINGLE_PROCESS_REFERENCE
        )


def test_sample_dropout_masks_belong_to_the_sample():
    """A sample's mask depends on the sample, not on its neighbours or its row; each sample's differs, each step's
    differs; outside sample_streams it refuses rather than fall back to the global RNG."""
    drop = SampleDropout(0.5, index=0).train()
    x = torch.ones(4, 256)
    with sample_streams(7, 3, [10, 11, 12, 13]):
        four = drop(x)
        again = drop(x)
    with sample_streams(7, 3, [12, 10]):
        two = drop(x[:2])
    with sample_streams(7, 4, [10]):
        next_step = drop(x[:1])
    assert torch.equal(four, again) and torch.equal(two[0], four[2]) and torch.equal(two[1], four[0])
    assert not torch.equal(four[0], four[1]) and not torch.equal(next_step[0], four[0])
    assert set(four.unique().tolist()) == {0.0, 2.0}  # dropped, and the survivors scaled by 1 / (1 - rate)
    with pytest.raises(RuntimeError, match="outside sample_streams"):
        drop(x)


def test_dropout_needs_dropout_modules():
    from distbench.errors import ConfigError
    from distbench.workloads.dropout import apply_dropout

    with pytest.raises(ConfigError, match="nn.Dropout"):
        apply_dropout(torch.nn.Linear(2, 2), DROPOUT)


#: fp16 with a planted overflow: a first loss scale of 2**8 overflows nothing by itself, a window of 2 doubles it
#: after two clean steps, and an inf planted in the gradient of step OVERFLOW_STEP's last micro-batch (the last
#: rank's) must skip that step on every rank and halve the scale (each asserted on the reference).
FP16 = {"precision": "fp16", "loss_scale_power": 8, "loss_scale_window": 2}
OVERFLOW_STEP = 2
#: fp16 loss parity of the torch-native strategies: each micro-batch's forward is the reference's fp16 autocast
#: computation on the same fp32 weights, so what separates them is fp32 parity's reduction order in the
#: gradients, plus any weight whose fp16 rounding that flips (a change of 2**-11 in it): ten times fp32's
#: tolerance (measured on gpt2-tiny: 1.3e-6 at world size 2, 0 at 1).
FP16_RTOL = 10 * PARITY_RTOL


def fp16_ds_rtol(steps: int, global_batch: int) -> list[float]:
    """DeepSpeed's fp16 casts the whole model to fp16, where autocast keeps embeddings, layer norms and the residual
    stream in fp32: every one of those roundings (2**-11 = 4.9e-4 relative) differs from the reference's, so each
    step's update differs a little and the losses drift apart step by step. Measured on an H200 (GPT-2 124M,
    world size 1, the same for zero1, zero2, zero3 and zero3_offload), at a global batch of 16: 0.004, 0.04, 1.4,
    3.4 and 5.8 units of 2**-11 at steps 0-4; at 4: 0.006, 0.04, 5.1, 0.6 and 7.3 (the mean over fewer tokens
    averages fewer independent roundings). Allowed: 1 + 2k units at step k (9 at step 4) at 16, times
    sqrt(16 / global batch). The skip decisions and loss scales, which are what loss scaling must get right,
    are still compared exactly."""
    per_batch = max(1.0, (16 / global_batch) ** 0.5)
    return [(1 + 2 * k) * 2.0**-11 * per_batch for k in range(steps)]


_overflow_references: dict[str, dict] = {}


def _overflow_at(cfg) -> dict[str, int]:
    """Where the inf goes: step OVERFLOW_STEP's last micro-batch of the global batch (the last rank's)."""
    return {"step": OVERFLOW_STEP, "micro_batch": cfg.global_batch // cfg.micro_batch - 1}


def _overflow_reference(suite, cfg):
    """The reference of an fp16 configuration with the overflow planted, once per session."""
    ref_cfg = cfg.replace(strategy="single", world_size=1)
    key = repr((suite.device_type, sorted(ref_cfg.to_dict().items())))
    if key not in _overflow_references:
        _overflow_references[key] = suite.run_job(
            1, recipe_jobs.reference_with_an_overflow, cfg=ref_cfg, **_overflow_at(cfg)
        )[0]
    ref = _overflow_references[key]
    # negative controls: the planted inf skipped its step, other steps ran, and the scale grew, so the strategy's
    # every decision of the rule (skip and halve, step, grow) is compared
    scales, skipped = ref["loss_scales"], ref["skipped_steps"]
    assert skipped[OVERFLOW_STEP] and not all(skipped), ref
    assert any(b > a for a, b in zip(scales, scales[1:], strict=False)), ref
    return ref


def _with_an_overflow(suite, strategy: str, world_size: int):
    reason = get_spec(strategy).unsupported_reason(suite.device_type, world_size, precision="fp16")
    if reason:
        pytest.skip(reason)
    cfg = suite.config(strategy, world_size, **FP16)
    return cfg, _overflow_at(cfg), _overflow_reference(suite, cfg)


def _fp16_rtol(cfg) -> list[float]:
    """Per-step loss tolerance of an fp16 run: DeepSpeed's drift (fp16_ds_rtol) or the torch-native FP16_RTOL."""
    if get_spec(cfg.strategy).trainer_module == "deepspeed":
        return fp16_ds_rtol(cfg.steps, cfg.global_batch)
    return [FP16_RTOL] * cfg.steps


#: Found by the first GPU run of zero0 (one H200, DeepSpeed 0.19.8, 2026-12-02): its skips and loss scales
#: match the reference's exactly and its losses do up to the step after the overflow, then step 4 is 2.05% off
#: (allowed 0.88%), where ZeRO-1/2/3 stay within 7.3 units of 2**-11. Stage 0's fp16 wrapper
#: (FP16_UnfusedOptimizer) steps fp32 copies of its own; which of its steps leaves the reference is not yet
#: known. Strict: the day it passes, this mark must go.
ZERO0_FP16_GPU = pytest.mark.xfail(
    strict=True,
    reason="zero0 fp16 on CUDA leaves the reference at the fourth step (cause open; see the comment)",
)


@pytest.mark.up_to_world_size(2)
# fsdp_full's plain case; fp16+clip runs ddp and fsdp_full at 2 ranks through an overflow too, and fsdp_hybrid's
# mesh on one node is fsdp_full's with a replicate dimension of 1
@pytest.mark.default_cases("fsdp_full-ws2")
def test_fp16_loss_scaling_matches_the_reference(request, suite, strategy, world_size):
    """GradScaler (torch-native; FSDP2's DTensor gradients reduce the overflow flag over the mesh, FSDP1 its
    sharded scaler) or DeepSpeed's fp16 section against the reference's own scaling rule: an overflow on the
    last rank skips the step on rank 0 too, with the same loss scale at every step."""
    if strategy == "zero0" and suite.device_type == "cuda":
        request.applymarker(ZERO0_FP16_GPU)
    cfg, where, ref = _with_an_overflow(suite, strategy, world_size)
    run = suite.run_job(world_size, recipe_jobs.train_with_an_overflow, cfg=cfg, **where)[0]
    what = f"{strategy} ws{world_size} fp16"
    assert run["matmul_dtypes"] == ["float16"], f"{what} multiplied in {run['matmul_dtypes']}"  # it ran fp16
    assert len(ref["losses"]) == cfg.steps, ref
    assert_loss_scaling_matches(run, ref, _fp16_rtol(cfg), what)


def test_fp16_stepping_through_an_overflow_fails_parity(suite):
    """A trainer that applies an overflowed step (its scaler still backs off, so the scales agree) is caught."""
    cfg, where, ref = _with_an_overflow(suite, "ddp", 2)
    broken = suite.run_job(2, mutants.train_with_an_overflow, mutation="fp16_no_skip", cfg=cfg, **where)[0]
    with pytest.raises(AssertionError):
        assert_loss_scaling_matches(broken, ref, FP16_RTOL, "ddp ws2 fp16 stepping through an overflow")


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies(
    "fsdp_full"
)  # the scaler's state is harness state, saved alike by every torch-native one
@pytest.mark.default_cases("fsdp_full-ws2")
def test_fp16_loss_scale_survives_a_resume(suite, strategy, world_size):
    cfg = suite.config(strategy, world_size, **FP16)
    run = suite.checkpointed_run(cfg)
    k = run["save_at"]
    # negative control: the scale grew before the save, so a resume that forgot it would start from the first
    assert run["loss_scales"][k] != run["loss_scales"][0], run["loss_scales"]
    resumed = suite.train(cfg, resume_from=run["checkpoint"])[0]
    assert resumed["loss_scales"] == run["loss_scales"][k:], (resumed["loss_scales"], run["loss_scales"])
    assert_resume_exact(resumed, run["losses"], k, f"{strategy} ws{world_size} fp16")


@pytest.mark.world_size(2)
def test_fp16_loss_scale_survives_a_resharded_resume(suite):
    """The loss scale is the same on every rank, so a resume at another world size (whose random streams
    start afresh) continues it too: FSDP2 saved at 2 ranks, resumed at 1 through DCP's resharding load, runs
    the uninterrupted run's scales and skips from the save on (DeepSpeed's fp16 runs on CUDA only)."""
    cfg = suite.config("fsdp_full", 2, **FP16)
    run = suite.checkpointed_run(cfg)
    k = run["save_at"]
    assert run["loss_scales"][k] != run["loss_scales"][0], run["loss_scales"]  # as the test above
    resumed = suite.train(cfg.replace(world_size=1), resume_from=run["checkpoint"], reshard=True)[0]
    assert resumed["start_step"] == k
    assert resumed["loss_scales"] == run["loss_scales"][k:], (resumed["loss_scales"], run["loss_scales"])
    assert resumed["skipped_steps"] == run["skipped_steps"][k:]


def test_deepspeed_fp16_on_cpu_is_refused_with_its_reason(suite):
    with pytest.raises(JobError) as info:
        suite.train(suite.config("zero2", 1, precision="fp16"))
    assert info.value.exc_types == {"ConfigError"} and "fp16 on cuda only" in str(info.value), info.value


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies(
    "single", "ddp", "fsdp_full", "fsdp_grad", "fsdp1_full", "fsdp1_grad", "zero2", "zero3"
)
@pytest.mark.default_cases("ddp-ws2", "fsdp_full-ws2", "zero3-ws2")
def test_lora_trains_the_adapters_alone_at_parity(suite, strategy, world_size):
    """LoRA through peft: the losses, every parameter and the adapters' gradients are the reference's (which
    writes LoRA out by hand), the base weights are their initial values and every adapter moved."""
    cfg = suite.config(strategy, world_size, **LORA)
    if refuses_lora(strategy, world_size):  # refused, clearly, before it wraps
        with pytest.raises(JobError) as info:
            suite.train(cfg)
        assert info.value.exc_types == {"ConfigError"} and LORA_ONE_RANK_WHY in str(info.value), info.value
        return
    ref = suite.reference(cfg)
    run = suite.checkpointed_run(cfg)
    what = f"{strategy} ws{world_size} with LoRA rank {cfg.lora_rank}"
    assert_losses_match(run["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
    assert_params_and_grads_match(run, ref, cfg.lr, what)
    assert_only_adapters_trained(run["params"], ref["initial"], what)


def test_lora_with_the_base_left_trainable_fails(suite):
    """A LoRA run whose base weights train too (the model set trainable again after peft froze it): the base
    weights move and the losses leave the reference's."""
    if suite.device_type == "cuda":
        pytest.skip("the CPU tier's bite test covers the check")
    cfg = suite.config("ddp", 2, **LORA)
    ref = suite.reference(cfg)
    broken = suite.run_job(2, mutants.train, mutation="lora_base_trainable", cfg=cfg, return_params=True)[0]
    with pytest.raises(AssertionError, match="frozen base weights changed"):
        assert_only_adapters_trained(broken["params"], ref["initial"], "ddp ws2 with the base trainable")
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(
            broken["losses"],
            ref["losses"],
            "ddp ws2 with the base trainable",
            against=SINGLE_PROCESS_REFERENCE,
        )


def test_lora_without_gradient_sync_fails_parity(suite):
    """DDP ranks that never all-reduce the adapters' gradients train different adapters: caught by the losses."""
    if suite.device_type == "cuda":
        pytest.skip("the CPU tier's bite test covers the check")
    cfg = suite.config("ddp", 2, **LORA)
    broken = suite.run_job(2, mutants.train, mutation="no_grad_sync", cfg=cfg)[0]
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(
            broken["losses"],
            suite.reference(cfg)["losses"],
            "ddp ws2 LoRA without gradient sync",
            against=SINGLE_PROCESS_REFERENCE,
        )


# --- recipes in combination --------------------------------------------------------------------------------


# Each combination's run: one job in every rank, or with `mutation` (tests/mutants.py) planted in it.


def _trained(suite, cfg, mutation: str | None = None) -> dict[str, Any]:
    kw = {"cfg": cfg, "return_params": True, "return_grads": True}
    if mutation:
        return suite.run_job(cfg.world_size, mutants.train, mutation=mutation, **kw)[0]
    return suite.train(**kw)[0]


def _trained_watching_steps(suite, cfg, mutation: str | None = None) -> dict[str, Any]:
    kw = {"cfg": cfg, "return_params": True}
    if mutation:
        return suite.run_job(cfg.world_size, mutants.train_watching_steps, mutation=mutation, **kw)[0]
    return suite.run_job(cfg.world_size, recipe_jobs.train_watching_steps, **kw)[0]


def _trained_through_an_overflow(suite, cfg, mutation: str | None = None) -> dict[str, Any]:
    kw = {"cfg": cfg, **_overflow_at(cfg)}
    if mutation:
        return suite.run_job(cfg.world_size, mutants.train_with_an_overflow, mutation=mutation, **kw)[0]
    return suite.run_job(cfg.world_size, recipe_jobs.train_with_an_overflow, **kw)[0]


def _trained_counting_recomputation(suite, cfg, mutation: str | None = None) -> dict[str, Any]:
    assert mutation is None, "no mutant of activation checkpointing with LoRA is planted here"
    if refuses_lora(cfg.strategy, cfg.world_size):  # refused clearly: test_lora_trains_the_adapters_alone_...
        pytest.skip(f"refused: {LORA_ONE_RANK_WHY}")
    job = recipe_jobs.train_counting_attention_forwards
    return suite.run_job(cfg.world_size, job, cfg=cfg, return_params=True, return_grads=True)[0]


def _trained_and_resumed(suite, cfg, mutation: str | None = None) -> dict[str, Any]:
    """The uninterrupted run (its checkpoint half-way) and, under "resumed", its resume (mutated, if asked)."""
    run = suite.checkpointed_run(cfg)
    kw = {"cfg": cfg, "resume_from": run["checkpoint"]}
    if mutation:
        return {**run, "resumed": suite.run_job(cfg.world_size, mutants.train, mutation=mutation, **kw)[0]}
    return {**run, "resumed": suite.train(**kw)[0]}


#: The pre-clip norm of a torch-native fp16 run against the reference's, relative: 2**-10, two units of fp16's
#: roundoff (2**-11). Each gradient element is a sum of products of fp16-rounded operands (accumulated in fp32).
#: At world size n > 1 the fp32 all-reduce sums the ranks' gradients in another order than the reference's one
#: process, so the weights differ by fp32 ulps after the first step, and from then on an operand's fp16 rounding
#: may land on the neighbouring fp16 value: at most one fp16 ulp (2 * 2**-11 relative) per operand. To first
#: order every product, and so every element and the norm, moves by at most that, whatever n is (the order
#: only decides which roundings flip). Measured: 1.3e-4 (DDP) and 1.4e-4 (FSDP1) on GPT-2 124M at world size 2 on H200s,
#: 1.3e-5 on gpt2-tiny on CPU. A norm taken before unscaling is the loss scale's multiple, 2**8 and more here:
#: off by 255 and more, where this allows 1e-3 (the negative control in _check_fp16_clip).
FP16_NORM_RTOL = 2.0**-10
#: DeepSpeed's fp16 norms against the reference's: its losses drift by fp16_ds_rtol and its norms may drift
#: further, so 16 times the loss drift is allowed, still below the 29% a norm of one of two shards is off by.
DS_FP16_NORM_DRIFT = 16


def _check_fp16_clip(suite, cfg, run: dict[str, Any]) -> None:
    """fp16 with clipping against the reference's rule: unscale, then clip by the global norm, then step or skip.
    The loss scales and skipped steps are the reference's exactly, the losses within fp16's tolerance, the
    pre-clip norm of every step taken is the norm of the unscaled gradient (a skipped step's is no number), and
    each step taken applied a gradient of the norm the clip sets. Under AdamW the losses alone barely move when
    the clip sees scaled gradients (measured: 3e-5 relative, inside fp16's tolerance), as Adam's update is nearly
    blind to a gradient's scale."""
    ref = _overflow_reference(suite, cfg)
    taken = [k for k, skipped in enumerate(ref["skipped_steps"]) if not skipped]
    want = [ref["grad_norms"][k] for k in taken]
    assert min(want) > 2 * CLIP, ref["grad_norms"]  # negative control: the clip bites at every step taken
    what = f"{cfg.strategy} ws{cfg.world_size} fp16 clipped at {CLIP}"
    assert run["matmul_dtypes"] == ["float16"], f"{what} multiplied in {run['matmul_dtypes']}"
    rtol = _fp16_rtol(cfg)
    assert_loss_scaling_matches(run, ref, rtol, what)
    deepspeed = get_spec(cfg.strategy).trainer_module == "deepspeed"
    norm_rtol = [DS_FP16_NORM_DRIFT * rtol[k] if deepspeed else FP16_NORM_RTOL for k in taken]
    for k, expected, rel in zip(taken, want, norm_rtol, strict=True):
        # negative control: the norm of the still-scaled gradient lies outside the bound
        assert ref["loss_scales"][k] * expected != pytest.approx(expected, rel=rel), (k, ref["loss_scales"])
        got = run["grad_norms"][k]
        assert got == pytest.approx(expected, rel=rel), (
            f"{what}: step {k}'s pre-clip norm {got!r}, the reference's (unscaled) {expected!r}; all "
            f"{run['grad_norms']} against {ref['grad_norms']}"
        )
    _assert_stepped_at_the_clip(run, want, what)


#: The norm of the gradient a clipped step applies, relative to the reference's: both are CLIP * n / (n + 1e-6),
#: within 1e-6 of CLIP whatever each one's n, summed in another order. Clipping a gradient still multiplied by
#: the loss scale applies 2**-8 of it and less; not clipping applies ten times it.
STEPPED_NORM_RTOL = 1e-4


def _assert_stepped_at_the_clip(run: dict[str, Any], norms: list[float], what: str) -> None:
    """Every optimizer step that ran applied a gradient of the norm the reference's clip gives the unscaled
    gradient of pre-clip norm `norms[i]`: seen from a torch optimizer step hook, not from what the trainer
    reports (its pre-clip norm can be right while the gradient it steps with is not)."""
    clipped = [CLIP * n / (n + 1e-6) for n in norms]
    # A fused AdamW (torch's choice on GPUs) is called on an overflowed fp16 step too and skips the update in
    # its own kernel (GradScaler hands it found_inf): on one H200 DDP's hook saw that call, with a nan norm.
    # DeepSpeed's fp16 wrapper (FP16_UnfusedOptimizer: zero0 in fp16, and in bf16 from DeepSpeed 0.17.6 on)
    # steps the optimizer once with zero gradients as it is built, to allocate its state: that call is no
    # training step (none has norm 0), and what it does to AdamW is docs/strategies.md's to say.
    stepped = [n for n in run["stepped_norms"] if math.isfinite(n) and n != 0.0]
    assert stepped == pytest.approx(clipped, rel=STEPPED_NORM_RTOL), (
        f"{what}: the optimizer's steps applied gradients of norm {run['stepped_norms']}, clipping the "
        f"reference's unscaled gradients gives {clipped}"
    )


#: The pre-clip norm of a bf16 run against the fp32 reference's, relative: two eps_bf16, as for the losses (a
#: norm, too, sums every gradient element, whose bf16 roundings average out rather than add). Measured on
#: gpt2-tiny at 2 ranks: at most 2.4e-4 (fsdp_full), 4.9e-4 (ddp), 7.4e-4 (zero2); a norm of one of two
#: shards is 29% off.
BF16_NORM_RTOL = BF16_LOSS_RTOL
#: DeepSpeed's bf16 runs the whole model in bf16 (its weights rounded, its gradients bf16 and reduced in bf16),
#: a different function from the fp32 reference's rather than a rounding of the same one: on one H200 (GPT-2
#: 124M, world size 1) zero2's pre-clip norms were 0.03-2.7% off the reference's, growing with the steps. A
#: norm of one of two shards is 29% off.
DS_BF16_NORM_RTOL = 0.05


def _check_bf16_clip(suite, cfg, run: dict[str, Any]) -> None:
    """bf16 with clipping against the fp32 reference at the same learning rate and clip: bf16's tolerances, and
    every step applied a gradient of the clip's norm. That last is what sees a clip that is not applied: at this
    learning rate AdamW's updates barely depend on the gradient's scale, well inside bf16's tolerances."""
    ref = _clip_reference(suite, cfg)
    what = f"{cfg.strategy} ws{cfg.world_size} bf16 clipped at {CLIP}"
    rel = DS_BF16_NORM_RTOL if get_spec(cfg.strategy).trainer_module == "deepspeed" else BF16_NORM_RTOL
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rel), (
        f"{what}: pre-clip norms {run['grad_norms']}, the fp32 reference's {ref['grad_norms']}"
    )
    assert_bf16_matches_fp32_reference(run, ref, suite.initial_weights(cfg), what)
    _assert_stepped_at_the_clip(run, ref["grad_norms"], what)


def _check_ac_lora(suite, cfg, run: dict[str, Any]) -> None:
    """Activation checkpointing of a LoRA model: every block recomputed in backward, and the LoRA run's losses,
    parameters and adapter gradients the hand-written LoRA reference's, its base weights untouched. The
    reference has no recomputation to do: it is the LoRA run's (shared with the LoRA tests)."""
    ref = suite.reference(cfg.replace(activation_checkpointing=False))
    what = f"{cfg.strategy} ws{cfg.world_size} LoRA rank {cfg.lora_rank} with activation checkpointing"
    micro_steps = cfg.accum_steps * cfg.steps
    assert run["attention_modules"] > 0 and min(run["attention_forwards"]) >= 2 * micro_steps, (
        f"{what}: attention ran forward {run['attention_forwards']} times in {micro_steps} micro-steps, "
        "so the blocks were not recomputed"
    )
    assert_losses_match(run["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
    assert_params_and_grads_match(run, ref, cfg.lr, what)
    assert_only_adapters_trained(run["params"], ref["initial"], what)


def _check_dropout_resume(suite, cfg, run: dict[str, Any]) -> None:
    """Dropout across a resume: the uninterrupted run at the reference's losses, parameters and gradients, and
    the resumed run bitwise the uninterrupted one, so it drew the masks the reference drew."""
    ref = _dropout_reference(suite, cfg)
    what = f"{cfg.strategy} ws{cfg.world_size} with dropout {DROPOUT}"
    assert_losses_match(run["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
    assert_params_and_grads_match(run, ref, cfg.lr, what)
    assert_resume_exact(run["resumed"], run["losses"], run["save_at"], f"{what}, resumed")


@dataclass(frozen=True)
class Combination:
    """Recipe options users run together: the RunConfig overrides, how a strategy's run of them is made and how it
    is held to the independent reference, the strategies that run them (None: all), which CPU cases the default
    tier runs (`fast`; the others run nightly) and which strategies the GPU tier runs."""

    options: dict[str, Any]
    train: Callable[[Any, RunConfig, str | None], dict[str, Any]]
    check: Callable[[Any, RunConfig, dict[str, Any]], None]
    fast: frozenset[tuple[str, int]]
    gpu: tuple[str, ...]
    strategies: tuple[str, ...] | None = None


LORA_STRATEGIES = ("single", "ddp", "fsdp_full", "fsdp_grad", "fsdp1_full", "fsdp1_grad", "zero2", "zero3")

#: Seed 000's ZeRO-3 configuration trains in bf16, accumulating 8 micro-batches, clipped at 0.3. Every combination
#: here accumulates too (the tier's global batch is at least two micro-batches a rank at every world size); those
#: with fp16 run where the strategy has fp16 and skip elsewhere with its reason.
COMBINATIONS: dict[str, Combination] = {
    "fp16+clip": Combination(
        {**FP16, "clip_grad_norm": CLIP},
        _trained_through_an_overflow,
        _check_fp16_clip,
        fast=frozenset({("ddp", 2), ("fsdp_full", 2)}),
        gpu=("ddp", "fsdp1_full", "zero2"),
    ),
    "bf16+clip": Combination(
        {**BF16, "clip_grad_norm": CLIP},
        _trained_watching_steps,
        _check_bf16_clip,
        fast=frozenset({("fsdp_full", 2), ("zero2", 2)}),
        gpu=("ddp", "fsdp_full", "zero2"),
    ),
    "accumulation+clip": Combination(
        {"clip_grad_norm": CLIP},
        _trained,
        _check_accumulated_clip,
        # one case per way of clipping: torch's over DDP's and FSDP2's gradients (fsdp_hybrid's mesh on one node
        # is fsdp_full's with a replicate dimension of 1), DeepSpeed's in stages 1-2, 3 and 3 offloaded to the
        # host's optimizer
        fast=frozenset((name, 2) for name in ("ddp", "fsdp_full", "zero2", "zero3", "zero3_offload")),
        gpu=tuple(REGISTRY),
    ),
    "activation-checkpointing+lora": Combination(
        {**LORA, "activation_checkpointing": True},
        _trained_counting_recomputation,
        _check_ac_lora,
        fast=frozenset({("fsdp_full", 2)}),
        gpu=("fsdp1_full",),
        strategies=LORA_STRATEGIES,
    ),
    "dropout+resume": Combination(
        {"dropout": DROPOUT},
        _trained_and_resumed,
        _check_dropout_resume,
        fast=frozenset({("ddp", 2), ("fsdp_full", 2), ("zero2", 2)}),
        gpu=("ddp",),
    ),
}


def _combination_cases() -> list:
    return [
        case
        for name, c in COMBINATIONS.items()
        for case in tier_cases.cases(
            c.strategies,
            fast=c.fast,
            gpu=c.gpu,
            precision=str(c.options.get("precision", "fp32")),
            prefix=(name,),
        )
    ]


@pytest.mark.parametrize("device_type,combination,strategy_name,ws", _combination_cases())
def test_recipes_in_combination_match_the_reference(suite, combination, strategy_name, ws):
    """Each combination users run, under each strategy that runs it, through the parity checks of its recipes
    against the reference, which implements the combination by its own hand-written rule."""
    c = COMBINATIONS[combination]
    cfg = suite.config(strategy_name, ws, **c.options)
    c.check(suite, cfg, c.train(suite, cfg, None))


def _mutated(suite, combination: str, strategy: str, ws: int, mutation: str) -> None:
    """The combination's check of its run with `mutation` planted (tests/mutants.py) must fail."""
    c = COMBINATIONS[combination]
    cfg = suite.config(strategy, ws, **c.options)
    broken = c.train(suite, cfg, mutation)
    with pytest.raises(AssertionError):
        c.check(suite, cfg, broken)


def _gpu_case(strategy: str, ws: int) -> Any:
    return pytest.param(
        "cuda", strategy, ws, id=f"{strategy}-ws{ws}-gpu", marks=[pytest.mark.gpu, pytest.mark.world_size(ws)]
    )


@pytest.mark.parametrize(
    "device_type,strategy_name,ws",
    [
        pytest.param("cpu", "ddp", 2, id="ddp-ws2"),  # torch's GradScaler and clip_grad_norm_
        pytest.param("cpu", "fsdp_full", 2, id="fsdp_full-ws2"),  # the same over DTensors
        _gpu_case("fsdp1_full", 1),  # FSDP1's ShardedGradScaler and its own clip_grad_norm_
    ],
)
def test_clipping_before_unscaling_fails_parity(suite, strategy_name, ws):
    """A trainer that clips the gradients while they are still multiplied by the loss scale, then unscales them
    (tests/mutants.py clip_before_unscale): its norm is the scale's multiple and its updates shrink with it."""
    _mutated(suite, "fp16+clip", strategy_name, ws, "clip_before_unscale")


@pytest.mark.parametrize(
    "strategy_name,mutation",
    [("fsdp_full", "clip_reports_only"), ("zero2", "ds_clipping_off")],
    ids=["fsdp_full-ws2-clip_reports_only", "zero2-ws2-ds_clipping_off"],
)
def test_a_clip_that_is_not_applied_fails(suite, strategy_name, mutation):
    """Under bf16 a clip that measures and reports the norm but leaves the gradients as they were (a trainer's,
    or DeepSpeed's gradient_clipping left at 0: mutants clip_reports_only, ds_clipping_off) moves nothing bf16's
    tolerances see; the norm of what the optimizer applied does."""
    _mutated(suite, "bf16+clip", strategy_name, 2, mutation)


def test_clipping_each_micro_batch_fails_parity(suite):
    """A trainer that clips after every micro-batch's backward instead of once per step (mutants
    clip_per_micro_batch): each micro-batch's share is clipped by itself, so the step's gradient is another."""
    _mutated(suite, "accumulation+clip", "ddp", 2, "clip_per_micro_batch")


def test_a_resume_that_restarts_the_dropout_streams_fails(suite):
    """A resume that restores the step but keys dropout by the steps its own process ran (mutants
    dropout_steps_since_resume): the resumed run draws step 0's masks again."""
    _mutated(suite, "dropout+resume", "ddp", 2, "dropout_steps_since_resume")
