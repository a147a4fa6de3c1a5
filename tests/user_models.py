"""Models as a user brings them: `--model user_models:tiny_lm`, a plain nn.Module that is not a transformers
model. Spawned ranks import this module by name from the pytest process's sys.path."""

from __future__ import annotations

import torch
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
