"""Trace mode: profile a few steps per rank, then break the GPU time down with HolisticTraceAnalysis.

The numbers are HTA's (PyPI `traceinsight`), not our own interval arithmetic, so they match what users get
from HTA on the same traces. HTA is an optional extra (`distbench[trace]`): it pulls in jupyterlab, which the
CPU CI tier does not install, so it is imported only inside the functions that need it.

HTA behaviour this module relies on or works around:
- HTA finds a trace's rank by scanning the file for `"rank": <n>` (the `distributedInfo` metadata) and reads
  every *.json / *.gz file in the directory, so each run needs its own directory with one file per rank.
- By default HTA drops the GPU kernels of the last ProfilerStep (the profiler may stop before they finish).
  `profile_steps` synchronizes the device before every `prof.step()`, so the last step is complete and
  `analyze_traces` keeps it (`include_last_profiler_step=True`): every profiled step counts.
- HTA rounds nanosecond timestamps to whole microseconds (ceil start, floor end) before analysis, so
  each kernel loses up to 2 us, which shows as idle where nothing else runs; kept so numbers match HTA's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distbench.errors import ConfigError, ResourceError
from distbench.runtime.context import RankContext

STATUS_NEW = "NEW"
STATUS_REMOVED = "REMOVED"
STATUS_MODIFIED = "MODIFIED"


def _trace_analysis_cls() -> Any:
    """Import HTA late: the CPU tier may not have it, and importing it costs seconds."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError as e:
        raise ResourceError(
            "trace analysis needs HolisticTraceAnalysis (PyPI package `traceinsight`), which is not "
            f"installed ({e}); install it with: pip install 'distbench[trace]'"
        ) from e
    return TraceAnalysis


def trace_file_name(rank: int) -> str:
    """One file per rank, so a rerun into the same directory replaces its own trace instead of adding one."""
    return f"rank{rank}.pt.trace.json.gz"


def profile_steps(
    ctx: RankContext,
    step_fn: Callable[[], Any],
    steps: int,
    out_dir: str,
    warmup: int = 1,
) -> str:
    """Run `warmup` unrecorded then `steps` recorded calls of `step_fn` under torch.profiler; return out_dir.

    Writes this rank's chrome trace to `out_dir/rank<r>.pt.trace.json.gz`. The device is synchronized
    before profiling and after every step, so no earlier work leaks into the first step and every kernel of
    the last step is in the trace.
    """
    if steps < 1:
        raise ConfigError(f"trace mode needs at least one profiled step, got steps={steps}")
    if warmup < 0:
        raise ConfigError(f"warmup must be >= 0, got {warmup}")
    from torch.profiler import ProfilerActivity, profile, schedule

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, trace_file_name(ctx.rank))
    activities = [ProfilerActivity.CPU]
    if ctx.is_cuda:
        activities.append(ProfilerActivity.CUDA)

    ctx.synchronize()
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(path),
    ) as prof:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # torch writes distributedInfo only for an initialized process group; HTA needs it to find ranks.
            prof.add_metadata_json(
                "distributedInfo",
                json.dumps({"backend": ctx.backend, "rank": ctx.rank, "world_size": ctx.world_size}),
            )
        for _ in range(warmup + steps):
            step_fn()
            ctx.synchronize()
            prof.step()
    return out_dir


def analyze_traces(trace_dir: str, steps: int | None = None) -> dict[str, Any]:
    """Temporal breakdown, comm-compute overlap and kernel table of one run's traces, per rank and averaged.

    Times are in ms (kernel table in us) per profiled step when `steps` is given, else totals over the
    trace. Percentages are HTA's per rank, averaged over ranks. Exposed communication follows seed 004:
    communication kernel time x (1 - overlap). `host_wait_ms` is HTA's host-wait idle time of the compute
    stream: the GPU waiting for the host to launch, what a launch-bound step loses. `top_kernels` lists every kernel, largest total first,
    averaged over ranks, so that `kernel_diff` sees kernels that are small in one run.
    """
    if steps is not None and steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    analysis = _trace_analysis(trace_dir)
    trace = analysis.t
    ranks = sorted(trace.traces)
    div = float(steps or 1)
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    _, kernels = analysis.get_gpu_kernel_breakdown(
        visualize=False, duration_ratio=1.0, num_kernels=1 << 30, include_memory_kernels=True
    )
    idle, _ = analysis.get_idle_time_breakdown(ranks=ranks, visualize=False)
    sym = trace.symbol_table.get_sym_table()
    per_rank: dict[str, dict[str, Any]] = {}
    kernel_rows: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        rk = kernels[kernels["rank"].eq(rank)]
        comm_us = float(rk.loc[rk["kernel_type"].eq("COMMUNICATION"), "sum (us)"].sum())
        df = trace.traces[rank]
        per_rank[str(rank)] = _rank_breakdown(
            temporal.loc[rank], _num(overlap.loc[rank, "comp_comm_overlap_pctg"]), comm_us, div
        )
        per_rank[str(rank)]["host_wait_ms"] = _host_wait_us(idle, rank, _compute_stream(df, sym)) / 1e3 / div
        # HTA's breakdown gives sum and mean but no count; count the same kernels (stream != -1) HTA summed.
        counts = {sym[i]: int(c) for i, c in df.loc[df["stream"].ne(-1), "name"].value_counts().items()}
        for name, ktype, total in zip(rk["name"], rk["kernel_type"], rk["sum (us)"], strict=True):
            k = kernel_rows.setdefault(name, {"name": name, "type": ktype, "total_us": 0.0, "count": 0.0})
            k["total_us"] += float(total) / div
            k["count"] += float(counts.get(name, 0)) / div
    overlaps = [r["overlap_pct"] for r in per_rank.values() if r["overlap_pct"] is not None]
    return {
        "ranks": ranks,
        "steps": steps,
        "per_rank": per_rank,
        **{key: _mean(r[key] for r in per_rank.values()) for key in _AVERAGED},
        "overlap_pct": _mean(overlaps) if overlaps else None,
        "top_kernels": _top_kernels(kernel_rows, len(ranks)),
    }


_AVERAGED = (
    "idle_ms",
    "compute_ms",
    "non_compute_ms",
    "kernel_ms",
    "idle_pct",
    "compute_pct",
    "non_compute_pct",
    "comm_ms",
    "exposed_comm_ms",
    "host_wait_ms",
)


def _compute_stream(df: Any, sym: list[str]) -> int:
    """The stream that ran the most kernel time outside NCCL: the one the training thread feeds."""
    from .devicetime import is_comm_kernel

    gpu = df[df["stream"].ne(-1)]
    own = gpu[[not is_comm_kernel(sym[i]) for i in gpu["name"]]]
    return int(own.groupby("stream")["dur"].sum().idxmax())


def _host_wait_us(idle: Any, rank: int, stream: int) -> float:
    """HTA's "host wait" idle time of `stream` on `rank`: the GPU idle because the host had not yet launched
    the next kernel (HTA's idle time breakdown)."""
    rows = idle[idle["rank"].eq(rank) & idle["stream"].eq(stream) & idle["idle_category"].eq("host_wait")]
    return float(rows["idle_time"].sum())


def _trace_analysis(trace_dir: str) -> Any:
    """HTA's TraceAnalysis of the traces in `trace_dir`, once every rank's trace is known to hold GPU kernels."""
    if not any(p.name.endswith((".json", ".gz")) for p in Path(trace_dir).glob("*")):
        raise FileNotFoundError(f"no trace files (*.json, *.gz) in {trace_dir}")
    TraceAnalysis = _trace_analysis_cls()
    analysis = TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)
    for rank, df in analysis.t.traces.items():
        if not df["stream"].ne(-1).any():
            raise ConfigError(
                f"the trace of rank {rank} in {trace_dir} has no GPU kernels; trace analysis needs a CUDA "
                "run profiled with ProfilerActivity.CUDA"
            )
    return analysis


def _rank_breakdown(t: Any, overlap_pct: float | None, comm_us: float, div: float) -> dict[str, Any]:
    """One rank's row: HTA's temporal breakdown `t` in ms per step, its overlap, and the exposed communication."""
    return {
        "idle_ms": float(t["idle_time(us)"]) / 1e3 / div,
        "compute_ms": float(t["compute_time(us)"]) / 1e3 / div,
        "non_compute_ms": float(t["non_compute_time(us)"]) / 1e3 / div,
        "kernel_ms": float(t["kernel_time(us)"]) / 1e3 / div,
        "idle_pct": float(t["idle_time_pctg"]),
        "compute_pct": float(t["compute_time_pctg"]),
        "non_compute_pct": float(t["non_compute_time_pctg"]),
        "overlap_pct": overlap_pct,
        "comm_ms": comm_us / 1e3 / div,
        "exposed_comm_ms": comm_us / 1e3 / div * (1.0 - (overlap_pct or 0.0) / 100.0),
    }


def _top_kernels(kernel_rows: dict[str, dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The kernels summed over `n` ranks, averaged per rank, largest total first."""
    top = []
    for k in kernel_rows.values():
        total, count = k["total_us"] / n, k["count"] / n
        top.append({**k, "total_us": total, "count": count, "mean_us": total / count if count else 0.0})
    top.sort(key=lambda r: (-r["total_us"], r["name"]))
    return top


def _num(x: Any) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def normalize_kernel_name(name: str) -> str:
    """Kernel identity across runs: drop the leading `void ` and the trailing parameter list.

    The parameter list varies where the kernel does not, e.g. `ncclDevKernelArgsStorage<4096ul>` between
    NCCL builds; template arguments stay, since they tell different kernels apart.
    """
    s = " ".join(name.split())
    if s.startswith("void "):
        s = s[5:]
    if s.endswith(")"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                if s[:i].strip():
                    s = s[:i].rstrip()
                break
    return s


def kernel_diff(a: dict[str, Any], b: dict[str, Any], top: int = 20) -> list[dict[str, Any]]:
    """Kernels that changed from run A to run B (seed 004 section 4.5), largest |B - A| duration first.

    Status NEW: only in B; REMOVED: only in A; MODIFIED: in both with a different duration or count.
    Unchanged kernels are left out. Kernels are matched by `normalize_kernel_name`.
    """
    if (a.get("steps") is None) != (b.get("steps") is None):
        raise ValueError(
            "cannot diff a per-step analysis against a whole-trace one; pass steps to both or neither"
        )

    def by_key(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for k in res["top_kernels"]:
            key = normalize_kernel_name(k["name"])
            agg = out.setdefault(key, {"type": k["type"], "total_us": 0.0, "count": 0.0})
            agg["total_us"] += k["total_us"]
            agg["count"] += k["count"]
        return out

    ka, kb = by_key(a), by_key(b)
    rows = []
    for key in ka.keys() | kb.keys():
        ra, rb = ka.get(key), kb.get(key)
        a_us, b_us = (ra or {}).get("total_us", 0.0), (rb or {}).get("total_us", 0.0)
        a_n, b_n = (ra or {}).get("count", 0.0), (rb or {}).get("count", 0.0)
        if ra is None:
            status = STATUS_NEW
        elif rb is None:
            status = STATUS_REMOVED
        elif a_us != b_us or a_n != b_n:
            status = STATUS_MODIFIED
        else:
            continue
        rows.append(
            {
                "name": key,
                "type": (rb if rb is not None else ra or {})["type"],
                "a_us": a_us,
                "b_us": b_us,
                "diff_us": b_us - a_us,
                "a_count": a_n,
                "b_count": b_n,
                "count_change": b_n - a_n,
                "status": status,
            }
        )
    rows.sort(key=lambda r: (-abs(r["diff_us"]), r["name"]))
    return rows[:top]
