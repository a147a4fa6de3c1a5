"""report.md has the seed-004 tables with the right rows and values; figures are written."""

from __future__ import annotations

import argparse

import pytest

from distbench.commands import report as report_cmd
from distbench.report import job_summary_markdown, write_report
from distbench.results import make_result, save_result

GIB = 1024**3
WORKLOAD = {"model": "gpt2-large", "precision": "bf16", "seq_len": 1024, "global_batch": 32, "micro_batch": 8}
ENV = {
    "gpu_model": "NVIDIA H200",
    "gpu_count": 2,
    "torch": "2.11.0",
    "cuda": "13.0",
    "git_commit": "0123456789abcdef",
}
# (strategy, world size, tokens/s, peak allocated GiB) in the spirit of seed 004
RUNS = [
    ("single", 1, 32582, 12.0),
    ("ddp", 2, 62870, 12.0),
    ("fsdp_full", 2, 62244, 4.0),
    ("fsdp_grad", 2, 62495, 8.0),
]
TRACE = {
    "fsdp_grad": {
        "compute_ms": 6828.7,
        "non_compute_ms": 87.1,
        "idle_ms": 72.6,
        "compute_pct": 97.71,
        "non_compute_pct": 1.25,
        "idle_pct": 1.04,
        "overlap_pct": 98.06,
        "exposed_comm_ms": 1.7,
    }
}


def result(strategy, ws, tps, mem_gib, *, throttled=False, cfg=None):
    st = 32 * 1024 / tps
    return make_result(
        {"strategy": strategy, "world_size": ws, **(cfg or WORKLOAD)},
        metrics={
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / ws,
            "step_time_s": st,
            "mfu": 0.45,
            "mem_allocated_peak_bytes": mem_gib * GIB,
            "mem_reserved_peak_bytes": (mem_gib + 1) * GIB,
            "nvml_mem_used_peak_bytes": (mem_gib + 2) * GIB,
        },
        env=ENV,
        step_time_s={"median": st, "p10": st * 0.98, "p90": st * 1.02, "mean": st, "std": 0.0, "n": 20},
        nvml={"throttled": throttled},
        trace=TRACE.get(strategy),
    )


def results():
    out = [result(*r) for r in RUNS]
    out.append(result("ddp", 2, 60000, 12.0, throttled=True))  # a second ddp run: median of two
    out.append(
        make_result(
            {"strategy": "ddp", "world_size": 8, **WORKLOAD},
            status="oom",
            error="CUDA out of memory",
            env=ENV,
        )
    )
    return out


def table_rows(md: str, header_start: str) -> list[list[str]]:
    lines = md.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_write_report_tables_and_figures(tmp_path):
    path = write_report(results(), tmp_path)
    md = path.read_text()
    assert path == tmp_path / "report.md"
    assert "2x NVIDIA H200" in md and "torch 2.11.0" in md and "commit 0123456789ab" in md
    assert "## gpt2-large · precision bf16 · seq 1024 · global batch 32 · micro-batch 8" in md

    rows = {(r[0], r[1]): r for r in table_rows(md, "| Strategy | GPUs | Runs | Tokens/s")}
    assert set(rows) == {("single", "1"), ("ddp", "2"), ("fsdp_full", "2"), ("fsdp_grad", "2")}
    ddp = rows[("ddp", "2")]
    assert ddp[2] == "2" and ddp[3] == f"{(62870 + 60000) / 2:,.0f}"  # median of the two runs
    fsdp_grad = rows[("fsdp_grad", "2")]
    assert fsdp_grad[3] == "62,495" and fsdp_grad[4] == "31,248"
    assert fsdp_grad[5] == f"{62495 / 32582:.2f}x"  # speedup vs the single-GPU baseline: 1.92x
    assert fsdp_grad[6] == f"{62495 / 32582 / 2:.1%}"
    st = 32 * 1024 / 62495 * 1000
    assert fsdp_grad[7] == f"{st:.1f} [{st * 0.98:.1f}–{st * 1.02:.1f}]"
    assert fsdp_grad[8] == "45.0%" and fsdp_grad[9] == "no"
    assert ddp[9] == "**yes** (1/2)"
    assert rows[("single", "1")][5] == "1.00x"

    mem = {(r[0], r[1]): r for r in table_rows(md, "| Strategy | GPUs | Peak allocated")}
    assert mem[("fsdp_full", "2")][2:] == ["4.00 GiB", "5.00 GiB", "6.00 GiB"]

    trace = table_rows(md, "| Strategy | GPUs | Compute ms")
    assert trace == [["fsdp_grad", "2", "6828.7", "87.1", "72.6", "97.71", "1.25", "1.04", "98.06", "1.7"]]

    failed = table_rows(md, "| Config | Status | Error")
    assert failed == [["ddp ws8 gpt2-large bf16 s1024 gb32 mb8", "oom", "CUDA out of memory"]]

    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert [p.split("-")[0] for p in pngs] == ["breakdown", "memory", "throughput"]
    for name in pngs:
        assert (tmp_path / name).stat().st_size > 1000
        assert f"]({name})" in md


def test_one_table_per_workload_and_no_trace_table_without_traces(tmp_path):
    small = dict(WORKLOAD, model="gpt2-tiny", seq_len=32, global_batch=8, micro_batch=2)
    rs = [result("ddp", ws, 1000.0 * ws, 0.1, cfg=small) for ws in (1, 2)]
    md = write_report(rs + [result(*RUNS[0])], tmp_path).read_text()
    assert md.count("### Throughput and scaling") == 2
    assert md.count("### Trace breakdown") == 0
    rows = {(r[0], r[1]): r for r in table_rows(md, "| Strategy | GPUs | Runs | Tokens/s")}
    assert rows[("ddp", "2")][5] == "2.00x"  # no `single` run: baseline is ddp on 1 GPU
    assert not list(tmp_path.glob("breakdown-*.png"))


def test_no_memory_figure_without_device_memory(tmp_path):
    """CPU runs measure no device memory: the report says so in its table and draws no empty figure."""
    small = dict(WORKLOAD, model="gpt2-tiny", seq_len=32, global_batch=8, micro_batch=2)
    rs = [result("ddp", ws, 1000.0 * ws, 0.1, cfg=small) for ws in (1, 2)]
    for r in rs:
        for m in ("mem_allocated_peak_bytes", "mem_reserved_peak_bytes", "nvml_mem_used_peak_bytes"):
            r["metrics"].pop(m, None)
    write_report(rs, tmp_path)
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.png")] == ["throughput"]


def test_a_failed_runs_traceback_stays_in_its_row(tmp_path):
    """A rank's traceback spans lines; the failures table keeps one row per run, led by the summary line."""
    error = (
        "job failed at world size 2: rank 0,1 raised RuntimeError\n===== rank 0: error =====\nTraceback ..."
    )
    failed = make_result(
        {"strategy": "ddp", "world_size": 2, **WORKLOAD}, status="error", error=error, env=ENV
    )
    md = write_report([result(*RUNS[0]), failed], tmp_path).read_text()
    table = md.split("## Failed runs")[1].strip().splitlines()
    assert len(table) == 3 and all(line.startswith("|") and line.endswith("|") for line in table)
    rows = table_rows(md, "| Config | Status | Error |")
    assert [r[1:] for r in rows] == [["error", "job failed at world size 2: rank 0,1 raised RuntimeError"]]


def test_job_summary(tmp_path):
    md = job_summary_markdown(results())
    assert md.startswith("## distbench: 5/6 runs ok")
    assert "| fsdp_grad | 2 |" in md and "CUDA out of memory" in md


def test_report_command_writes_report_and_summary(tmp_path, monkeypatch):
    for i, r in enumerate(results()):
        r["id"] += f"-{i}"  # ids have one-second resolution; these runs were made in the same second
        save_result(r, tmp_path / "results")
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    args = argparse.Namespace(results=[tmp_path / "results"], out=tmp_path / "out", github_summary=True)
    assert report_cmd.run(args) == 0
    assert (tmp_path / "out" / "report.md").exists()
    assert "distbench: 5/6 runs ok" in summary.read_text()
    args.results = [tmp_path / "missing"]
    assert report_cmd.run(args) == 2


def test_report_spread_and_kernel_diff(tmp_path):
    """Repeated runs get their run-to-run CV; traced strategies get seed 004's kernel diff against DDP."""

    def kernels(*rows):
        return [{"name": n, "type": t, "total_us": us, "count": c} for n, t, us, c in rows]

    def traced(strategy, top):
        r = result(strategy, 2, 62000, 8.0)
        r["trace"] = {**TRACE["fsdp_grad"], "steps": 3, "top_kernels": top}
        return r

    gemm = ("sm90_gemm_bf16", "COMPUTATION", 5000.0, 30)
    runs = [
        traced("ddp", kernels(gemm, ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "COMMUNICATION", 600.0, 3))),
        traced("fsdp_full", kernels(gemm, ("ncclDevKernel_AllGather_RING_LL", "COMMUNICATION", 900.0, 6))),
    ]
    runs += [result("zero2", 2, tps, 8.0) for tps in (100.0, 110.0, 90.0)]
    md = write_report(runs, tmp_path).read_text()

    diff = {r[0]: r for r in table_rows(md, "| Operation | ddp Duration (us) | fsdp_full")}
    assert set(diff) == {"`ncclDevKernel_AllGather_RING_LL`", "`ncclDevKernel_AllReduce_Sum_f32_RING_LL`"}
    assert diff["`ncclDevKernel_AllGather_RING_LL`"][-1] == "NEW"
    assert diff["`ncclDevKernel_AllReduce_Sum_f32_RING_LL`"][-1] == "REMOVED"

    spread = table_rows(md, "| Strategy | GPUs | Separate runs")
    assert spread == [["zero2", "2", "3", "90", "100", "110", "10.00%"]]


SMALL = dict(WORKLOAD, model="gpt2-tiny", precision="fp32", seq_len=32, global_batch=4, micro_batch=2)


def cpu_run(tps: dict[tuple[str, int], float]) -> list[dict]:
    """`distbench run`'s CPU results: no MFU, no device memory, speedups and warnings annotated as the matrix
    does."""
    from distbench import plausibility, scaling

    out = []
    for (strategy, ws), t in tps.items():
        r = result(strategy, ws, t, 0.0, cfg={**SMALL, "device": "cpu"})
        for m in ("mfu", "mem_allocated_peak_bytes", "mem_reserved_peak_bytes", "nvml_mem_used_peak_bytes"):
            r["metrics"].pop(m)
        r["losses"] = [6.2, 6.1295]
        out.append(r)
    scaling.annotate(out)
    plausibility.annotate(out)
    return out


#: single and ddp on 1 rank, ddp 8x faster on 2: superlinear, flagged (the issue's CPU run)
SUPERLINEAR = {("single", 1): 100.0, ("ddp", 1): 95.0, ("ddp", 2): 807.0}


def drawn_throughput(results, tmp_path, monkeypatch):
    """The throughput figure's axes, kept open."""
    from distbench.plausibility import check
    from distbench.report import plots
    from distbench.report.tables import cells_by_workload

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    (cells,) = cells_by_workload(results).values()
    plots.throughput_plot(cells, tmp_path / "t.png", check(results))
    return figs[0].axes[0]


def test_flagged_points_are_hollow_off_their_line_and_every_point_has_its_spread(tmp_path, monkeypatch):
    results = cpu_run(SUPERLINEAR)
    ax = drawn_throughput(results, tmp_path, monkeypatch)
    (ddp_line,) = [ln for ln in ax.lines if ln.get_label() == "ddp"]
    assert list(ddp_line.get_xdata()) == [1]  # ws2 is no result: no line runs to it
    points = {
        (ln.get_color(), float(ln.get_xdata()[0])): ln.get_markerfacecolor()
        for ln in ax.lines
        if len(ln.get_xdata()) == 1 and ln.get_marker() == "o" and not ln.get_label().startswith("ddp")
    }
    ddp = ddp_line.get_color()
    assert points[(ddp, 2.0)] == "white" and points[(ddp, 1.0)] == ddp  # flagged hollow, the sound one solid
    assert "flagged: not a result" in [t.get_text() for t in ax.get_legend().get_texts()]
    # a bar per point, from the tokens/s of its p90 step time to that of its p10
    bars = [c for c in ax.containers if len(c.lines[0].get_xdata()) == 1]
    assert len(bars) == 3
    (bar,) = [c for c in bars if c.lines[0].get_xdata()[0] == 2]
    lo, hi = bar.lines[2][0].get_segments()[0][:, 1]
    assert (lo, hi) == pytest.approx((807 / 1.02, 807 / 0.98))


def test_cpu_runs_are_labelled_cpu(tmp_path, monkeypatch):
    results = cpu_run({("single", 1): 6300.0, ("ddp", 1): 6200.0, ("ddp", 2): 11000.0})
    assert drawn_throughput(results, tmp_path, monkeypatch).get_xlabel() == "CPU ranks"
    md = write_report(results, tmp_path).read_text()
    assert table_rows(
        md, "| Strategy | CPU ranks | Runs | Tokens/s | Tokens/s/CPU rank | Speedup vs 1 CPU rank"
    )
    assert "![Throughput vs CPU rank count]" in md
    assert "GPU" not in md  # its prose, headers and captions; no memory table either


def test_the_console_table_fits_100_columns_and_leaves_out_what_is_not_measured():
    from rich.console import Console

    from distbench.report.tables import CONSOLE_WIDTH, results_table
    from distbench.strategies import default_strategies

    def render(results) -> list[str]:
        console = Console(width=300)
        with console.capture() as out:
            console.print(results_table(results))
        return out.get().rstrip().splitlines()

    cpu = cpu_run(
        {(s, ws): 6000.0 * ws for s in default_strategies("cpu") for ws in (1, 2) if ws == 1 or s != "single"}
    )
    cpu[-1]["warnings"] = ["a figure the checks reject"]
    lines = render(cpu)
    assert max(map(len, lines)) <= CONSOLE_WIDTH
    head = "\n".join(lines[: next(i for i, line in enumerate(lines) if "───" in line)])
    assert "step ms" in head and "MFU" not in head and "GiB" not in head  # CPU runs measure neither
    assert "No values in these runs: MFU, peak GiB." in [line.strip() for line in lines]
    st = cpu[0]["step_time_s"]["median"] * 1000
    assert any(f"{st:.0f} [{st * 0.98:.0f}-{st * 1.02:.0f}]" in line for line in lines)  # ms, 3 digits
    # the default GPU run (gpt2-124m, up to 8 GPUs) keeps MFU and memory and still fits
    gpu = [
        result(s, ws, 150_000.0 * ws, 2.1)
        for s in default_strategies("cuda")
        for ws in (1, 2, 4, 8)
        if ws == 1 or s != "single"
    ]
    from distbench import scaling

    scaling.annotate(gpu)
    for r in gpu:
        r["losses"] = [6.2, 6.1295]
        r["loss"] = {"step": 17, "value": 6.1295}
    gpu[-1]["warnings"] = ["one", "two"]
    lines = render(gpu)
    assert max(map(len, lines)) <= CONSOLE_WIDTH
    # measured side by side: each figure with its interval, a note on some rows, and still within the width
    for r in gpu:
        st = r["metrics"]["step_time_s"]
        r["step_time_s"]["interval"] = [st * 0.88, st * 1.12]
        r["side_by_side"] = {"mode": "all", "rounds": 6, "reference": "single ws1 gpt2-124m bf16-amp mb8",
                             "vs_reference": {"estimate": -0.125, "low": -0.3, "high": 0.25, "n": 6}}  # fmt: skip
        r["notes"] = ["a note", "another"]
    scaling.annotate(gpu)
    lines = render(gpu)
    assert max(map(len, lines)) <= CONSOLE_WIDTH
    assert any("±14%" in line and "±43%" in line for line in lines)  # the larger half of each interval
    assert any("step 17" in line for line in lines)
    assert any("MFU" in line and "alloc/resv/nvml" in line for line in lines)
