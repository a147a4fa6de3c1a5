"""Models whose out-of-memory edge is known: a forward given more samples per rank than `LIMIT` raises
torch's OutOfMemoryError, as a GPU would, so `distbench recommend` has a real edge to find on CPU."""

from __future__ import annotations

import torch
from torch import nn

from user_models import TinyLM

LIMIT = 3


class _Bounded(TinyLM):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > LIMIT:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {input_ids.shape[0]} samples "
                f"(planted: at most {LIMIT} fit)"
            )
        return super().forward(input_ids)


def oom_above_3() -> nn.Module:
    """TinyLM that runs out of memory at micro-batch 4 and above."""
    return _Bounded()
