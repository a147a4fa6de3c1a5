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


def leave_a_thread_running(ctx: Any) -> None:
    """What libraries do (a watchdog, a worker pool): a non-daemon thread that never ends, which Python's exit
    waits for."""
    import threading

    threading.Thread(target=planted_hang, daemon=False).start()


def crash_in(ctx: Any, rank: int) -> None:
    if ctx.rank == rank:
        os._exit(17)
    dist.barrier()


def _tiny_config_and_model(ctx: Any, strategy: str) -> tuple[Any, Any]:
    """A one-step gpt2-tiny configuration of `strategy` at the pool's world size, numerics set, and its model."""
    from distbench.config import RunConfig
    from distbench.jobs.train import set_numerics
    from distbench.workloads import get_model

    cfg = RunConfig(
        strategy=strategy,
        world_size=ctx.world_size,
        model="gpt2-tiny",
        global_batch=4,
        micro_batch=2,
        steps=1,
    )
    set_numerics(cfg)
    return cfg, get_model(cfg.model).build(cfg.seed, ctx.device)


def parameter_values_formatted_by_build(ctx: Any, strategy: str) -> int:
    """How many tensors' values building `strategy`'s trainer formatted as text (torch's tensor printer)."""
    from unittest import mock

    import torch._tensor_str as tensor_str

    from distbench.strategies import build_trainer

    cfg, model = _tiny_config_and_model(ctx, strategy)
    with mock.patch.object(tensor_str, "_str", wraps=tensor_str._str) as printed:
        trainer = build_trainer(ctx, cfg, model)
    trainer.close()
    return printed.call_count


def model_outlives_close(ctx: Any, strategy: str, activation_checkpointing: bool = False) -> bool:
    """Train one step under `strategy`, close the trainer: is the model still reachable from anywhere?"""
    import gc
    import weakref

    from distbench.jobs.train import run_steps
    from distbench.strategies import build_trainer

    cfg, model = _tiny_config_and_model(ctx, strategy)
    cfg = cfg.replace(activation_checkpointing=activation_checkpointing)
    alive = weakref.ref(model)
    trainer = build_trainer(ctx, cfg, model)
    del model
    run_steps(ctx, trainer, cfg, 1)
    trainer.close()
    del trainer
    gc.collect()
    return alive() is not None


class _Node:
    pass


_CYCLE: Any = None


def leave_a_cycle(ctx: Any) -> None:
    """Garbage only the cycle collector can free, left behind by a job."""
    global _CYCLE
    import weakref

    node = _Node()
    node.me = node
    _CYCLE = weakref.ref(node)


def cycle_and_frozen(ctx: Any) -> dict[str, Any]:
    import gc

    return {"cycle_alive": _CYCLE is not None and _CYCLE() is not None, "frozen": gc.get_freeze_count()}


def numerics(ctx: Any) -> dict[str, Any]:
    """torch's process-wide numerics as a job finds them."""
    import torch

    cuda = torch.backends.cuda
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "fp32 matmul": torch.get_float32_matmul_precision(),
        "cudnn": (
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ),
        "sdpa": (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled()),
    }


def set_parity_numerics(ctx: Any) -> dict[str, Any]:
    """What a parity run sets and leaves set (jobs.train.set_numerics): the numerics a later job must not get."""
    from distbench.config import RunConfig
    from distbench.jobs.train import set_numerics

    set_numerics(RunConfig(deterministic=True))
    return numerics(ctx)


def cpus(ctx: Any) -> list[int]:
    return sorted(os.sched_getaffinity(0))


def signal_self_in(ctx: Any, rank: int, signum: int) -> None:
    """Rank `rank` sends itself `signum` (SIGKILL: dies mid-job; SIGSTOP: freezes); the others wait."""
    if ctx.rank == rank:
        os.kill(os.getpid(), signum)
    dist.barrier()


def signal_self_mid_reply(ctx: Any, rank: int, signum: int, size: int) -> bytes:
    """Rank `rank` returns `size` bytes and sends itself `signum` once an eighth of them went out: the
    pool sees a reply cut off half-way (the rank's written-bytes counter in /proc tells when)."""
    if ctx.rank != rank:
        return b""
    import threading

    def written() -> int:
        with open("/proc/self/io") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("wchar:"))

    start = written()

    def fire() -> None:
        while written() < start + size // 8:
            time.sleep(0.0005)
        os.kill(os.getpid(), signum)

    threading.Thread(target=fire, daemon=True).start()
    return b"x" * size


def replace_stack_handler_and_hang(ctx: Any, rank: int) -> None:
    """Rank `rank` installs its own handler for the pool's stack-dump signal (as some libraries do), then
    hangs; the others wait in a barrier."""
    import signal

    from distbench.runtime.worker import STACK_SIGNAL

    if ctx.rank == rank:
        signal.signal(STACK_SIGNAL, lambda *_: None)
        planted_hang()
    dist.barrier()


def optimizer_over_dtensors(ctx: Any, algorithm: str, optimizer: str) -> str:
    """The implementation Trainer.make_optimizer picks for FSDP2-style DTensor parameters as if on a GPU,
    or the ConfigError it raises."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from distbench.config import RunConfig
    from distbench.errors import ConfigError
    from distbench.strategies.base import Trainer

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    cfg = RunConfig(strategy="fsdp_grad", world_size=ctx.world_size, algorithm=algorithm, optimizer=optimizer)
    trainer = SimpleNamespace(cfg=cfg, ctx=SimpleNamespace(device_type="cuda"))
    try:
        Trainer.make_optimizer(trainer, [param])  # type: ignore[arg-type]
    except ConfigError as e:
        return f"ConfigError: {e}"
    return trainer.optimizer_impl


def pinned_threads(ctx: Any) -> dict[str, Any]:
    """pin_training_threads with a thread named as torch names autograd's (pt_autograd_0) and one not: the
    CPUs each may use afterwards."""
    import ctypes
    import threading

    from distbench.runtime.affinity import pin_training_threads

    started, stop = threading.Barrier(3), threading.Event()
    tids: dict[str, int] = {}

    def idle(name: str) -> None:
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the name /proc shows
        tids[name] = threading.get_native_id()
        started.wait()
        stop.wait()

    threads = [threading.Thread(target=idle, args=(n,)) for n in ("pt_autograd_0", "other")]
    for t in threads:
        t.start()
    started.wait()
    try:
        cpu = pin_training_threads()
        return {
            "cpu": cpu,
            "main": sorted(os.sched_getaffinity(0)),
            **{name: sorted(os.sched_getaffinity(tid)) for name, tid in tids.items()},
        }
    finally:
        stop.set()
        for t in threads:
            t.join()


#: A trainer build planted past test_benchmarks' CONFIG_OVERHEAD_BOUND_S (3 s).
SLOW_BUILD_S = 4.0


def bench_with_a_slow_build(ctx: Any, cfg: Any, nvml: bool) -> dict[str, Any]:
    """jobs.bench.bench whose trainer build sleeps SLOW_BUILD_S first: a configuration overhead past the bound."""
    import distbench.jobs.bench as bm

    real = bm.build_trainer

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_BUILD_S)
        return real(*args, **kwargs)

    bm.build_trainer = slow
    try:
        return bm.bench(ctx, cfg, nvml=nvml)
    finally:
        bm.build_trainer = real


def train_listing_checkpoint_files_late(ctx: Any, rank: int, seconds: float, **kwargs: Any) -> dict[str, Any]:
    """jobs.train, with rank `rank` listing a checkpoint's files `seconds` after reading its manifest (a rank
    behind the others, as 8 ranks on 2 cores are)."""
    from unittest import mock

    import distbench.jobs.train as jobs
    import distbench.strategies.checkpoint_files as checkpoint_files

    listed = checkpoint_files._files

    def late(root: Any) -> Any:
        time.sleep(seconds)
        return listed(root)

    with mock.patch.object(checkpoint_files, "_files", late if ctx.rank == rank else listed):
        return jobs.train(ctx, **kwargs)


def killed_inside_all_reduce(ctx: Any, rank: int) -> None:
    """Rank `rank` enters an all-reduce that its peers join only later and is SIGKILLed while it waits there
    (on NCCL: its kernel in flight, the host waiting for the result), as a rank lost to the OOM killer or a
    node failure is; the others then wait in it for a rank that is gone."""
    import signal
    import threading

    import torch

    flag = torch.ones(1, device=ctx.device)
    if ctx.rank == rank:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        time.sleep(2.0)
    dist.all_reduce(flag)
    flag.item()  # the host waits for the collective's result here


def raises_mid_step(ctx: Any, rank: int) -> None:
    """A DDP training step in which rank `rank` raises between its forward and backward: the others reach the
    backward's gradient all-reduce and wait there."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64).to(ctx.device))
    loss = model(torch.randn(8, 64, device=ctx.device)).square().mean()
    if ctx.rank == rank:
        raise RuntimeError(f"planted failure in the middle of a step on rank {ctx.rank}")
    loss.backward()
    ctx.synchronize()


def deepspeed_adam_state(
    ctx: Any, cfg: Any, steps: int = 0, resume_from: str | None = None
) -> list[list[float]]:
    """The state of the torch optimizer a fresh DeepSpeed trainer of `cfg` was given (whatever DeepSpeed wraps
    it in), after `steps` steps or, with `resume_from`, just after loading that checkpoint: per parameter in the
    optimizer's order, its step count and the sums of squares of Adam's two moments (-1 where absent; this
    rank's own share where the wrapper partitions them, as BF16_Optimizer does)."""
    from distbench.jobs.train import make_trainer, run_steps

    trainer = make_trainer(ctx, cfg)
    try:
        if resume_from:
            trainer.load_checkpoint(resume_from)
        else:
            run_steps(ctx, trainer, cfg, steps)
        opt = trainer.engine.basic_optimizer  # type: ignore[attr-defined]
        out = []
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p, {})
                step = [float(st["step"]) if "step" in st else -1.0]
                moments = [
                    float(st[k].double().pow(2).sum()) if k in st else -1.0 for k in ("exp_avg", "exp_avg_sq")
                ]
                out.append(step + moments)
        return out
    finally:
        trainer.close()
