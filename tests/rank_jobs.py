"""Jobs for the rank pool's own tests: they misbehave in chosen ranks the way real jobs do.

Spawned ranks import this module by name from the pytest process's sys.path.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist


def whoami(ctx: Any) -> dict[str, Any]:
    return {"rank": ctx.rank, "world_size": ctx.world_size, "pid": os.getpid(), "backend": ctx.backend}


def raise_in(ctx: Any, rank: int) -> None:
    if ctx.rank == rank:
        raise ValueError(f"planted failure in rank {ctx.rank}")
    dist.barrier()  # the healthy ranks wait in a collective, as they would in a real job


def hang_in(ctx: Any, rank: int) -> None:
    if ctx.rank == rank:
        planted_hang()
    dist.barrier()


def planted_hang() -> None:
    while True:
        time.sleep(0.1)


def crash_in(ctx: Any, rank: int) -> None:
    if ctx.rank == rank:
        os._exit(17)
    dist.barrier()
