"""Benchmark jobs that run inside the ranks; distbench/results.py turns their replies into a result and
distbench/matrix.py runs them in a pool.

* bench(ctx, cfg): build, `cfg.warmup` untimed steps, `cfg.steps` timed steps in `cfg.windows` windows,
  a device-time sample (measure/devicetime.py), measurements; one job. `distbench run` and `distbench ab` use it.
* bench_setup / bench_step / bench_finish: the same split in three, with the trainer kept alive in the
  worker's STATE between jobs, so pytest-benchmark's `benchmark.pedantic` can time one step per round
  from the pytest process (bench_step is one synchronized step: a round trip per step is sync anyway).
* bench_window: between bench_setup and bench_finish, one timed window as `bench` times them, so that the
  A/B gate can interleave two variants' windows (matrix.SteppedRun, gate/ab.py).
* trace(ctx, cfg, out_dir): build, warm up, profile a few steps into chrome traces (measure/trace.py).
* collective_bandwidth(ctx, ...): the collectives' bus bandwidth (measure/busbw.py).

Windows are timed as measure/timing.py describes (no host sync inside one by default); the reported step time
is the median over windows of the slowest rank's window wall clock per step, and every per-step time is
kept. Memory peaks cover the timed steps (peaks are reset after warm-up). `losses` holds every step's global-batch loss, warm-up included.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import LocalPath, RunConfig
from ..measure import busbw
from ..measure.adaptive import decide
from ..measure.devicetime import sample_device_time
from ..measure.hostcount import ThreadCounters, try_open_counters
from ..measure.hostspeed import ThreadTimes, cpu_stat, reference_s, steal_share
from ..measure.memory import memory_stats, reset_peaks
from ..measure.mfu import model_flops, peak_dtype
from ..measure.nvml import NvmlSampler
from ..measure.pygc import GcWatch
from ..measure.timing import Window, time_window, timed
from ..measure.trace import profile_steps
from ..runtime import worker
from ..runtime.affinity import pin_training_threads
from ..runtime.context import RankContext
from ..strategies import build_trainer
from ..strategies.base import Trainer, global_mean
from ..workloads.data import rank_micro_batches
from ..workloads.models import count_params, get_model
from .train import set_numerics

STATE_KEY = "bench"


@dataclass
class _Bench:
    cfg: RunConfig
    trainer: Trainer
    seq_len: int
    vocab_size: int
    flops: dict[str, Any]
    n_params: int
    step: int = 0
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    warmup_times: list[float] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    device_time: dict[str, Any] | None = None
    nvml_summary: dict[str, Any] | None = None  # the sampler's summary, taken when the timed windows end
    sampler: NvmlSampler | None = None
    gc_watch: GcWatch | None = None
    counters: ThreadCounters | None = None  # this thread's user-mode instructions and cycles, where allowed
    counters_missing: str | None = None  # why there are none
    adaptive: dict[str, Any] | None = None  # how timing stopped under cfg.until_ci (measure/adaptive.py)


def _free(ctx: RankContext) -> None:
    """Drop the kept trainer and give its memory back, so the next job starts clean."""
    b = worker.STATE.pop(STATE_KEY, None)
    if b is not None:
        if b.sampler is not None:
            b.sampler.stop()
        if b.gc_watch is not None:
            b.gc_watch.stop()  # the collector back on, whatever stopped the benchmark
        if b.counters is not None:
            b.counters.close()
        try:
            b.trainer.close()
        finally:
            del b
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()


def _setup(ctx: RankContext, rc: RunConfig, nvml: bool) -> _Bench:
    _free(ctx)  # a benchmark abandoned without bench_finish
    set_numerics(rc)
    spec = get_model(rc.model)
    seq_len = rc.seq_len or spec.seq_len
    model = spec.build(rc.seed, ctx.device)
    flops = model_flops(model, seq_len)  # before wrapping: sharded parameters would undercount
    n_params = count_params(model)
    b = _Bench(rc, build_trainer(ctx, rc, model), seq_len, spec.vocab_size, flops, n_params)
    del model
    worker.STATE[STATE_KEY] = b
    b.counters, b.counters_missing = try_open_counters()
    if rc.warmup:
        w = time_window(ctx, rc.timing, _step_fns(ctx, b, rc.warmup))
        b.warmup_times, b.losses = w.step_s, _global_losses(ctx, w.losses)
    # GcWatch.start's full collection takes each rank its own 0.1-0.5 s. Run after the barrier, that skew
    # would land in the first timed step's first collective (on 4x H200 DDP's first timed step was a median
    # 13% over the run's median with this order); before it, every rank starts timing together.
    b.gc_watch = GcWatch(rc.gc_during_steps).start()
    pin_training_threads()  # after the warm-up's backward started autograd's threads
    reset_peaks(ctx)
    if ctx.world_size > 1:
        dist.barrier()
    if nvml:  # after the collection: its idle GPU is no part of the timed steps' utilisation
        b.sampler = NvmlSampler(ctx.device).start()
    return b


def _step_fns(ctx: RankContext, b: _Bench, n: int) -> list[Callable[[], Any]]:
    """The next `n` optimizer steps as callables, their data already on the device: preparing a batch inside
    a window would copy from pageable host memory, which waits for the device and drains the run-ahead."""

    def one(mbs: list[dict[str, torch.Tensor]]) -> Callable[[], Any]:
        def run() -> Any:
            loss = b.trainer.step_async(mbs)
            if b.gc_watch is not None:
                b.gc_watch.step()
            return loss

        return run

    fns = [
        one(rank_micro_batches(b.cfg, b.step + i, ctx.rank, b.seq_len, b.vocab_size, ctx.device))
        for i in range(n)
    ]
    b.step += n
    return fns


def _global_losses(ctx: RankContext, local: list[torch.Tensor]) -> list[float]:
    """Global-batch mean losses of a window's steps from each rank's local means: one all-reduce after the
    window instead of one inside every step."""
    return [float(x) for x in global_mean(ctx, torch.stack(local).to(ctx.device)).tolist()]


def _window(ctx: RankContext, b: _Bench, n: int) -> Window:
    """One timed window of `n` steps, with the host's speed around it (measure/hostspeed.py), kept in `b`."""
    fns = _step_fns(ctx, b, n)
    ref = reference_s(ctx)
    if ctx.world_size > 1:
        dist.barrier()  # every rank starts the window together
    threads, stat = ThreadTimes().start(), cpu_stat()
    w = time_window(ctx, b.cfg.timing, fns, b.counters)
    w.host_speed = {
        "threads": threads.stop(),
        "steal": steal_share(stat, cpu_stat()),
        "ref_s": [ref, reference_s(ctx)],
    }
    b.windows.append(w)
    b.times += w.step_s
    b.losses += _global_losses(ctx, w.losses)
    return w


def _close_windows(ctx: RankContext, b: _Bench) -> None:
    """After the last timed window: the NVML summary of the windows, then the device-time sample."""
    if b.sampler is not None:  # utilisation and clocks of the timed windows only
        b.nvml_summary = b.sampler.stop()
        b.sampler = None
    if b.cfg.device_time_steps and b.device_time is None:
        b.device_time = sample_device_time(ctx, _step_fns(ctx, b, b.cfg.device_time_steps))


def _timed_windows(ctx: RankContext, b: _Bench) -> None:
    """The run's timed steps as cfg.windows windows (more until the figure repeats, under cfg.until_ci), then
    the device-time sample outside them."""
    for n in b.cfg.window_steps:
        _window(ctx, b, n)
    if b.cfg.until_ci:
        _until_narrow(ctx, b)
    _close_windows(ctx, b)


def _slowest_per_step(ctx: RankContext, w: Window) -> float:
    """The window's wall seconds per step on the slowest rank: what every rank's decision is taken on."""
    t = torch.tensor([w.wall_s / len(w.step_s)], dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _until_narrow(ctx: RankContext, b: _Bench) -> None:
    """More windows of the shortest length until measure/adaptive.decide stops; its start-up transient moves
    from the timed windows to the warm-up."""
    steps = min(b.cfg.window_steps)
    walls = [_slowest_per_step(ctx, w) for w in b.windows]
    while (d := decide(walls, b.cfg.until_ci, b.cfg.max_windows)).more:
        walls.append(_slowest_per_step(ctx, _window(ctx, b, steps)))
    for _ in range(d.drop):
        w = b.windows.pop(0)
        b.times = b.times[len(w.step_s) :]
        b.warmup_times += w.step_s
    b.adaptive = {**d.to_dict(), "windows": len(walls), "target": b.cfg.until_ci}


def _step(ctx: RankContext, b: _Bench) -> tuple[float, float]:
    """One synchronized optimizer step (the pytest-benchmark path: one step per round); (loss, seconds)."""
    mbs = rank_micro_batches(b.cfg, b.step, ctx.rank, b.seq_len, b.vocab_size, ctx.device)
    loss, dt = timed(ctx, lambda: b.trainer.step(mbs))
    if b.gc_watch is not None:
        b.gc_watch.step()
    b.step += 1
    b.losses.append(loss)
    return loss, dt


def _finish(ctx: RankContext, b: _Bench) -> dict[str, Any]:
    nv = b.sampler.stop() if b.sampler is not None else b.nvml_summary
    b.sampler = None
    pygc = b.gc_watch.stop() if b.gc_watch is not None else None
    b.gc_watch = None
    return {
        "rank": ctx.rank,
        "device_type": ctx.device_type,
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else None,
        "peak_dtype": peak_dtype(b.cfg.precision),
        "optimizer_impl": b.trainer.optimizer_impl,
        "seq_len": b.seq_len,
        "n_params": b.n_params,
        "flops": b.flops,
        "step_times_s": list(b.times),
        "warmup_step_times_s": list(b.warmup_times),
        "windows": [
            {
                "wall_s": w.wall_s,
                "steps": len(w.step_s),
                "host_cpu_s": w.host_cpu_s,
                "host_s": w.host_s,
                "counts": w.counts,
                "host_speed": w.host_speed,
            }
            for w in b.windows
        ],
        "counters": {
            "missing": b.counters_missing,
            "multiplexed": bool(b.counters and b.counters.multiplexed),
        },
        "device_time": b.device_time,
        "adaptive": b.adaptive,
        "losses": list(b.losses),
        "memory": memory_stats(ctx, nv["mem_used_peak_bytes"] if nv else None),
        "nvml": nv,
        "gc": pygc,
    }


def bench_setup(ctx: RankContext, cfg: RunConfig, nvml: bool = True) -> dict[str, Any]:
    """Build model and trainer, run cfg.warmup steps, keep the trainer in the worker for bench_step."""
    try:
        b = _setup(ctx, cfg, nvml)
    except BaseException:
        _free(ctx)
        raise
    return {"rank": ctx.rank, "seq_len": b.seq_len, "n_params": b.n_params, "warmup_losses": list(b.losses)}


def bench_step(ctx: RankContext) -> dict[str, float]:
    """One timed, synchronized optimizer step of the trainer bench_setup built."""
    b = worker.STATE.get(STATE_KEY)
    if b is None:
        raise RuntimeError(
            "bench_step without a benchmark: run bench_setup first (or it was freed by an error)"
        )
    try:
        loss, dt = _step(ctx, b)
    except BaseException:
        _free(ctx)
        raise
    b.times.append(dt)
    return {"loss": loss, "step_time_s": dt}


def bench_window(ctx: RankContext, steps: int) -> dict[str, Any]:
    """One timed window of `steps` steps of the trainer bench_setup built (the A/B gate interleaves two
    variants' windows this way); this rank's window wall clock."""
    b = worker.STATE.get(STATE_KEY)
    if b is None:
        raise RuntimeError("bench_window without a benchmark: run bench_setup first")
    try:
        w = _window(ctx, b, steps)
    except BaseException:
        _free(ctx)
        raise
    return {"rank": ctx.rank, "wall_s": w.wall_s, "steps": len(w.step_s)}


def bench_finish(ctx: RankContext) -> dict[str, Any]:
    """This rank's measurements since bench_setup (after windows from bench_window, the device-time sample
    too); frees the trainer."""
    b = worker.STATE.get(STATE_KEY)
    if b is None:
        raise RuntimeError("bench_finish without a benchmark: run bench_setup first")
    try:
        if b.windows:
            _close_windows(ctx, b)
        return _finish(ctx, b)
    finally:
        _free(ctx)


def bench(ctx: RankContext, cfg: RunConfig, nvml: bool = True) -> dict[str, Any]:
    """setup + cfg.steps timed steps in cfg.windows windows + a device-time sample + finish, in one
    job: this rank's measurements."""
    try:
        b = _setup(ctx, cfg, nvml)
        _timed_windows(ctx, b)
        return _finish(ctx, b)
    finally:
        _free(ctx)


def trace(ctx: RankContext, cfg: RunConfig, out_dir: LocalPath, steps: int = 3) -> dict[str, Any]:
    """Build, warm up, then profile `steps` steps into this rank's chrome trace under `out_dir`."""
    try:
        b = _setup(ctx, cfg, nvml=False)
        profile_steps(ctx, lambda: _step(ctx, b), steps, out_dir, warmup=1)
        return {"rank": ctx.rank, "trace_dir": out_dir}
    finally:
        _free(ctx)


def collective_bandwidth(ctx: RankContext, **options: Any) -> dict[str, Any]:
    """The bandwidth of each collective at each size in this rank's group; `options` go to
    measure/busbw.py's bandwidth_table."""
    return busbw.bandwidth_table(ctx, **options)
