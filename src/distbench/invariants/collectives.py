"""The collectives a training step issues, counted from the profiler and recorded from the dispatcher.

Every collective a process group runs (DDP's bucketed all-reduce, FSDP's all-gather and reduce-scatter,
DeepSpeed's reductions) passes through a c10d dispatcher op, whatever the backend (gloo or NCCL) and whoever
calls it (Python, DDP's C++ reducer, an autograd thread). torch.profiler records those ops by name: counting
them is exact and independent of timing. Their tensors' dtypes and sizes it does not give for list arguments
(allreduce_ takes a Tensor[]: record_shapes reads "TensorList"), so `CollectiveRecorder`, a dispatch mode,
reads them from the op's own arguments. A dispatch mode sees an op only on threads that inherit it (the
autograd engine's threads do, with the rest of the caller's thread-local state); `record_collectives` in
jobs/checks.py holds its record against the profiler's count, so a collective it misses fails the check
instead of passing unseen.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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
    "c10d::reduce_": "reduce",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::alltoall_": "all_to_all",
}

#: torch's functional collectives (DTensor's redistributions, e.g. the GradScaler's overflow flag max-reduced
#: over an FSDP2 mesh) -> kind. Each runs one c10d op of that kind inside it, which the profiler sees and a
#: dispatch mode does not (it is inside the mode's own call).
FUNCTIONAL_OPS = {
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_reduce_coalesced": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::all_gather_into_tensor_coalesced": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_c10d_functional::all_to_all_single": "all_to_all",
}

#: Which of a c10d op's tensor arguments hold the unsharded data, whose size is what one rank's share of the
#: wire adds up to: an all-gather's outputs and a reduce-scatter's inputs (the whole buffer, not this rank's
#: shard); every other collective moves the tensors it is given.
_WHOLE_SIDE = {"all_gather": "output", "reduce_scatter": "input"}


def op_names(prof: Any) -> list[str]:
    """The name of every op a torch.profiler.profile recorded, from its raw events: `prof.events()` builds a
    Python object per event, 1-3 s for two steps of the CPU tier's model, most of a test that counts collectives."""
    return [e.name() for e in prof.profiler.kineto_results.events()]


def collectives_per_step(names: Iterable[str], steps: int, world_size: int) -> dict[str, float]:
    """Collectives per optimizer step, by kind, from the names of the profiler's ops over `steps` steps
    (op_names).

    The harness's own loss all-reduce (one per step at world size > 1) is subtracted so the counts are
    the strategy's gradient and parameter traffic alone.
    """
    counts: collections.Counter[str] = collections.Counter()
    for name in names:
        kind = C10D_OPS.get(name)
        if kind:
            counts[kind] += 1
    if world_size > 1:
        counts["all_reduce"] -= steps  # Trainer.step's loss all-reduce (base.global_mean)
    return {k: v / steps for k, v in counts.items()}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def describe(op: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """One collective as plain data: {"op", "kind", "dtype", "elements", "bytes", "group_size"}; None for a
    functional op that is not a collective (wait_tensor).

    `arguments` maps the op schema's argument names to the values it was called with. `elements` counts the
    unsharded side (see _WHOLE_SIDE; a functional all-gather's inputs times the group); `dtype` is torch's name
    for the dtype of those tensors ("float32"), or "mixed:..." when they differ; `group_size` is the process
    group's size (0 where the op names none).
    """
    functional = op.startswith("_c10d_functional::")
    kind = FUNCTIONAL_OPS.get(op) if functional else C10D_OPS.get(op, op)
    if kind is None:
        return None
    if functional:
        name = arguments.get("group_name")
        group = dist.distributed_c10d._resolve_process_group(name) if name is not None else None
        tensors = _tensors(arguments.get("input", arguments.get("inputs")))
    else:
        boxed = arguments.get("process_group")
        group = dist.ProcessGroup.unbox(boxed) if boxed is not None else None
        side = _WHOLE_SIDE.get(kind)
        tensors = [t for n, v in arguments.items() if side is None or n.startswith(side) for t in _tensors(v)]
    size = group.size() if group is not None else 0
    times = size if functional and kind == "all_gather" else 1
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    return {
        "op": op,
        "kind": kind,
        "dtype": dtypes[0] if len(dtypes) == 1 else "mixed:" + ",".join(dtypes),
        "elements": times * sum(t.numel() for t in tensors),
        "bytes": times * sum(t.numel() * t.element_size() for t in tensors),
        "group_size": size,
    }


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched while it is active (see `describe`), in call order, in `calls`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t not in _PLAIN for t in types):
            # A tensor subclass's op (a DTensor's) runs its own collectives inside: defer to the subclass with
            # this mode still active, so they are recorded (a mode does not see what its own call dispatches).
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            schema = func._schema
            named = {a.name: v for a, v in zip(schema.arguments, args, strict=False)}
            call = describe(schema.name, {**named, **kwargs})
            if call is not None:
                self.calls.append(call)
        return func(*args, **kwargs)


def profiled_kinds(names: Iterable[str]) -> dict[str, int]:
    """Collectives by kind among the profiler's ops (op_names): every c10d op the dispatcher ran, on any
    thread."""
    return dict(collections.Counter(C10D_OPS.get(n, n) for n in names if n.startswith("c10d::")))
