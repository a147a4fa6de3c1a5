"""Rank jobs that measure what measure/ reports by other means, for tests/test_metric_truth.py.

The rank processes import this module by name: spawned ranks inherit the pytest process's sys.path, on which
pytest puts this directory.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import queue
import statistics
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import distbench.jobs.bench as bm
import distbench.measure.timing as timing
from distbench.config import RunConfig
from distbench.jobs.train import make_trainer, seq_len_of
from distbench.measure.timing import Window
from distbench.runtime.context import RankContext
from distbench.strategies.base import Trainer
from distbench.workloads.data import rank_micro_batches
from distbench.workloads.models import get_model
from mutants import _mutate

TimeWindow = Callable[..., Window]  # (ctx, timing, steps, counters=None) -> Window


# --- planted timer defects (here, not in the test module: the rank processes apply them too) ---------------
def late_clock(real: TimeWindow) -> TimeWindow:
    """time_window whose window clock starts after the first step (that step runs, untimed)."""

    def window(ctx: RankContext, mode: str, steps: Any, *rest: Any) -> Window:
        w = real(ctx, mode, steps, *rest)
        return Window(w.wall_s - w.step_s[0], w.step_s, w.host_cpu_s, w.losses)

    return window


def cpu_clock(real: TimeWindow) -> TimeWindow:
    """time_window reporting CPU time as step time: a step that waits (on a device, a peer, a sleep) reads 0."""

    def window(ctx: RankContext, mode: str, steps: Any, *rest: Any) -> Window:
        w = real(ctx, mode, steps, *rest)
        return Window(w.wall_s, w.host_cpu_s, w.host_cpu_s, w.losses)

    return window


def extra_step(real: TimeWindow) -> TimeWindow:
    """time_window that miscounts its steps by one (the last counted twice): the window's wall clock is then
    divided over one step too many."""

    def window(ctx: RankContext, mode: str, steps: Any, *rest: Any) -> Window:
        w = real(ctx, mode, steps, *rest)
        return Window(w.wall_s, [*w.step_s, w.step_s[-1]], [*w.host_cpu_s, w.host_cpu_s[-1]], w.losses)

    return window


def without_final_sync(real: TimeWindow | None = None) -> TimeWindow:
    """measure/timing.py's own time_window, recompiled from its source with the synchronization after the
    window's last step deleted: the clock stops when the host has issued the work, not when it is done.
    (`real` is ignored: the defect is made from the source, so it follows the code it mutates.)"""
    tree = ast.parse(textwrap.dedent(inspect.getsource(timing.time_window)))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    syncs = [
        i
        for i, st in enumerate(fn.body)
        if isinstance(st, ast.Expr)
        and isinstance(st.value, ast.Call)
        and ast.unparse(st.value) == "ctx.synchronize()"
    ]
    assert len(syncs) == 2, f"time_window no longer has one sync before and one after its steps: {syncs}"
    del fn.body[syncs[-1]]
    namespace = dict(vars(timing))
    exec(compile(tree, timing.__file__, "exec"), namespace)
    return namespace["time_window"]


TIMER_DEFECTS: dict[str, Callable[[TimeWindow], TimeWindow]] = {
    "late_clock": late_clock,
    "cpu_clock": cpu_clock,
    "extra_step": extra_step,
    "without_final_sync": without_final_sync,
}


# --- a device stream on CPU --------------------------------------------------------------------------------
class HostStream:
    """A one-thread work queue standing in for a device stream on CPU: a launch returns at once and the work
    runs behind it, synchronize() waits until everything launched is done. What a GPU does to the host's
    clock, so that where the harness synchronizes can be tested without one."""

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._work.get()
            try:
                if fn is None:
                    return
                fn()
            finally:
                self._work.task_done()

    def launch(self, fn: Callable[[], Any]) -> None:
        self._work.put(fn)

    def synchronize(self) -> None:
        self._work.join()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()


@dataclass(frozen=True)
class StreamContext(RankContext):
    """A CPU rank context whose synchronize() waits for a HostStream, as a CUDA context waits for its device."""

    stream: HostStream | None = None

    def synchronize(self) -> None:
        assert self.stream is not None
        self.stream.synchronize()


# --- device-side spins -------------------------------------------------------------------------------------
def spin_rate(device: torch.device, cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Cycles per second of torch.cuda._sleep on this GPU now, timed with CUDA events around spins of
    `cycles` (the median of `repeats`): _sleep counts SM clock cycles, and the clock moves with load and
    temperature, so it is calibrated in the process that uses it, right before."""
    rates = []
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles // 10)  # the first launch pays for module loading
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / (start.elapsed_time(end) / 1000.0))
    return statistics.median(rates)


def delay(ctx: RankContext, seconds: float, rate: float | None) -> None:
    """A delay of `seconds` where the rank's work runs: a device-side spin on the current CUDA stream
    (`rate` from spin_rate), or a host sleep on CPU."""
    if ctx.is_cuda:
        assert rate is not None, "a CUDA delay needs spin_rate's cycles per second"
        torch.cuda._sleep(int(seconds * rate))
    else:
        time.sleep(seconds)


def host_wall_per_call(ctx: RankContext, fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of `fn`, by the host clock between two device synchronizations (no CUDA events)."""
    ctx.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ctx.synchronize()
    return (time.perf_counter() - t0) / calls


def spin_bench(ctx: RankContext, cfg: RunConfig, spin_s: float, plant: str | None = None) -> dict[str, Any]:
    """The `bench` job with every micro-batch of every step a device-side spin of `spin_s` and nothing else.

    The step's length is measured beside the benchmark by the host clock around a few spin steps between
    two synchronizations, before and after it (the SM clock may move between the two): {"reply": bench's
    reply, "known_s": [before, after]}. `plant` names a timer defect from TIMER_DEFECTS applied to bench's
    time_window.
    """
    rate = spin_rate(ctx.device)

    def step(micro_batches: list[Any], capture_grads: bool = False) -> torch.Tensor:
        for _ in micro_batches:
            torch.cuda._sleep(int(spin_s * rate))
        return torch.zeros((), device=ctx.device)

    fake = [{} for _ in range(cfg.accum_steps)]
    real_build = bm.build_trainer

    def build(ctx_: RankContext, rc_: RunConfig, model: nn.Module) -> Trainer:
        trainer = real_build(ctx_, rc_, model)
        trainer.step_async = step  # type: ignore[method-assign]
        return trainer

    known = [host_wall_per_call(ctx, lambda: step(fake), 5)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(bm, "build_trainer", build))
        if plant:
            stack.enter_context(mock.patch.object(bm, "time_window", TIMER_DEFECTS[plant](bm.time_window)))
        reply = bm.bench(ctx, cfg, nvml=False)
    known.append(host_wall_per_call(ctx, lambda: step(fake), 5))
    return {"reply": reply, "known_s": known}


# --- memory ------------------------------------------------------------------------------------------------
def known_allocation_bench(
    ctx: RankContext, cfg: RunConfig, mib: int, plant: str | None = None
) -> dict[str, Any]:
    """Two `bench` runs of the same configuration in this rank, one after the other: the first allocates a
    tensor of `mib` MiB in its first timed step and keeps it to the window's end; the second allocates
    nothing. {"with": first's memory readings, "next": second's}. `cfg` needs warmup >= 1, so that the
    first window (warm-up) is not the timed one. plant "no_peak_reset": bench never resets the peaks."""
    assert cfg.warmup >= 1, "the allocation must land in a timed window, after the warm-up one"
    held: list[torch.Tensor] = []
    windows = [0]
    real_window = bm.time_window

    def window(ctx_: RankContext, mode: str, steps: Any, *rest: Any) -> Window:
        windows[0] += 1
        if windows[0] == 2:  # bench's first timed window
            first = steps[0]

            def allocate_then_step() -> Any:
                held.append(torch.empty(mib << 20, dtype=torch.uint8, device=ctx_.device))
                return first()

            steps = [allocate_then_step, *steps[1:]]
        return real_window(ctx_, mode, steps, *rest)

    with contextlib.ExitStack() as stack:
        if plant == "no_peak_reset":
            stack.enter_context(mock.patch.object(bm, "reset_peaks", lambda ctx_: None))
        elif plant is not None:
            raise ValueError(f"unknown plant {plant!r}")
        with mock.patch.object(bm, "time_window", window):
            first = bm.bench(ctx, cfg, nvml=False)
        assert len(held) == 1, "the planted allocation never ran"
        held.clear()
        torch.cuda.empty_cache()
        second = bm.bench(ctx, cfg, nvml=False)
    return {"with": first["memory"], "next": second["memory"]}


# --- MFU ---------------------------------------------------------------------------------------------------
#: A precision policy's matmul numerics: (dtype of the operands, TF32 for fp32 operands). "fp32" is fp32 with TF32
#: off (the CUDA cores), "tf32" fp32 with TF32 on (tensor cores); bf16 and fp16 run on tensor cores either way.
MATMUL_NUMERICS: dict[str, tuple[torch.dtype, bool]] = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
}


def matmul_flop_rate(
    device: torch.device, shapes: list[tuple[int, int]], tokens: int, numerics: str = "bf16", iters: int = 10
) -> float:
    """Achieved FLOP/s of the matrix multiplies one training step of a stack of bias-free Linear layers
    (`shapes`: (in_features, out_features) each) does on `tokens` tokens, under `numerics` (MATMUL_NUMERICS), timed
    by CUDA events: per layer the forward x.W^T, the input gradient g.W and the weight gradient g^T.x, 2 x tokens x
    in x out FLOPs each, in the layouts F.linear and its backward use. TF32 is switched for the benchmark alone."""
    dtype, tf32 = MATMUL_NUMERICS[numerics]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    layers = [(rand(tokens, i), rand(o, i), rand(tokens, o)) for i, o in shapes]

    def step() -> None:
        for x, w, g in layers:
            x @ w.t()
            g @ w
            g.t() @ x

    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        step()  # cuBLAS picks and loads its kernels
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    flops = iters * sum(6 * tokens * i * o for i, o in shapes)
    return flops / (start.elapsed_time(end) / 1000.0)


def mfu_beside_matmuls(ctx: RankContext, cfg: RunConfig, numerics: str = "bf16") -> dict[str, Any]:
    """The `bench` job on a model of bias-free Linear layers, and a matmul benchmark of the same shapes on the same
    tokens per micro-batch under `numerics` (MATMUL_NUMERICS: those of cfg's policy) run before and after it in
    this process: {"reply", "matmul_flops_per_s": [before, after], "shapes", "device_name"}."""
    spec = get_model(cfg.model)
    model = spec.build(cfg.seed, "meta")
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert shapes and all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear)), (
        "mfu_beside_matmuls needs a stack of bias-free Linear layers"
    )
    tokens = cfg.micro_batch * (cfg.seq_len or spec.seq_len)
    rates = [matmul_flop_rate(ctx.device, shapes, tokens, numerics)]
    reply = bm.bench(ctx, cfg, nvml=False)
    rates.append(matmul_flop_rate(ctx.device, shapes, tokens, numerics))
    return {
        "reply": reply,
        "matmul_flops_per_s": rates,
        "shapes": shapes,
        "device_name": torch.cuda.get_device_name(ctx.device),
    }


@contextlib.contextmanager
def _planted(plant: str | None) -> Iterator[None]:
    """A defect planted in the ranks, to show the checks that use these jobs can fail.

    first_micro_batch_only: each step trains on its first micro-batch and drops the rest (accumulation
    silently skipped), while the result still claims the configured global batch.
    """
    if plant is None:
        yield
        return
    if plant != "first_micro_batch_only":
        raise ValueError(f"unknown plant {plant!r}")
    real = bm.rank_micro_batches
    with mock.patch.object(bm, "rank_micro_batches", lambda *a, **k: real(*a, **k)[:1]):
        yield


def counted_bench(ctx: RankContext, cfg: RunConfig, plant: str | None = None) -> dict[str, Any]:
    """The `bench` job, with the model's input tokens counted by a forward hook and every time_window call
    timed by a clock of its own: {"reply": bench's reply, "windows": [{"tokens", "seconds", "wall_s"}, ...]}
    with one entry per window, warm-up first ("seconds" by this clock around the call, "wall_s" the window's
    own)."""
    seen = [0]
    windows: list[dict[str, float]] = []

    def count(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        seen[0] += ids.numel()

    real_build, real_window = bm.build_trainer, bm.time_window

    def build(ctx_: RankContext, rc: RunConfig, model: nn.Module) -> Trainer:
        model.register_forward_pre_hook(count, with_kwargs=True)
        return real_build(ctx_, rc, model)

    def window(ctx_: RankContext, timing: str, steps: Any, *rest: Any) -> Any:
        before, t0 = seen[0], time.perf_counter()
        w = real_window(ctx_, timing, steps, *rest)
        windows.append({"tokens": seen[0] - before, "seconds": time.perf_counter() - t0, "wall_s": w.wall_s})
        return w

    with (
        _planted(plant),
        mock.patch.object(bm, "build_trainer", build),
        mock.patch.object(bm, "time_window", window),
    ):
        reply = bm.bench(ctx, cfg, nvml=False)
    return {"reply": reply, "windows": windows}


def _flat_grads(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None])


def _ranks_agree(ctx: RankContext, x: torch.Tensor) -> bool:
    """Whether every rank holds exactly the same tensor."""
    got = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(got, x)
    return all(torch.equal(got[0], g) for g in got[1:])


def grads_across_accumulation(
    ctx: RankContext, cfg: RunConfig, mutation: str | None = None
) -> dict[str, bool]:
    """Whether the ranks' gradients agree after each micro-batch of one optimizer step, read in the ranks.

    Each rank sees different samples, so gradients agree only once they have been communicated: a strategy
    that skips the sync on all but the last micro-batch disagrees before it and agrees after. `mutation`
    names a trainer defect from tests/mutants.py.
    """
    trainer = make_trainer(ctx, cfg)
    if mutation:
        _mutate(trainer, mutation)
    try:
        mbs = rank_micro_batches(
            cfg, 0, ctx.rank, seq_len_of(cfg), get_model(cfg.model).vocab_size, ctx.device
        )
        agree = []
        for i, mb in enumerate(mbs):
            trainer.forward_backward(mb, sync=i == len(mbs) - 1)
            agree.append(_ranks_agree(ctx, _flat_grads(trainer)))
        return {"agree_after_each_micro_batch": agree}
    finally:
        trainer.close()
