"""Models as a user brings them: `--model user_models:tiny_lm`, a plain nn.Module that is not a transformers
model. Spawned ranks import this module by name from the pytest process's sys.path."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, and an untied head: enough to have blocks to shard."""

    vocab_size = VOCAB
    seq_len = 16

    def __init__(self, width: int = 32, out_vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
            )
            for _ in range(2)
        )
        self.head = nn.Linear(width, out_vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def tiny_lm() -> nn.Module:
    return TinyLM()


class GlobalRngLM(nn.Module):
    """A model whose training draws from every global generator the ways users' code does: Python's `random`
    and numpy's pick the replacement tokens and their positions of a token-noise augmentation, torch's host
    generator a per-sample embedding scale, and on the model's device random token masking (torch.rand,
    torch.randint), nn.Dropout and SDPA's own dropout. In eval mode it draws nothing."""

    vocab_size = VOCAB
    seq_len = 16
    rate = 0.1

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, width)
        self.drop = nn.Dropout(self.rate)
        self.blocks = nn.ModuleList(_AttentionBlock(width, heads, self.rate) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            input_ids = self.augment(input_ids)
        h = self.embed(input_ids)
        if self.training:
            scale = 1.0 + 0.1 * torch.rand(h.size(0), 1, 1)  # torch's host generator
            h = self.drop(h * scale.to(h.device))
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def augment(self, ids: torch.Tensor) -> torch.Tensor:
        """Token noise (numpy's positions, Python's replacement per sample), then masking drawn on the device."""
        noisy = torch.from_numpy(np.random.random_sample(tuple(ids.shape)) < 2 * self.rate).to(ids.device)
        swap = torch.tensor([random.randrange(VOCAB) for _ in range(ids.size(0))], device=ids.device)
        ids = torch.where(noisy, swap[:, None].expand_as(ids), ids)
        masked = torch.rand(ids.shape, device=ids.device) < self.rate
        return torch.where(masked, torch.randint(VOCAB, ids.shape, device=ids.device), ids)


class _AttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, rate: float) -> None:
        super().__init__()
        self.heads, self.rate = heads, rate
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.LayerNorm(width),
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Dropout(rate),
            nn.Linear(2 * width, width),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = (x.view(b, t, self.heads, -1).transpose(1, 2) for x in self.qkv(self.norm(h)).chunk(3, -1))
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.rate if self.training else 0.0
        )
        h = h + self.out(a.transpose(1, 2).reshape(b, t, w))
        return h + self.mlp(h)


def global_rng_lm() -> nn.Module:
    """GlobalRngLM, with every global generator then seeded by rank as timm's training script seeds them
    (`random_seed(seed, rank)`): the weights are the same on every rank (built from the harness's seed), the
    random streams differ, so a resume that gives every rank rank 0's streams draws what no rank drew.
    Seeds only inside a rank: the harness probes the factory in its own process too."""
    model = GlobalRngLM()
    if torch.distributed.is_initialized():
        seed = torch.initial_seed() + 1000 * int(os.environ["RANK"]) + 1
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
    return model


def numpy_initialised_lm() -> nn.Module:
    """TinyLM whose embedding starts from numpy's global generator and whose head bias from Python's `random`,
    as a factory porting another framework's initialisation might: the same seed must build the same model."""
    model = TinyLM()
    with torch.no_grad():
        model.embed.weight.copy_(torch.from_numpy(0.02 * np.random.standard_normal(model.embed.weight.shape)))
        model.head.bias.copy_(torch.tensor([random.gauss(0.0, 0.02) for _ in range(VOCAB)]))
    return model


def wrong_vocab_lm() -> nn.Module:
    """Claims a 256-token vocabulary but predicts 8 tokens: its loss fails inside the ranks."""
    return TinyLM(out_vocab=8)


def announced_lm() -> nn.Module:
    """tiny_lm that, built in a rank, creates the file named by $BUILT_MARKER: a test outside can tell when
    the ranks have joined and start to train."""
    import os
    from pathlib import Path

    if "RANK" in os.environ and os.environ.get("BUILT_MARKER"):
        Path(os.environ["BUILT_MARKER"]).touch()
    return TinyLM()


class _OutOfMemoryLM(TinyLM):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (planted)")


def oom_lm() -> nn.Module:
    """Runs out of device memory in its first forward, as a too-large configuration does on a GPU."""
    return _OutOfMemoryLM()


class MatmulStackLM(nn.Module):
    """An embedding lookup, then bias-free square Linear layers and a bias-free head: every FLOP the MFU
    formula counts (6 per matmul weight per token) is a plain matrix multiply, so a bf16 matmul benchmark of
    the same shapes is the model's compute without the harness."""

    def __init__(self, width: int, layers: int, vocab: int, seq_len: int) -> None:
        super().__init__()
        self.vocab_size, self.seq_len = vocab, seq_len
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:  # no activation function: nothing but matmuls, on randn-like data
            h = layer(h)
        return self.head(h)


def matmul_stack() -> nn.Module:
    """GPU size: 4 layers 4096 wide, a 4096-token vocabulary, sequence 1024 (84M matmul weights, 101M parameters)."""
    return MatmulStackLM(width=4096, layers=4, vocab=4096, seq_len=1024)
