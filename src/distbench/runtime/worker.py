"""The loop each rank process runs: join the process group once, then execute jobs until told to stop.

Jobs are module-level functions, sent by name ("package.module:function", see job_name) and called as
function(ctx, **kwargs) in every rank; their arguments arrive unpickled as they were sent. Results
travel back encoded (channel.encode), so tensors are copied by value rather than through
torch's shared-memory reductions (which leak file descriptors across many jobs).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .channel import encode, read_message, write_message
from .context import RankContext, collective_backend, process_group_backend

#: State that outlives one job inside this rank process (e.g. a trainer kept between benchmark rounds).
STATE: dict[str, Any] = {}

STACK_SIGNAL = signal.SIGUSR1
#: Host threads per rank, set by a lane that shares its devices with other lanes (lanes.py)
THREADS_ENV = "DISTBENCH_RANK_THREADS"


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when the pool's process dies: no orphan ranks. Set first
    thing, then checked: a parent that died during the spawn bootstrap, before the request, would
    otherwise leave this rank running under init."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def job_name(job: Callable[..., Any]) -> str:
    """The name a job travels under, "module:function": every rank imports the module and calls the function."""
    module, qualname = getattr(job, "__module__", None), getattr(job, "__qualname__", "")
    if not callable(job) or not module or not qualname.isidentifier():
        raise TypeError(
            f"a job must be a module-level function that ranks can import by name, not {job!r} "
            "(a lambda, a nested function or a method has no such name): define it at the top "
            "of a module"
        )
    return f"{module}:{qualname}"


def resolve(target: str) -> Callable[..., Any]:
    module_name, _, fn_name = target.partition(":")
    return getattr(importlib.import_module(module_name), fn_name)


def worker_main(
    rank: int,
    world_size: int,
    device_type: str,
    parent_pid: int,
    store_port: int,
    env: dict[str, str],
    tasks: Connection,
    replies: Connection,
    stacks: Connection,
    cpus: list[int] | None = None,
) -> None:
    """Join the process group through the pool's store, then run jobs from `tasks` until it closes (the
    pool closed it, or died): the pipe's end-of-file is the stop signal and the parent-death watchdog."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the pool decides
    faulthandler.register(STACK_SIGNAL, file=stacks.fileno(), all_threads=True)
    if cpus:
        os.sched_setaffinity(0, cpus)  # before torch starts its thread pools: they inherit it
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    try:
        ctx = _join_group(rank, world_size, device_type, store_port)
    except BaseException:
        write_message(replies.fileno(), (-1, rank, "error", "ProcessGroupInit", traceback.format_exc(), 0))
        return
    write_message(replies.fileno(), (-1, rank, "ok", None, None, 0))
    restore_numerics = numerics_restorer()
    while (msg := read_message(tasks.fileno())) is not None:
        reply = _run(ctx, *msg)
        msg = None  # nothing of this job may be frozen below
        _between_jobs(ctx, restore_numerics)
        sys.stdout.flush()
        sys.stderr.flush()
        # with what the rank's tensors still hold on the device now: what the job left, once STATE is empty
        if not write_message(replies.fileno(), (*reply, _device_bytes(ctx))):
            break
    # Leave at once. The pipe's end means no job runs in any rank of the pool, so there is nothing to tear down
    # in order: the kernel and the driver free the device, NCCL's and gloo's sockets and memory as the process
    # ends. Python's own exit (destroy_process_group, then waiting for every non-daemon thread and atexit hook a
    # library left) took an H200 rank the pool's whole grace, after which it was killed anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join_group(rank: int, world_size: int, device_type: str, store_port: int) -> RankContext:
    """This rank's RankContext, once it joined the pool's process group (NCCL on its own GPU, or gloo)."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if os.environ.get(THREADS_ENV):  # a lane sharing its devices: this rank's share of the host's cores
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    kw: dict[str, Any] = {"device_id": device} if device_type == "cuda" else {}
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group(
        process_group_backend(device_type), store=store, rank=rank, world_size=world_size, **kw
    )
    return RankContext(rank, world_size, rank, device, collective_backend(device_type))


def _run(ctx: RankContext, job_id: int, target: str, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Run one job; its reply: the encoded return value, or the exception's type and traceback."""
    try:
        return (job_id, ctx.rank, "ok", None, encode(resolve(target)(ctx, **kwargs)))
    except BaseException as e:  # report everything, including KeyboardInterrupt in a rank
        return (job_id, ctx.rank, "error", type(e).__name__, traceback.format_exc())


#: Device bytes a rank may hold with no job running (cuBLAS workspaces and the like) before a full collection of
#: the frozen objects too is tried; `_held_floor`: what the last such collection (or a job's end) left.
LEFTOVER_BYTES = 256 * 2**20
_held_floor = 0


def _device_bytes(ctx: RankContext) -> int:
    """Device memory this rank's tensors hold (the caching allocator's count); 0 on CPU."""
    if not ctx.is_cuda:
        return 0
    import torch

    return int(torch.cuda.memory_allocated(ctx.device))


def numerics_restorer() -> Callable[[], None]:
    """What puts torch's process-wide numerics (deterministic algorithms, TF32, cuDNN's choices, the SDPA
    backends) back as they are now. A job that sets none of them inherits the last job's: on 4 H200s an
    activation-memory account counted 9.03 GiB of saved activations in one lane order and 5.09 GiB in all
    eight others (a parity job's math attention kernel keeps the attention weights), and failed its test."""
    import torch

    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    precision = torch.get_float32_matmul_precision()
    cudnn_flags = (cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    sdpa_switches = (
        cuda.enable_flash_sdp,
        cuda.enable_mem_efficient_sdp,
        cuda.enable_cudnn_sdp,
        cuda.enable_math_sdp,
    )
    sdpa = (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
        cuda.math_sdp_enabled(),
    )

    def restore() -> None:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_float32_matmul_precision(precision)  # matmul.allow_tf32 follows it
        cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = cudnn_flags
        for enable, on in zip(sdpa_switches, sdpa, strict=True):
            enable(on)

    return restore


def _between_jobs(ctx: RankContext, restore_numerics: Callable[[], None]) -> None:
    """Once no job keeps state here (STATE): put the process's numerics back as the pool started them, collect
    the job's garbage, freeze what survives and give cached device memory back.

    While a job keeps a trainer between rounds (bench, fidelity), each round is timed and the next follows at
    once, so nothing is done between them. Its cached blocks are its working set: given back after every
    round, the next round's first step allocated its activations again with cudaMalloc inside its timing. A
    full collection after every round left the next one slower and noisier: on 2 CPU cores, harness-against-
    bare rounds of gpt2-tiny kept in a pool rank took a median 10.6-11.6 ms and their log ratio spread by 22%,
    where the same rounds in one process took 9.1-9.7 ms and spread by 5-9% (scripts/fidelity_noise.py)."""
    global _held_floor
    if STATE:
        return
    restore_numerics()
    gc.collect()
    held = _device_bytes(ctx)
    if held > _held_floor + LEFTOVER_BYTES:
        # An earlier job's object that was alive when it was frozen (a library's module-level reference to its
        # engine, replaced by the next build) and dropped since is cyclic garbage that no collection of the
        # unfrozen generations sees, nor gc.get_objects(): device memory lost to the pool for good.
        gc.unfreeze()
        gc.collect()
        held = _device_bytes(ctx)
    _held_floor = held  # the next job is judged by what it adds to this: live memory is not collected again
    # What survives a job is the process's own state (torch, transformers, DeepSpeed, ~400k
    # objects). Frozen, full collections skip it: the ones strategies run at build and teardown
    # (three in DeepSpeed's ZeRO-3 init, 0.47 s each on an H200 host) scan only the next job's.
    gc.freeze()
    if ctx.is_cuda:
        import torch

        torch.cuda.empty_cache()
        # The allocator's counts (OOMs, retries) start again with the next configuration: DeepSpeed's
        # ZeRO-3 warns of "allocator cache flushes" from the process's count, and in a pool that had
        # run out of memory on an earlier probe it warned on every later one, at micro-batch 1 too.
        torch.cuda.reset_accumulated_memory_stats(ctx.device)
