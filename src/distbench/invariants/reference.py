"""The independent single-process reference every strategy is compared against.

Deliberately shares nothing with the strategies or the Trainer: a hand-written loop over the global
batch with gradient accumulation, torch's AdamW and LR schedule configured from the same hyper-parameters,
fp16's loss scaling, clipping and LoRA written out by hand rather than taken from torch.amp, torch.nn.utils or
peft. Combined, they act in one order each step: unscale, then clip by the global norm of the whole step's
gradient, then step or skip. Only the inputs are shared: the model built from the seed, the samples of each
step, the model family's default LoRA targets, and under dropout the definition of each sample's random stream
(workloads/dropout.py), which the reference keys by the sample's place in the global batch itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..config import RunConfig
from ..workloads import get_model
from ..workloads.data import global_batch
from ..workloads.dropout import apply_dropout, sample_streams


def reference_run(cfg: RunConfig, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Per-step losses, final parameters and last-step gradients of plain gradient accumulation.

    Long: the reference is one loop written out in full, so it can be read against the strategies line by line.
    """
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
    if cfg.lora_rank:
        add_lora(model, cfg)
    initial = _named(model.state_dict(), cfg) if cfg.lora_rank else {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if cfg.algorithm == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            trainable, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=False
        )
    else:
        opt = torch.optim.AdamW(
            trainable,
            lr=cfg.lr,
            betas=(cfg.betas[0], cfg.betas[1]),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )
    sched = torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=0.25, end_factor=1.0, total_iters=max(1, cfg.lr_warmup_steps)
    )
    n_micro = cfg.global_batch // cfg.micro_batch
    fp16 = cfg.precision == "fp16"
    scaler = LossScale(2.0**cfg.loss_scale_power, cfg.loss_scale_window) if fp16 else None
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
        overflow = scaler is not None and scaler.unscale(
            [p.grad for p in model.parameters() if p.grad is not None]
        )
        if step == cfg.steps - 1:
            grads = _named({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, cfg)
        if (
            cfg.clip_grad_norm
        ):  # after unscaling, by the global norm of the step's whole gradient, once per step
            norms.append(clip_by_global_norm(model.parameters(), cfg.clip_grad_norm))
        if scaler is not None:
            scales.append(scaler.scale)
            skipped.append(overflow)
            scaler.update(overflow)
        if not overflow:  # an overflowed step changes neither the weights nor the LR schedule
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / n_micro)
    params = _named(model.state_dict(), cfg)
    out = {
        "losses": losses,
        "params": params,
        "grads": grads,
        "grad_norms": norms,
        "loss_scales": scales,
        "skipped_steps": skipped,
    }
    return {**out, "initial": initial, "merged": merged_state(model)} if cfg.lora_rank else out


def clip_by_global_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Scale every gradient by max_norm / (norm + 1e-6) where that is below 1, `norm` being the 2-norm of all the
    gradients together, and return that norm: clipping as torch's clip_grad_norm_ defines it, written out."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient)
    return float(norm)


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


LORA_ADAPTER = "default"  # peft's name for a model's first adapter, part of its parameters' names


class LoRA(nn.Module):
    """`base(x) + alpha / rank * B(A(x))`, LoRA as its paper writes it, with peft's attribute names (base_layer,
    lora_A.default, lora_B.default) so that its parameters compare with a PeftModel's name by name."""

    def __init__(self, base: nn.Module, cfg: RunConfig, gen: torch.Generator) -> None:
        super().__init__()
        if type(base).__name__ not in ("Linear", "Conv1D"):
            raise NotImplementedError(
                f"the reference writes LoRA out for linear layers only, not {type(base).__name__}"
            )
        w = cast(torch.Tensor, base.weight)
        # GPT-2's Conv1D holds its weight as (in, out), torch's Linear as (out, in)
        fan_in, fan_out = (
            (w.shape[0], w.shape[1]) if type(base).__name__ == "Conv1D" else (w.shape[1], w.shape[0])
        )
        a = nn.Linear(fan_in, cfg.lora_rank, bias=False, device=w.device)
        b = nn.Linear(cfg.lora_rank, fan_out, bias=False, device=w.device)
        with (
            torch.no_grad()
        ):  # the init that makes the run and the reference comparable: see strategies/lora.py
            bound = 1 / math.sqrt(fan_in)
            a.weight.copy_(torch.empty(a.weight.shape).uniform_(-bound, bound, generator=gen))
            b.weight.zero_()
        self.base_layer, self.scale = base, cfg.lora_alpha / cfg.lora_rank
        self.lora_A, self.lora_B = nn.ModuleDict({LORA_ADAPTER: a}), nn.ModuleDict({LORA_ADAPTER: b})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scale * self.lora_B[LORA_ADAPTER](self.lora_A[LORA_ADAPTER](x))

    def delta(self) -> torch.Tensor:
        """What merging adds to the base weight: alpha / rank * B A, in the base layer's layout."""
        b, a = (cast(nn.Linear, m[LORA_ADAPTER]).weight for m in (self.lora_B, self.lora_A))
        d = self.scale * (b @ a)  # (out, in)
        return d.T if type(self.base_layer).__name__ == "Conv1D" else d


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights with every LoRA folded into its base layer, under the plain model's names: what a
    merged export must hold."""
    out = {
        k.replace(".base_layer.", "."): v
        for k, v in model.state_dict().items()
        if ".lora_A." not in k and ".lora_B." not in k
    }
    for name, m in model.named_modules():
        if isinstance(m, LoRA):
            out[f"{name}.weight"] = out[f"{name}.weight"] + m.delta()
    return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def add_lora(model: nn.Module, cfg: RunConfig) -> None:
    """Freeze `model` and put a LoRA around every target module (a name or a dotted suffix of one, as peft
    matches a list), drawing the adapters in model order from a generator seeded with cfg.seed."""
    targets = get_model(cfg.model).lora_targets(cfg.lora_targets)
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    chosen = [n for n, _ in model.named_modules() if any(n == t or n.endswith("." + t) for t in targets)]
    for name in chosen:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, child, LoRA(getattr(holder, child), cfg, gen))


def _named(tensors: dict[str, torch.Tensor], cfg: RunConfig) -> dict[str, torch.Tensor]:
    """CPU fp32 copies, keyed as the trained model keys them: a PeftModel's names start with base_model.model."""
    prefix = "base_model.model." if cfg.lora_rank else ""
    return {prefix + k: v.detach().float().cpu().clone() for k, v in tensors.items()}
