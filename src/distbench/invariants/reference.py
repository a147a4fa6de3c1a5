"""The independent single-process reference every strategy is compared against.

Deliberately shares nothing with the strategies or the Trainer: a hand-written loop over the global
batch with gradient accumulation, torch's AdamW and LR schedule configured from the same hyper-parameters.
Only the inputs are shared: the model built from the seed, the samples of each step, and under dropout the
definition of each sample's random stream (workloads/dropout.py), which the reference keys by the sample's place
in the global batch itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config import RunConfig
from ..runtime.context import RankContext
from ..workloads import get_model
from ..workloads.data import global_batch
from ..workloads.dropout import apply_dropout, sample_streams


def reference_run(cfg: RunConfig, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Per-step losses, final parameters and last-step gradients of plain gradient accumulation."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.enable_flash_sdp(False)  # these attention backwards are not deterministic
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    spec = get_model(cfg.model)
    seq_len = cfg.seq_len or spec.seq_len
    model = spec.build(cfg.seed, device)
    if cfg.dropout:
        apply_dropout(model, cfg.dropout)
    if cfg.algorithm == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                                     weight_decay=cfg.weight_decay, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, end_factor=1.0,
                                              total_iters=max(1, cfg.lr_warmup_steps))
    n_micro = cfg.global_batch // cfg.micro_batch
    fp16 = cfg.precision == "fp16"
    scaler = LossScale(2.0 ** cfg.loss_scale_power, cfg.loss_scale_window) if fp16 else None
    losses, grads, norms, scales, skipped = [], {}, [], [], []
    for step in range(cfg.steps):
        tokens = global_batch(cfg, step, seq_len, spec.vocab_size).to(device)
        total = 0.0
        for k, chunk in enumerate(tokens.split(cfg.micro_batch)):
            first = k * cfg.micro_batch  # sample i of the step sees dropout stream i, whoever runs it
            with sample_streams(cfg.seed, step, range(first, first + len(chunk))):
                with torch.autocast(torch.device(device).type, dtype=torch.float16, enabled=fp16):
                    out = model(input_ids=chunk[:, :-1])
                logits = out.logits if hasattr(out, "logits") else out
                loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
                scaled = loss / n_micro
                (scaled * scaler.scale if scaler is not None else scaled).backward()
            total += loss.item()
        overflow = scaler is not None and scaler.unscale([p.grad for p in model.parameters() if p.grad is not None])
        if step == cfg.steps - 1:
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
        if cfg.clip_grad_norm:  # by the global norm of the whole model's gradients, reported before clipping
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)))
        if scaler is not None:
            scales.append(scaler.scale)
            skipped.append(overflow)
            scaler.update(overflow)
        if not overflow:  # an overflowed step changes neither the weights nor the LR schedule
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / n_micro)
    params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "grads": grads, "grad_norms": norms, "loss_scales": scales,
            "skipped_steps": skipped}


@dataclass
class LossScale:
    """fp16's dynamic loss scale, written out rather than taken from torch.amp.GradScaler: the loss is multiplied
    by `scale` before backward; a step whose unscaled gradients hold an inf or a NaN is skipped and halves the
    scale; `window` overflow-free steps in a row double it."""

    scale: float
    window: int
    clean: int = 0

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide the gradients by the scale (exact: it is a power of two); True when any is not finite."""
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        for g in grads:
            g.div_(self.scale)
        return overflow

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean = self.scale / 2, 0
        else:
            self.clean += 1
            if self.clean == self.window:
                self.scale, self.clean = self.scale * 2, 0


def reference_job(ctx: RankContext, cfg: dict[str, Any], with_tensors: bool = False) -> dict[str, Any]:
    """Pool job wrapper (world size 1) so the reference runs on the same device type as the strategies."""
    t0 = time.perf_counter()
    out = reference_run(ctx.config(cfg), ctx.device)
    out = out if with_tensors else {k: out[k] for k in ("losses", "grad_norms", "loss_scales", "skipped_steps")}
    return {**out, "phases": {"reference run": time.perf_counter() - t0}}
