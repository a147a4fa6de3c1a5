"""What a job running inside a rank knows about where it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import RunConfig
from ..errors import ConfigError

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

    def config(self, cfg: dict[str, Any]) -> RunConfig:
        """The configuration a job was sent, checked against the pool it landed in: a configuration for 4
        ranks run by a pool of 2 would train on half of each global batch and report it as the whole."""
        rc = RunConfig.from_dict(cfg)
        if rc.world_size != self.world_size:
            raise ConfigError(f"a configuration for world size {rc.world_size} was sent to a pool of "
                              f"{self.world_size} rank(s); run it in the pool of its own world size")
        return rc

    def synchronize(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)
