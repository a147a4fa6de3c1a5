"""What a job running inside a rank knows about where it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is loaded by what builds a context; the CLI imports this module without it
    import torch


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl" or "gloo"
    nodes: int = 1  # nodes the job's ranks span (torchrun launches); HSDP replicates across them

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def device_type(self) -> str:
        return self.device.type

    def synchronize(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)
