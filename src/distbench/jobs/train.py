"""The train job: the harness's training loop in every rank, and the pieces other jobs build on (numerics,
a trainer from a configuration, steps from a given one)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import LocalPath, RunConfig
from ..runtime.context import RankContext
from ..runtime.phases import PhaseClock
from ..runtime.shelf import save_tensors
from ..strategies import build_trainer
from ..strategies.base import Trainer
from ..workloads import get_model
from ..workloads.data import rank_micro_batches


def set_numerics(cfg: RunConfig) -> None:
    """Parity runs: fp32 without TF32 and deterministic kernels. Performance runs: as users run them."""
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)
    tf32 = not cfg.deterministic
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.deterministic = cfg.deterministic
    torch.backends.cudnn.benchmark = not cfg.deterministic
    # SDPA's flash, memory-efficient and cuDNN backwards accumulate with atomics and only warn under
    # warn_only determinism: on 4 H200s a DDP resume differed from the uninterrupted run by 2e-7 at its
    # second step. Parity runs take the math kernel; performance runs keep the fast ones.
    fast = not cfg.deterministic
    torch.backends.cuda.enable_flash_sdp(fast)
    torch.backends.cuda.enable_mem_efficient_sdp(fast)
    torch.backends.cuda.enable_cudnn_sdp(fast)


def make_trainer(ctx: RankContext, cfg: RunConfig) -> Trainer:
    """Build the model from the config's seed on this rank's device and wrap it with the strategy."""
    set_numerics(cfg)
    spec = get_model(cfg.model)
    model = spec.build(cfg.seed, ctx.device)
    return build_trainer(ctx, cfg, model)


def seq_len_of(cfg: RunConfig) -> int:
    return cfg.seq_len or get_model(cfg.model).seq_len


def run_steps(
    ctx: RankContext, trainer: Trainer, cfg: RunConfig, until: int, capture_last_grads: bool = False
) -> list[float]:
    """Train from trainer.steps_done up to step `until`; the data of step s is a pure function of s."""
    spec = get_model(cfg.model)
    seq_len = seq_len_of(cfg)
    losses = []
    while trainer.steps_done < until:
        mbs = rank_micro_batches(cfg, trainer.steps_done, ctx.rank, seq_len, spec.vocab_size, ctx.device)
        last = trainer.steps_done == until - 1
        losses.append(trainer.step(mbs, capture_grads=capture_last_grads and last))
    return losses


def train(
    ctx: RankContext,
    cfg: RunConfig,
    *,
    save_at: int | None = None,
    checkpoint_dir: LocalPath | None = None,
    resume_from: LocalPath | None = None,
    reshard: bool = False,
    return_params: bool = False,
    return_grads: bool = False,
    keep_tensors_at: LocalPath | None = None,
) -> dict[str, Any]:
    """Train cfg.steps optimizer steps and return the per-step global-batch losses.

    save_at + checkpoint_dir: save a checkpoint after step `save_at` (training continues).
    resume_from: load that checkpoint first and continue from its step; `reshard` allows another world size.
    return_params: also return the gathered full parameters after the last step (CPU fp32).
    return_grads: also return the full gradients of the last step, taken before its optimizer step.
    keep_tensors_at: rank 0 writes those parameters and gradients to this safetensors file (runtime/shelf.py)
    instead of returning them through its pipe.
    """
    clock = PhaseClock()
    with clock("build and wrap"):
        trainer = make_trainer(ctx, cfg)
    try:
        start = 0
        if resume_from:
            with clock("checkpoint load"):
                trainer.load_checkpoint(resume_from, reshard=reshard)
            start = trainer.steps_done
        losses: list[float] = []
        if save_at is not None and start < save_at:
            with clock("training steps"):
                losses += run_steps(ctx, trainer, cfg, save_at)
            with clock("checkpoint save"):
                trainer.save_checkpoint(checkpoint_dir or "")
        with clock("training steps"):
            losses += run_steps(ctx, trainer, cfg, cfg.steps, capture_last_grads=return_grads)
        out: dict[str, Any] = {
            "rank": ctx.rank,
            "start_step": start,
            "losses": losses,
            "grad_norms": [float(n) for n in trainer.grad_norms],
            "loss_scales": trainer.loss_scales,
            "skipped_steps": trainer.skipped_steps,
        }
        with clock("gather full state"):
            tensors: dict[str, dict[str, torch.Tensor]] = {}
            if return_params:
                params = trainer.full_state_dict()  # collective: every rank gathers, rank 0 returns
                if ctx.rank == 0:
                    tensors["params"] = params
            if return_grads and ctx.rank == 0:
                tensors["grads"] = trainer.last_grads
            if keep_tensors_at and tensors:
                save_tensors(keep_tensors_at, tensors)
            else:
                out.update(tensors)
    finally:
        with clock("teardown"):
            trainer.close()
    out["phases"] = clock.seconds
    return out
