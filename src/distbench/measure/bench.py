"""Benchmark jobs that run inside the ranks, and the pytest-process functions that turn them into results.

In-rank jobs (run through the rank pool as "distbench.measure.bench:<name>"):

* bench(ctx, cfg): build, `cfg.warmup` untimed steps, `cfg.steps` timed steps in `cfg.windows` windows,
  a device-time sample (measure/devicetime.py), measurements; one job. `distbench run` and `distbench ab` use it.
* bench_setup / bench_step / bench_finish: the same split in three, with the trainer kept alive in the
  worker's STATE between jobs, so pytest-benchmark's `benchmark.pedantic` can time one step per round
  from the pytest process (bench_step is one synchronized step: a round trip per step is sync anyway).
* harness_overhead(ctx, cfg, steps): the harness's `single` trainer against a hand-written loop.

Windows are timed as measure/timing.py describes (no host sync inside one by default); the reported step time
is the median over windows of the slowest rank's window wall clock per step, and every per-step time is
kept. Memory peaks cover the timed steps (peaks are reset after warm-up). `losses` holds every step's global-batch loss, warm-up included.

A CUDA out-of-memory in the ranks becomes a result with status "oom", not an exception.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import RunConfig
from ..errors import ConfigError
from ..results import make_result
from ..runtime import worker
from ..runtime.context import RankContext
from ..runtime.fingerprint import environment_fingerprint
from ..runtime.jobs import set_numerics
from ..runtime.pool import JobError
from ..strategies import build_trainer
from ..strategies.base import IMPL_FLAGS, Trainer, global_mean
from ..workloads.data import rank_micro_batches
from ..workloads.models import count_params, get_model
from .devicetime import DEVICE_BOUND_RATIO, regime, sample_device_time
from .memory import memory_stats, reset_peaks
from .mfu import mfu, model_flops, peak_dtype, peak_flops, tflops_per_gpu
from .nvml import NvmlSampler
from .pygc import GcWatch
from .timing import Window, per_step_max, step_stats, throughput, time_window, timed

STATE_KEY = "bench"
JOB = f"{__name__}:bench"


# --- in-rank ---------------------------------------------------------------------------------------------
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


def _free(ctx: RankContext) -> None:
    """Drop the kept trainer and give its memory back, so the next job starts clean."""
    b = worker.STATE.pop(STATE_KEY, None)
    if b is not None:
        if b.sampler is not None:
            b.sampler.stop()
        if b.gc_watch is not None:
            b.gc_watch.stop()  # the collector back on, whatever stopped the benchmark
        try:
            b.trainer.close()
        finally:
            del b
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()


def _setup(ctx: RankContext, cfg: dict[str, Any], nvml: bool) -> _Bench:
    _free(ctx)  # a benchmark abandoned without bench_finish
    rc = ctx.config(cfg)
    set_numerics(rc)
    spec = get_model(rc.model)
    seq_len = rc.seq_len or spec.seq_len
    model = spec.build(rc.seed, ctx.device)
    flops = model_flops(model, seq_len)  # before wrapping: sharded parameters would undercount
    n_params = count_params(model)
    b = _Bench(rc, build_trainer(ctx, rc, model), seq_len, spec.vocab_size, flops, n_params)
    del model
    worker.STATE[STATE_KEY] = b
    if rc.warmup:
        w = time_window(ctx, rc.timing, _step_fns(ctx, b, rc.warmup))
        b.warmup_times, b.losses = w.step_s, _global_losses(ctx, w.losses)
    # GcWatch.start's full collection takes each rank its own 0.1-0.5 s. Run after the barrier, that skew
    # would land in the first timed step's first collective (on 4x H200 DDP's first timed step was a median
    # 13% over the run's median with this order); before it, every rank starts timing together.
    b.gc_watch = GcWatch(rc.gc_during_steps).start()
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

    fns = [one(rank_micro_batches(b.cfg, b.step + i, ctx.rank, b.seq_len, b.vocab_size, ctx.device))
           for i in range(n)]
    b.step += n
    return fns


def _global_losses(ctx: RankContext, local: list[torch.Tensor]) -> list[float]:
    """Global-batch mean losses of a window's steps from each rank's local means: one all-reduce after the
    window instead of one inside every step."""
    return [float(x) for x in global_mean(ctx, torch.stack(local).to(ctx.device)).tolist()]


def _timed_windows(ctx: RankContext, b: _Bench) -> None:
    """The run's timed steps as cfg.windows windows, then the device-time sample outside them."""
    sizes = [len(part) for part in np.array_split(np.arange(b.cfg.steps), b.cfg.windows)]
    for n in sizes:
        if ctx.world_size > 1:
            dist.barrier()  # every rank starts the window together
        w = time_window(ctx, b.cfg.timing, _step_fns(ctx, b, n))
        b.windows.append(w)
        b.times += w.step_s
        b.losses += _global_losses(ctx, w.losses)
    if b.sampler is not None:  # utilisation and clocks of the timed windows only
        b.nvml_summary = b.sampler.stop()
        b.sampler = None
    if b.cfg.device_time_steps:
        b.device_time = sample_device_time(ctx, _step_fns(ctx, b, b.cfg.device_time_steps))


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
        "windows": [{"wall_s": w.wall_s, "steps": len(w.step_s), "host_cpu_s": w.host_cpu_s} for w in b.windows],
        "device_time": b.device_time,
        "losses": list(b.losses),
        "memory": memory_stats(ctx, nv["mem_used_peak_bytes"] if nv else None),
        "nvml": nv,
        "gc": pygc,
    }


def bench_setup(ctx: RankContext, cfg: dict[str, Any], nvml: bool = True) -> dict[str, Any]:
    """Build model and trainer, run cfg["warmup"] steps, keep the trainer in the worker for bench_step."""
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
        raise RuntimeError("bench_step without a benchmark: run bench_setup first (or it was freed by an error)")
    try:
        loss, dt = _step(ctx, b)
    except BaseException:
        _free(ctx)
        raise
    b.times.append(dt)
    return {"loss": loss, "step_time_s": dt}


def bench_finish(ctx: RankContext) -> dict[str, Any]:
    """This rank's measurements since bench_setup; frees the trainer."""
    b = worker.STATE.get(STATE_KEY)
    if b is None:
        raise RuntimeError("bench_finish without a benchmark: run bench_setup first")
    try:
        return _finish(ctx, b)
    finally:
        _free(ctx)


def bench(ctx: RankContext, cfg: dict[str, Any], nvml: bool = True) -> dict[str, Any]:
    """setup + cfg["steps"] timed steps in cfg["windows"] windows + a device-time sample + finish, in one
    job: this rank's measurements."""
    try:
        b = _setup(ctx, cfg, nvml)
        _timed_windows(ctx, b)
        return _finish(ctx, b)
    finally:
        _free(ctx)


def harness_overhead(
    ctx: RankContext, cfg: dict[str, Any], steps: int, rounds: int = 3, warmup: int = 2
) -> dict[str, Any]:
    """Throughput of the `single` Trainer.step loop against a hand-written loop, same process, same data.

    The bare loop is what a user writes: forward, token-mean cross-entropy, backward (scaled for
    accumulation), torch.optim.AdamW of the implementation the harness resolved (fused on GPU), zero_grad;
    neither loop synchronizes inside its timed loop. Both train their own
    copy of the same model on the same `steps` steps of data, in `rounds` rounds whose order alternates
    (bare first, then harness first, ...) so clock and thermal drift cancel. overhead = median over rounds
    of harness time / bare time in that round, minus 1 (positive: the harness is slower); pairing within a
    round keeps slow drift out of the ratio. `first_step_loss` must agree between the two (same weights,
    same data): it shows both loops do the same work.
    """
    if ctx.world_size != 1:
        raise ConfigError("harness_overhead compares one process with a bare loop: run it at world size 1")
    rc = RunConfig.from_dict({**cfg, "strategy": "single", "world_size": 1})
    set_numerics(rc)
    spec = get_model(rc.model)
    seq_len = rc.seq_len or spec.seq_len
    data = [rank_micro_batches(rc, s, 0, seq_len, spec.vocab_size, ctx.device) for s in range(steps)]

    bare = spec.build(rc.seed, ctx.device)
    trainer = build_trainer(ctx, rc, spec.build(rc.seed, ctx.device))
    opt = torch.optim.AdamW(bare.parameters(), lr=rc.lr, betas=rc.betas, eps=rc.eps, weight_decay=rc.weight_decay,
                            **IMPL_FLAGS[trainer.optimizer_impl])

    def amp() -> contextlib.AbstractContextManager:
        bf16 = rc.precision == "bf16"
        return torch.autocast(ctx.device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def bare_step(mbs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros((), device=ctx.device)
        for mb in mbs:
            with amp():
                out = bare(input_ids=mb["input_ids"])
            logits = out.logits if hasattr(out, "logits") else out
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), mb["labels"].reshape(-1))
            (loss / len(mbs)).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(mbs)

    loops = {
        "bare": lambda: [bare_step(mbs) for mbs in data],
        "harness": lambda: [trainer.step_async(mbs) for mbs in data],
    }
    try:
        first = {"bare": float(bare_step(data[0])), "harness": trainer.step(data[0])}
        for mbs in data[1:warmup]:
            bare_step(mbs)
            trainer.step(mbs)
        times: dict[str, list[float]] = {"bare": [], "harness": []}
        for r in range(rounds):
            for name in (("bare", "harness") if r % 2 == 0 else ("harness", "bare")):
                times[name].append(timed(ctx, loops[name])[1])
    finally:
        trainer.close()  # memory goes back when the job returns (the worker collects after every job)

    tokens = steps * rc.global_batch * seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "steps": steps,
        "rounds": [{"bare_s": b, "harness_s": h} for b, h in zip(times["bare"], times["harness"], strict=True)],
        "bare_step_time_s": med["bare"] / steps,
        "harness_step_time_s": med["harness"] / steps,
        "bare_tokens_per_s": tokens / med["bare"],
        "harness_tokens_per_s": tokens / med["harness"],
        "overhead": statistics.median(h / b for b, h in zip(times["bare"], times["harness"], strict=True)) - 1.0,
        "first_step_loss": first,
    }


# --- pytest process --------------------------------------------------------------------------------------
def result_config(cfg: RunConfig, device_type: str | None) -> dict[str, Any]:
    """The config section of a result: the RunConfig with seq_len resolved, plus device and accumulation."""
    return {
        **cfg.to_dict(),
        "seq_len": cfg.seq_len or get_model(cfg.model).seq_len,
        "accum_steps": cfg.accum_steps,
        "device": device_type,
    }


def is_oom(e: JobError) -> bool:
    """True when a rank ran out of device memory (torch's OutOfMemoryError, or NCCL failing to allocate)."""
    return any(
        o.exc_type == "OutOfMemoryError" or "CUDA out of memory" in o.text or "CUDA error: out of memory" in o.text
        for o in e.outcomes
    )


def _oom_message(e: JobError) -> str:
    ranks = [o.rank for o in e.outcomes if o.exc_type == "OutOfMemoryError" or "out of memory" in o.text]
    first = next((o.text for o in e.outcomes if "out of memory" in o.text), "")
    line = next((ln for ln in first.splitlines() if "out of memory" in ln), "out of memory")
    return f"out of device memory on rank(s) {','.join(map(str, ranks))}: {line.strip()[:300]}"


def failure_result(cfg: RunConfig, device_type: str | None, e: JobError, env: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """A result recording a configuration that failed: status "oom" or "error", and every rank's outcome."""
    oom = is_oom(e)
    per_rank = [{"rank": o.rank, "status": o.status, "exc_type": o.exc_type} for o in e.outcomes]
    return make_result(result_config(cfg, device_type), status="oom" if oom else "error",
                       error=_oom_message(e) if oom else str(e), env=env or environment_fingerprint(),
                       per_rank=per_rank)


def _aggregate_nvml(summaries: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    got = [s for s in summaries if s]
    if not got:
        return None

    def across(field_: str, stat: str, how) -> float | None:
        xs = [s[field_][stat] for s in got if s.get(field_)]
        return how(xs) if xs else None

    return {
        "throttled": any(s["throttled"] for s in got),
        "throttle_reasons": sorted({r for s in got for r in s["throttle_reasons"]}),
        "power_capped": any(s["power_capped"] for s in got),
        "gpu_util_pct_mean": across("gpu_util_pct", "mean", statistics.fmean),
        "sm_clock_mhz_median": across("sm_clock_mhz", "median", statistics.median),
        "power_w_mean": across("power_w", "mean", statistics.fmean),
        "temp_c_max": across("temp_c", "max", max),
        "per_rank": summaries,
    }


def _window_step_times(replies: list[dict[str, Any]]) -> list[float]:
    """Wall seconds per step of each timed window (the slowest rank's window), or [] without windows."""
    per_rank = [r.get("windows") or [] for r in replies]
    if not per_rank[0]:
        return []
    return [max(w[i]["wall_s"] for w in per_rank) / per_rank[0][i]["steps"] for i in range(len(per_rank[0]))]


def _device_time(replies: list[dict[str, Any]], step_time_s: float) -> dict[str, Any] | None:
    """The device-time sample across ranks: the busiest rank's figures, regime judged against the wall."""
    got = [r["device_time"] for r in replies if r.get("device_time")]
    if not got:
        return None
    out = {k: max(d[k] for d in got) for k in ("compute_s", "comm_s", "busy_s", "wall_s", "processing_s")}
    out["busy_ratio"] = min(1.0, out["busy_s"] / step_time_s)
    out["regime"] = regime(out["busy_ratio"])
    out["steps"] = got[0]["steps"]
    out["per_rank"] = got
    return out


def summarize_bench(
    cfg: RunConfig,
    replies: list[dict[str, Any]],
    *,
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A result from the per-rank replies of `bench` (or `bench_finish`); speedup and scaling efficiency need
    the other results of the matrix and come from `distbench.scaling.annotate`.

    step_time_s is the median over timed windows of the window's wall clock per step (throughput follows
    from it); the step_time_s section holds the per-step times (device events, or host time in sync mode).
    """
    r0 = replies[0]
    config = {**result_config(cfg, r0["device_type"]), "optimizer_impl": r0.get("optimizer_impl")}
    steps = per_step_max([r["step_times_s"] for r in replies])
    windows = _window_step_times(replies)
    # The steps themselves too: a 5-11% step-time CV on 4x H200 (FSDP2, ZeRO) needs them to find its pattern.
    stats = {**step_stats(steps), "steps": steps, "windows": windows}
    step_time = statistics.median(windows) if windows else stats["median"]
    metrics: dict[str, float] = {
        **throughput(cfg.global_batch, r0["seq_len"], cfg.world_size, step_time),
        "step_time_s": step_time,
    }
    host = [r for r in replies if r.get("windows")]
    if host:
        cpu = per_step_max([[c for w in r["windows"] for c in w["host_cpu_s"]] for r in host])
        metrics["host_cpu_s"] = statistics.median(cpu)
    device = _device_time(replies, step_time)
    if device:
        metrics.update(device_compute_s=device["compute_s"], device_comm_s=device["comm_s"],
                       device_busy_s=device["busy_s"], busy_ratio=device["busy_ratio"])
    fpt = r0["flops"]["flops_per_token"]
    peak = peak_flops(r0["device_name"], r0["peak_dtype"])
    metrics["tflops_per_gpu"] = tflops_per_gpu(metrics["tokens_per_s_per_gpu"], fpt)
    util = mfu(metrics["tokens_per_s_per_gpu"], fpt, peak)
    if util is not None:
        metrics["mfu"] = util
    for key in ("mem_allocated_peak_bytes", "mem_reserved_peak_bytes", "nvml_mem_used_peak_bytes"):
        vals = [r["memory"][key] for r in replies if r["memory"][key] is not None]
        if vals:
            metrics[key] = max(vals)
    nvml = _aggregate_nvml([r["nvml"] for r in replies])
    if nvml and nvml.get("sm_clock_mhz_median"):
        # Cycles per step: a clock that drifted between runs (1665-1875 MHz seen under load) cancels out.
        metrics["step_gcycles"] = step_time * nvml["sm_clock_mhz_median"] * 1e-3
    flops = {**r0["flops"], "n_params": r0["n_params"], "device_name": r0["device_name"],
             "peak_dtype": r0["peak_dtype"], "peak_flops": peak}
    per_rank = [
        {"rank": r["rank"], "step_time_s": step_stats(r["step_times_s"]), **r["memory"]} for r in replies
    ]
    return make_result(
        config, metrics=metrics, env=env, step_time_s=stats, losses=r0["losses"], nvml=nvml, flops=flops,
        per_rank=per_rank, gc=_aggregate_gc([r.get("gc") for r in replies]), device_time=device,
        regime=_regime_section(device),
    )


def _regime_section(device: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the gate needs to know about the configuration: which side bounds its step, and by what ratio."""
    if device is None:
        return None
    return {"regime": device["regime"], "busy_ratio": device["busy_ratio"],
            "rule": f"device-bound when device busy time / wall step time >= {DEVICE_BOUND_RATIO}"}


def _aggregate_gc(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Python collections in the timed window, worst rank per step (a step waits for its slowest rank)."""
    got = [g for g in per_rank if g]
    if not got:
        return None
    return {
        "collector_on": got[0]["collector_on"],
        "collections": [max(g["collections"][gen] for g in got) for gen in range(3)],
        "seconds": max(g["seconds"] for g in got),
        "step_seconds": per_step_max([g["step_seconds"] for g in got]),
    }


def run_benchmark(
    pool: Any,
    cfg: RunConfig,
    *,
    timeout: float = 1800,
    nvml: bool = True,
) -> dict[str, Any]:
    """Run `bench` on every rank of `pool` (a RankPool of cfg.world_size) and return one result.

    Out of memory on any rank gives a result with status "oom"; other failures raise JobError. After an
    OOM at world size > 1 the pool is closed (RankPool.run restarts it): ranks may have stopped at
    different collectives, leaving work queued that would desynchronise the next job.
    """
    env = environment_fingerprint()
    t0 = time.perf_counter()
    try:
        replies = pool.run(JOB, {"cfg": cfg.to_dict(), "nvml": nvml}, timeout)
    except JobError as e:
        if not is_oom(e):
            raise
        if cfg.world_size > 1:
            pool.close()
        return failure_result(cfg, getattr(pool, "device_type", None), e, env)
    wall = time.perf_counter() - t0
    result = summarize_bench(cfg, replies, env=env)
    # What a configuration costs beyond its training steps in a warm pool: build, wrap, teardown, IPC.
    steps_s = max(sum(r["step_times_s"]) + sum(r.get("warmup_step_times_s", []))
                  + (r["device_time"]["wall_s"] * r["device_time"]["steps"] if r.get("device_time") else 0.0)
                  for r in replies)
    result["wall_s"] = wall
    result["metrics"]["config_overhead_s"] = wall - steps_s
    return result


def sweep_micro_batch(pool: Any, cfg: RunConfig, sizes: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    """Benchmark increasing micro-batch sizes (global batch = micro * world_size * cfg's accumulation)
    up to and including the first that runs out of memory; kwargs go to run_benchmark."""
    results = []
    for mb in sorted(set(sizes)):
        c = cfg.replace(micro_batch=mb, global_batch=mb * cfg.world_size * cfg.accum_steps)
        results.append(run_benchmark(pool, c, **kwargs))
        if results[-1]["status"] == "oom":
            break
    return results


def trace(ctx: RankContext, cfg: dict[str, Any], out_dir: str, steps: int = 3) -> dict[str, Any]:
    """Build, warm up, then profile `steps` steps into this rank's chrome trace under `out_dir`."""
    from .trace import profile_steps

    try:
        b = _setup(ctx, cfg, nvml=False)
        profile_steps(ctx, lambda: _step(ctx, b), steps, out_dir, warmup=1)
        return {"rank": ctx.rank, "trace_dir": out_dir}
    finally:
        _free(ctx)


def run_trace(pool: Any, cfg: RunConfig, out_dir: str, *, steps: int = 3, timeout: float = 1800) -> dict[str, Any]:
    """Trace mode: profile every rank and return HolisticTraceAnalysis's breakdown per step."""
    from .trace import analyze_traces

    pool.run(f"{__name__}:trace", {"cfg": cfg.to_dict(), "out_dir": out_dir, "steps": steps}, timeout)
    return analyze_traces(out_dir, steps=steps)
