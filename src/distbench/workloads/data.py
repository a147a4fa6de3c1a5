"""World-size-invariant synthetic data.

Sample `i` of step `s` is a pure function of (seed, s, i). Ranks and micro-batches only partition the
global batch: rank r owns samples [r*B/W, (r+1)*B/W) and splits them into micro-batches in order. So one
process accumulating over the global batch, DDP on 2 and FSDP on 4 see the same samples at every step.
"""

from __future__ import annotations

import torch

from ..config import RunConfig

Batch = dict[str, torch.Tensor]

#: Token ids the synthetic data draws from (all of them for vocabularies this small or smaller).
ACTIVE_VOCAB = 512


def sample_tokens(seed: int, step: int, index: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """seq_len + 1 tokens for one sample; inputs are [:-1], labels [1:]."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + index)
    # A repeating motif plus noise over the first ACTIVE_VOCAB token ids: learnable enough that the loss falls
    # visibly within a few steps. Over GPT-2's full 50257 ids, GPT-2 124M's loss stayed at ln(50257) for the
    # first 5 steps; with few ids in use it drops at once by learning which ids occur.
    active = min(vocab_size, ACTIVE_VOCAB)
    period = 1 + (index % 7)
    base = torch.randint(active, (period,), generator=g)
    tokens = base.repeat(seq_len // period + 2)[: seq_len + 1]
    noise = torch.rand(seq_len + 1, generator=g) < 0.25
    tokens[noise] = torch.randint(active, (int(noise.sum()),), generator=g)
    return tokens


def global_batch(cfg: RunConfig, step: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """All `cfg.global_batch` samples of `step` as a [B, seq_len + 1] tensor (for references and checks)."""
    return torch.stack(
        [sample_tokens(cfg.seed, step, i, seq_len, vocab_size) for i in range(cfg.global_batch)]
    )


def rank_micro_batches(
    cfg: RunConfig, step: int, rank: int, seq_len: int, vocab_size: int, device: torch.device | str = "cpu"
) -> list[Batch]:
    """This rank's micro-batches for `step`, in accumulation order, on `device`. Each names its samples'
    global indices in `sample_index` (on the host): their dropout streams (workloads/dropout.py)."""
    per_rank = cfg.per_rank_batch
    first = rank * per_rank
    out = []
    for m in range(cfg.accum_steps):
        lo = first + m * cfg.micro_batch
        toks = torch.stack(
            [sample_tokens(cfg.seed, step, i, seq_len, vocab_size) for i in range(lo, lo + cfg.micro_batch)]
        ).to(device, non_blocking=True)
        out.append(
            {
                "input_ids": toks[:, :-1],
                "labels": toks[:, 1:],
                "sample_index": torch.arange(lo, lo + cfg.micro_batch),
            }
        )
    return out
