"""Rank jobs for the recipe tests: the train job, watched from outside the code under test.

The rank processes import this module by name (pytest puts this directory on the spawned ranks' sys.path)."""

from __future__ import annotations

from typing import Any

import torch

import distbench.runtime.jobs as jobs

#: The LoRA the tests train: rank 4 on the family's default targets, alpha 8 (scale 2, not 1, so a scale
#: applied twice or not at all shows), 4 steps (the CPU tier's time): the half-way checkpoint, after step 2,
#: holds optimizer state for B and A alike (A's first gradient comes at step 2, B starting at zero).
LORA: dict[str, Any] = {"lora_rank": 4, "lora_alpha": 8, "steps": 4}


def train_counting_attention_forwards(ctx: Any, **kwargs: Any) -> dict[str, Any]:
    """jobs.train, plus how often each attention module ran forward (a global forward hook, so no trainer code
    is involved): once per micro-batch, and again in backward where activation checkpointing recomputes the
    block (torch's non-reentrant checkpoint stops recomputing once it has what backward needs, so the
    attention, early in the block, is the module that always runs again)."""
    calls: dict[int, int] = {}

    def count(module: torch.nn.Module, args: Any, out: Any) -> None:
        if type(module).__name__.endswith("Attention"):
            calls[id(module)] = calls.get(id(module), 0) + 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        out = jobs.train(ctx, **kwargs)
    finally:
        handle.remove()
    return {**out, "attention_modules": len(calls), "attention_forwards": sorted(set(calls.values()))}
