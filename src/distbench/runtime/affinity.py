"""Optional CPU binding of rank processes, to take host scheduling noise out of step times.

FSDP2 and ZeRO-3 steps are partly CPU-bound (GPU utilisation 82-89% and 33-52% on 4x H200), and their
step times varied 5-18% within a run while DDP's stayed within 2%. With DISTBENCH_BIND_CPUS=exclusive
(`distbench run --bind-cpus`) rank r runs only on the r-th of world_size equal, disjoint slices of the
CPUs the launching process may use, so ranks stop competing for cores. The slices follow CPU numbering:
right for one NUMA node; on several, order GPUs and CPUs alike or bind with `numactl` instead.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from ..errors import ConfigError

ENV = "DISTBENCH_BIND_CPUS"
#: exclusive: each rank its slice of the CPUs. pinned: the same, and the training threads (the rank's main
#: thread and autograd's device threads, which run backward) on the slice's first CPU, so that two variants
#: whose windows take turns (`distbench ab`) run their host work on the very same core: on one H200 virtual
#: machine the vCPUs' speeds differed by up to x1.7 at the same moment and changed within seconds, and two
#: processes on different cores differed by 10-35% window after window.
MODES = ("exclusive", "pinned")


def rank_cpus(rank: int, world_size: int, allowed: Collection[int] | None = None) -> list[int] | None:
    """The CPUs rank `rank` is bound to under DISTBENCH_BIND_CPUS (of `allowed`, by default the CPUs this
    process may use), or None when binding is off."""
    mode = os.environ.get(ENV, "")
    if not mode:
        return None
    if mode not in MODES:
        raise ConfigError(f"{ENV}={mode!r} is not a binding mode; use one of {', '.join(MODES)}, or unset it")
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{ENV} binds with os.sched_setaffinity, which this platform lacks; unset it")
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if len(cpus) < world_size:
        raise ConfigError(
            f"{ENV}={mode} needs a CPU per rank: {world_size} ranks, {len(cpus)} CPUs allowed "
            "to this process; unset it or run fewer ranks"
        )
    per_rank = len(cpus) // world_size
    return cpus[rank * per_rank : (rank + 1) * per_rank]


def pin_training_threads() -> int | None:
    """Under DISTBENCH_BIND_CPUS=pinned, move this thread and torch's autograd threads (pt_autograd_*) to the
    first CPU this process is bound to; that CPU, or None when the mode is another. Call it after the first
    backward (autograd starts its device threads then)."""
    if os.environ.get(ENV) != "pinned" or not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    for tid in os.listdir("/proc/self/task"):
        if is_autograd_thread(int(tid)):
            try:
                os.sched_setaffinity(int(tid), {cpu})
            except OSError:  # the thread ended meanwhile
                continue
    return cpu


def is_autograd_thread(tid: int) -> bool:
    """Whether thread `tid` of this process is one of torch's autograd device threads (named pt_autograd_*),
    which run backward; False for a thread that has ended."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().startswith("pt_autograd")
    except OSError:
        return False
