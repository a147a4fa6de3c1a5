"""Dropout whose randomness belongs to the sample, not to whoever computes it.

A strategy may run a sample on any rank, in any micro-batch, run its forward again in backward (activation
checkpointing), or after a resume; torch's global RNG is in a different state each time, so masks drawn from it
cannot be compared with a reference. SampleDropout draws each sample's mask from a generator of its own, seeded
by (seed, step, global sample index, module index): one process accumulating, DDP on 2 and FSDP on 4 drop the
same units of the same sample, and a recomputation draws the mask its forward drew. Whoever runs the model (the
Trainer, the reference) names the samples of a micro-batch with `sample_streams` around its forward AND
backward; a SampleDropout outside one raises instead of falling back to the global RNG.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class Streams:
    """The samples a forward is running: their global indices within step `step` of a run seeded `seed`."""

    seed: int
    step: int
    indices: tuple[int, ...]


# Process-wide, not a contextvar or thread-local: on CUDA, backward (and so checkpoint's recomputation) runs on
# the autograd engine's device thread, which would see neither. A rank trains one micro-batch at a time.
_active: Streams | None = None


@contextlib.contextmanager
def sample_streams(seed: int, step: int, indices: Iterable[int]) -> Iterator[None]:
    """Name the samples of the micro-batch whose forward and backward run inside (row i is sample indices[i])."""
    global _active
    previous, _active = _active, Streams(seed, step, tuple(int(i) for i in indices))
    try:
        yield
    finally:
        _active = previous


def stream_seed(seed: int, step: int, index: int, module: int) -> int:
    """The generator seed of one sample's mask in one dropout module: a digest, so no two tuples share a seed."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}/{module}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


class SampleDropout(nn.Module):
    """nn.Dropout with each sample's mask from its own stream (see the module's docstring).

    Its `p` reads 0 and the rate is `rate`: code that hands a dropout module's rate to a fused kernel instead of
    calling it (GPT-2's SDPA attention passes `attn_dropout.p`) would draw that dropout from the global RNG,
    which no per-sample stream governs, so such dropout stays off.
    """

    p = 0.0

    def __init__(self, rate: float, index: int) -> None:
        super().__init__()
        self.rate = rate
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        streams = _active
        if streams is None:
            raise RuntimeError(
                "SampleDropout ran outside sample_streams(): the code running the model must name "
                "the samples of each micro-batch, for forward and backward"
            )
        if x.size(0) != len(streams.indices):
            raise RuntimeError(
                f"SampleDropout got a batch of {x.size(0)} rows for {len(streams.indices)} named "
                "samples: dropout must see the micro-batch's samples along dim 0"
            )
        keep = torch.stack([self.keep_mask(streams, i, x) for i in streams.indices])
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.rate))

    def keep_mask(self, streams: Streams, index: int, x: torch.Tensor) -> torch.Tensor:
        """Which units of sample `index` survive: True with probability 1 - rate, from that sample's stream."""
        g = torch.Generator(device=x.device)
        g.manual_seed(stream_seed(streams.seed, streams.step, index, self.index))
        return torch.rand(x.shape[1:], generator=g, device=x.device) >= self.rate

    def extra_repr(self) -> str:
        return f"rate={self.rate}, index={self.index}"


def apply_dropout(model: nn.Module, rate: float) -> int:
    """Replace every nn.Dropout in `model` by a SampleDropout of `rate`, numbered in module order (the same on
    every rank: all build the same model); returns how many. Before any wrapper, as activation checkpointing."""
    slots = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Dropout)
    ]
    if not slots:
        raise ConfigError(
            f"dropout needs nn.Dropout modules to replace; {type(model).__name__} has none (Llama's "
            "only dropout is attention's, drawn inside SDPA from the global RNG): drop the option"
        )
    for index, (parent, name) in enumerate(slots):
        setattr(parent, name, SampleDropout(rate, index))
    return len(slots)
