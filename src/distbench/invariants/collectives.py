"""Count the collectives a training step issues, from the profiler's record of c10d dispatcher ops.

Every collective a process group runs (DDP's bucketed all-reduce, FSDP's all-gather and reduce-scatter)
passes through a c10d dispatcher op that torch.profiler records by name, whatever the backend (gloo or
NCCL). Counting those is exact and independent of timing.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

#: c10d op name -> collective kind
C10D_OPS = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::broadcast_": "broadcast",
}


def collectives_per_step(events: Iterable[Any], steps: int, world_size: int) -> dict[str, float]:
    """Collectives per optimizer step, by kind, from the profiler events of `steps` steps.

    The harness's own loss all-reduce (one per step at world size > 1) is subtracted so the counts are
    the strategy's gradient and parameter traffic alone.
    """
    counts: collections.Counter[str] = collections.Counter()
    for e in events:
        kind = C10D_OPS.get(e.name)
        if kind:
            counts[kind] += 1
    if world_size > 1:
        counts["all_reduce"] -= steps  # Trainer.step's loss all-reduce (base.global_mean)
    return {k: v / steps for k, v in counts.items()}
