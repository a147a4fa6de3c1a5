"""What a job running inside a rank knows about where it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is loaded by what builds a context; the CLI imports this module without it
    import torch


def collective_backend(device_type: str) -> str:
    """The backend that carries a rank's device tensors: what results and reports call the run's backend."""
    return "nccl" if device_type == "cuda" else "gloo"


def process_group_backend(device_type: str) -> str:
    """The backends a rank's process group is built with. On GPUs NCCL for device tensors and gloo beside it
    for host tensors, as torch's own distributed tests build theirs: FSDP2 with CPU offload keeps gradients on
    the host, and clipping them by their global norm all-reduces host DTensors over the model's mesh, which a
    group of NCCL alone refuses ("No backend type associated with device type cpu")."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # the device's collectives: "nccl" or "gloo" (process_group_backend: what the group has)
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
