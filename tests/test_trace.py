"""Trace mode: HTA's breakdown of synthetic traces whose numbers are known by construction, and the diff.

There is no GPU here, so the HTA tests write chrome traces by hand: per rank two ProfilerSteps, each with a
GEMM and an NCCL all-reduce on separate streams that partly overlap, an elementwise kernel, a memcpy and
gaps. Per step (us, relative to the step start; span of the two steps: first kernel 100 .. last end 1900):

    rank 0: gemm 100-500, allreduce 300-600, elementwise 700-800, memcpy 850-900
    rank 1: gemm 100-550 (otherwise the same)

rank 0: busy 650/step, compute 500, idle 500 over the 1800 us span, overlap 200/300 = 66.67%
rank 1: busy 650/step, compute 550, idle 500, overlap 250/300 = 83.33%
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from distbench.errors import ConfigError, ResourceError
from distbench.measure import trace as tr
from distbench.report.trace import render_breakdown_markdown, render_kernel_diff_markdown
from distbench.runtime.context import RankContext
from extras import need

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_segment_k_off_kernel"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ALLGATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ELEMENTWISE = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)"
)
MEMCPY = "Memcpy DtoD (Device -> Device)"
COMPUTE_STREAM, NCCL_STREAM = 7, 20
STEP_US, T0 = 1000, 1000


def step_kernels(gemm_us: int, comm: str = ALLREDUCE) -> list[tuple[str, int, int, int]]:
    """(name, stream, start offset in the step, duration) of the kernels of one step."""
    return [
        (GEMM, COMPUTE_STREAM, 100, gemm_us),
        (comm, NCCL_STREAM, 300, 300),
        (ELEMENTWISE, COMPUTE_STREAM, 700, 100),
        (MEMCPY, COMPUTE_STREAM, 850, 50),
    ]


def write_trace(trace_dir: Path, rank: int, kernels: list[tuple[str, int, int, int]], steps: int = 2) -> None:
    """The fields HTA reads: distributedInfo.rank, ProfilerStep#n annotations, runtime launches and kernels
    linked by args.correlation, kernels with args.stream (CPU events have none, so HTA gives them -1)."""
    pid, tid = 4242, 4242
    events: list[dict] = []
    corr = 1
    for s in range(steps):
        t0 = T0 + s * STEP_US
        events.append(
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s + 1}", "pid": pid, "tid": tid,
             "ts": t0, "dur": 950, "args": {}}
        )  # fmt: skip
        for i, (name, stream, off, dur) in enumerate(kernels):
            launch = "cudaMemcpyAsync" if name.startswith("Memcpy") else "cudaLaunchKernel"
            cpu_ts = t0 + 10 + 20 * i
            events += [
                {"ph": "X", "cat": "cpu_op", "name": "aten::op", "pid": pid, "tid": tid, "ts": cpu_ts,
                 "dur": 15, "args": {}},
                {"ph": "X", "cat": "cuda_runtime", "name": launch, "pid": pid, "tid": tid, "ts": cpu_ts + 2,
                 "dur": 5, "args": {"correlation": corr, "cbid": 211}},
                {"ph": "X", "cat": "gpu_memcpy" if launch == "cudaMemcpyAsync" else "kernel", "name": name,
                 "pid": 0, "tid": stream, "ts": t0 + off, "dur": dur,
                 "args": {"device": 0, "stream": stream, "correlation": corr}},
            ]  # fmt: skip
            corr += 1
    trace = {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85_000_000_000}],
        "traceEvents": events,
    }
    trace_dir.mkdir(parents=True, exist_ok=True)
    (trace_dir / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace, indent=1))


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run A (all-reduce) and run B (all-gather, slower GEMM on rank 0, two memcpys per step) through HTA."""
    need("hta")
    root = tmp_path_factory.mktemp("traces")
    write_trace(root / "a", 0, step_kernels(400))
    write_trace(root / "a", 1, step_kernels(450))
    for rank, gemm_us in ((0, 500), (1, 450)):
        write_trace(root / "b", rank, step_kernels(gemm_us, ALLGATHER) + [(MEMCPY, COMPUTE_STREAM, 920, 20)])
    return {
        "a": tr.analyze_traces(str(root / "a"), steps=2),
        "b": tr.analyze_traces(str(root / "b"), steps=2),
    }


@pytest.mark.trace
def test_breakdown_matches_construction(analyzed: dict[str, dict]) -> None:
    a = analyzed["a"]
    r0, r1 = a["per_rank"]["0"], a["per_rank"]["1"]
    assert a["ranks"] == [0, 1] and a["steps"] == 2
    # per step: span 1800 us / 2 steps
    assert r0["kernel_ms"] == pytest.approx(0.9) and r1["kernel_ms"] == pytest.approx(0.9)
    assert r0["idle_ms"] == pytest.approx(0.25) and r1["idle_ms"] == pytest.approx(0.25)
    assert r0["compute_ms"] == pytest.approx(0.5) and r1["compute_ms"] == pytest.approx(0.55)
    assert r0["non_compute_ms"] == pytest.approx(0.15) and r1["non_compute_ms"] == pytest.approx(0.1)
    assert r0["compute_pct"] == pytest.approx(55.56) and r1["compute_pct"] == pytest.approx(61.11)
    assert r0["idle_pct"] == pytest.approx(27.78) and r0["non_compute_pct"] == pytest.approx(16.67)
    assert r0["overlap_pct"] == pytest.approx(66.67) and r1["overlap_pct"] == pytest.approx(83.33)
    assert r0["comm_ms"] == pytest.approx(0.3)
    assert r0["exposed_comm_ms"] == pytest.approx(0.1, abs=1e-4)
    assert r1["exposed_comm_ms"] == pytest.approx(0.05, abs=1e-4)
    # averaged over ranks
    assert a["compute_ms"] == pytest.approx(0.525)
    assert a["non_compute_ms"] == pytest.approx(0.125)
    assert a["idle_ms"] == pytest.approx(0.25)
    assert a["overlap_pct"] == pytest.approx(75.0)
    assert a["exposed_comm_ms"] == pytest.approx(0.075, abs=1e-4)
    # the compute stream (7) idles 200 us between the steps with the next GEMM not yet launched (host wait);
    # the gaps inside a step have their kernels launched already (HTA: other)
    assert r0["host_wait_ms"] == pytest.approx(0.1) and a["host_wait_ms"] == pytest.approx(0.1)
    json.dumps(a, allow_nan=False)  # goes into result files as is


@pytest.mark.trace
def test_kernel_table(analyzed: dict[str, dict]) -> None:
    top = {k["name"]: k for k in analyzed["a"]["top_kernels"]}
    assert list(top)[0] == GEMM  # largest first
    assert top[GEMM]["type"] == "COMPUTATION"
    assert top[GEMM]["total_us"] == pytest.approx(425.0)  # (400 + 450) / 2 ranks, per step
    assert top[GEMM]["count"] == pytest.approx(1.0)
    assert top[GEMM]["mean_us"] == pytest.approx(425.0)
    assert top[ALLREDUCE]["type"] == "COMMUNICATION" and top[ALLREDUCE]["total_us"] == pytest.approx(300.0)
    assert top[MEMCPY]["type"] == "MEMORY" and top[MEMCPY]["total_us"] == pytest.approx(50.0)
    assert top[ELEMENTWISE]["type"] == "COMPUTATION"


@pytest.mark.trace
def test_kernel_diff_statuses(analyzed: dict[str, dict]) -> None:
    rows = {r["name"]: r for r in tr.kernel_diff(analyzed["a"], analyzed["b"])}
    allgather = tr.normalize_kernel_name(ALLGATHER)
    allreduce = tr.normalize_kernel_name(ALLREDUCE)
    assert rows[allgather]["status"] == tr.STATUS_NEW
    assert rows[allgather]["b_us"] == pytest.approx(300.0) and rows[allgather]["count_change"] == 1
    assert rows[allreduce]["status"] == tr.STATUS_REMOVED and rows[allreduce]["diff_us"] == pytest.approx(
        -300
    )
    assert rows[GEMM]["status"] == tr.STATUS_MODIFIED
    assert rows[GEMM]["diff_us"] == pytest.approx(50.0) and rows[GEMM]["count_change"] == 0
    memcpy = tr.normalize_kernel_name(MEMCPY)
    assert rows[memcpy]["status"] == tr.STATUS_MODIFIED and rows[memcpy]["count_change"] == pytest.approx(1)
    assert tr.normalize_kernel_name(ELEMENTWISE) not in rows  # unchanged
    assert [abs(r["diff_us"]) for r in rows.values()] == sorted(
        (abs(r["diff_us"]) for r in rows.values()), reverse=True
    )

    md = render_kernel_diff_markdown(tr.kernel_diff(analyzed["a"], analyzed["b"]), "DDP", "FSDP_FULL")
    assert "| Operation | DDP Duration (us) | FSDP_FULL Duration (us) |" in md
    assert f"| `{allgather}` | 0 | 300 | +300 | 0→1 (+1) | NEW |" in md


@pytest.mark.trace
def test_render_breakdown(analyzed: dict[str, dict]) -> None:
    md = render_breakdown_markdown({"DDP": analyzed["a"], "FSDP_FULL": analyzed["b"]})
    assert "| Strategy | Idle Time (ms) | Compute Time (ms) |" in md
    ddp = next(line for line in md.splitlines() if line.startswith("| DDP | 0.25 |")).split(" | ")
    assert ddp[4:6] == ["0.90", "27.78%"]  # kernel time per step, idle %
    assert "| DDP | 75.00% | 0.30 |" in md
    assert "| FSDP_FULL | 91.66% |" in md  # (100 + 83.33) / 2


def test_normalize_kernel_name() -> None:
    assert tr.normalize_kernel_name(ALLREDUCE) == "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    other_build = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<8192ul>)"
    assert tr.normalize_kernel_name(other_build) == tr.normalize_kernel_name(ALLREDUCE)
    assert tr.normalize_kernel_name(ELEMENTWISE) == (
        "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    )
    cat = "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>(int*)"
    assert tr.normalize_kernel_name(cat) == (
        "at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>"
    )
    assert tr.normalize_kernel_name(GEMM) == GEMM


def test_kernel_diff_needs_same_normalization() -> None:
    run = {"steps": 2, "top_kernels": []}
    with pytest.raises(ValueError, match="per-step"):
        tr.kernel_diff(run, {**run, "steps": None})


def test_missing_hta_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_trace(tmp_path, 0, step_kernels(400))
    monkeypatch.setitem(__import__("sys").modules, "hta.trace_analysis", None)
    with pytest.raises(ResourceError, match=r"pip install 'distbench\[trace\]'"):
        tr.analyze_traces(str(tmp_path))


def profiled(tmp_path: Path) -> tuple[str, Path]:
    """A rank's trace of two profiled steps (after one warm-up) as profile_steps writes it: its folder and file."""
    import torch

    ctx = RankContext(rank=3, world_size=4, local_rank=3, device=torch.device("cpu"), backend="gloo")
    x = torch.randn(32, 32)
    calls = []
    out = tr.profile_steps(ctx, lambda: calls.append(x @ x), steps=2, out_dir=str(tmp_path / "t"), warmup=1)
    assert len(calls) == 3
    return out, Path(out) / tr.trace_file_name(3)


def test_profile_steps_writes_the_ranks_trace(tmp_path: Path) -> None:
    _, path = profiled(tmp_path)
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    assert trace["distributedInfo"]["rank"] == 3
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"]) == 2


@pytest.mark.trace
def test_hta_finds_the_ranks_trace_and_a_cpu_trace_is_refused(tmp_path: Path) -> None:
    out, path = profiled(tmp_path)
    get_trace_files = need("hta.common.trace_file").get_trace_files
    assert get_trace_files(out) == {3: str(path)}
    with pytest.raises(ConfigError, match="no GPU kernels"):
        tr.analyze_traces(out, steps=2)


def test_kernel_diff_markdown_keeps_both_ends_of_long_names() -> None:
    name = "at::native::multi_tensor_apply_kernel<" + "x" * 300 + ", at::native::LerpFunctor<float>, float>"
    row = {"name": name, "a_us": 1.0, "b_us": 2.0, "diff_us": 1.0, "a_count": 1, "b_count": 1, "count_change": 0,
           "status": tr.STATUS_MODIFIED}  # fmt: skip
    cell = render_kernel_diff_markdown([row], "A", "B").splitlines()[2].split(" | ")[0]
    assert cell.startswith("| `at::native::multi_tensor_apply_kernel<") and cell.endswith(
        "LerpFunctor<float>, float>`"
    )
    assert len(cell) == len("| ``") + 100
