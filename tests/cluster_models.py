"""Users' model factories that fail on one node of a torchrun job: on the last launched rank one raises, one
hangs (in its build, or in the middle of a training step) and one dies of a segfault inside a collective,
while the other ranks go on to their first collective."""

from __future__ import annotations

import ctypes
import os
import time

from torch import nn

from user_models import tiny_lm


def fails_on_last_rank() -> nn.Module:
    if _last_rank():
        raise RuntimeError(f"planted failure on rank {os.environ['RANK']}")
    return tiny_lm()


def hangs_on_last_rank() -> nn.Module:
    if _last_rank():
        time.sleep(3600)
    return tiny_lm()


class _HangsInAStep(nn.Module):
    """A model whose forward, on the last rank, sleeps for good: the other ranks reach the step's gradient
    reduction and wait there for it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_lm()
        self.vocab_size = self.inner.vocab_size

    def forward(self, input_ids):  # type: ignore[no-untyped-def]
        if _last_rank():
            planted_hang_in_forward()
        return self.inner(input_ids)


def planted_hang_in_forward() -> None:
    time.sleep(3600)


def hangs_in_a_step_on_last_rank() -> nn.Module:
    return _HangsInAStep()


def _last_rank() -> bool:
    """The last rank of the launch: torchrun's ROLE_WORLD_SIZE, which a job's own WORLD_SIZE (the first ranks
    of the launch, runtime/cluster.job_environment) leaves as it is."""
    world = os.environ.get("ROLE_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    return (
        os.environ.get("RANK") is not None and world is not None and int(os.environ["RANK"]) == int(world) - 1
    )


class _SegfaultsInACollective(nn.Module):
    """A model whose forward enters an all-reduce on every rank and, on the last one, dies by SIGSEGV inside
    it (a hook on the all-reduce's work reads address 0), as a crash in NCCL would."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_lm()
        self.vocab_size = self.inner.vocab_size

    def forward(self, input_ids):  # type: ignore[no-untyped-def]
        import torch
        import torch.distributed as dist

        flag = torch.ones(1, device=input_ids.device)
        if _last_rank():
            segfault_inside_all_reduce(flag)
        dist.all_reduce(flag)
        return self.inner(input_ids)


def segfault_inside_all_reduce(flag) -> None:  # type: ignore[no-untyped-def]
    """Dies inside torch.distributed.all_reduce: the call's Python frame is on the stack when SIGSEGV comes."""
    import torch.distributed as dist

    real = dist.all_reduce

    def all_reduce(*args, **kwargs):  # type: ignore[no-untyped-def]
        ctypes.string_at(0)
        return real(*args, **kwargs)

    all_reduce(flag)


def segfaults_on_last_rank() -> nn.Module:
    return _SegfaultsInACollective()
