"""LoRA fine-tuning through peft, applied to the bare model before any strategy wraps it.

Users fine-tune with peft's get_peft_model and hand the PeftModel to DDP, FSDP or DeepSpeed as they would the
model itself: the base weights are frozen (requires_grad False) and only the adapters train, so every
strategy meets frozen and trainable parameters side by side in one module (one FSDP unit, one ZeRO group).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from ..config import RunConfig
from ..errors import ConfigError, did_you_mean
from ..workloads import get_model

ADAPTER = "default"  # peft's name for a model's first adapter, part of every adapter parameter's name


def apply_lora(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """`model` as a peft LoRA model with cfg's rank, alpha and targets, and its adapters initialized from the
    seed (see init_adapters). No dropout: losses stay a deterministic function of weights and data."""
    from peft import LoraConfig, get_peft_model

    spec = get_model(cfg.model)
    targets = spec.lora_targets(cfg.lora_targets)
    names = [n for n, _ in model.named_modules()]
    for t in targets:  # peft refuses only targets that all miss; one typo among several would go unnoticed
        if not any(n == t or n.endswith("." + t) for n in names):
            leaves = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if hasattr(m, "weight")})
            raise ConfigError(
                f"model {cfg.model} has no module {t!r} for LoRA to adapt.{did_you_mean(t, leaves)} "
                f"Modules with weights: {', '.join(leaves)} (lora_targets, --lora-targets)"
            )
    config = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=spec.family == "gpt2",
    )  # GPT-2's Conv1D
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft's refusals, e.g. a target that is not a linear layer
        raise ConfigError(
            f"LoRA targets {list(targets)} do not fit model {cfg.model}: {e} (lora_targets, --lora-targets)"
        ) from None
    init_adapters(peft_model, cfg.seed)
    return peft_model


def check_lora(cfg: RunConfig) -> None:
    """Apply cfg's LoRA to its model built on the meta device (no memory, no init), so that targets the model
    does not have are refused before any rank starts."""
    apply_lora(get_model(cfg.model).build(cfg.seed, "meta"), cfg)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Each adapter's A drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (peft's default distribution) by a
    generator seeded with `seed`, module after module in model order, and its B zero (so training starts at
    the base model). A pure function of the seed, not of how much of the global RNG peft consumed: the
    independent reference draws the same adapters without peft."""
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            a = cast(torch.Tensor, module.lora_A[ADAPTER].weight)
            bound = 1 / math.sqrt(a.shape[1])
            a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=gen))
            cast(torch.Tensor, module.lora_B[ADAPTER].weight).zero_()
