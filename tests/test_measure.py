"""Measurement: statistics, FLOPs/MFU, bus bandwidth, NVML summaries, fingerprint, and the benchmark jobs on CPU.

GPU paths (NVML readings, CUDA memory peaks) are exercised here through a fake NVML module; the real ones
run in the GPU tier.
"""

from __future__ import annotations

import gc
import json
import math
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distbench.config import RunConfig
from distbench.jobs import bench as bm
from distbench.matrix import run_benchmark, sweep_micro_batch
from distbench.measure import busbw, mfu, nvml
from distbench.measure.memory import memory_stats, reset_peaks
from distbench.measure.pygc import GcWatch
from distbench.measure.timing import per_step_max, percentile, step_stats, throughput
from distbench.metrics import METRICS
from distbench.results import SCHEMA, load_results, save_result
from distbench.runtime import worker
from distbench.runtime.context import RankContext
from distbench.runtime.fingerprint import environment_fingerprint, git_state, relevant_env
from distbench.runtime.pool import JobError, RankOutcome, RankPool
from distbench.workloads.models import count_params, get_model

CPU = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
TINY = {
    "strategy": "single",
    "model": "gpt2-tiny",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 3,
    "warmup": 2,
}


# --- timing ----------------------------------------------------------------------------------------------
def test_step_stats_match_hand_computed_values():
    s = step_stats([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median"] == 3.0 and s["n"] == 5
    assert s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(4.6)  # numpy's linear interpolation
    assert s["mean"] == 3.0
    assert s["std"] == pytest.approx(math.sqrt(2.5))  # sample std, n-1
    assert s["cv"] == pytest.approx(math.sqrt(2.5) / 3.0)
    assert step_stats([0.5])["std"] == 0.0
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="no timed steps"):
        step_stats([])


def test_a_step_lasts_as_long_as_its_slowest_rank():
    assert per_step_max([[1.0, 2.0, 3.0], [1.5, 1.0, 3.5]]) == [1.5, 2.0, 3.5]
    with pytest.raises(ValueError, match="different numbers of steps"):
        per_step_max([[1.0], [1.0, 2.0]])


def test_throughput_global_and_per_gpu():
    t = throughput(global_batch=32, seq_len=1024, world_size=2, step_time_s=0.5)
    assert t == {
        "tokens_per_s": 65536.0,
        "tokens_per_s_per_gpu": 32768.0,
        "samples_per_s": 64.0,
        "samples_per_s_per_gpu": 32.0,
    }
    with pytest.raises(ValueError):
        throughput(8, 32, 1, 0.0)


# --- FLOPs and MFU ---------------------------------------------------------------------------------------
def test_flops_per_token_formula_by_hand():
    # 6N + 12*L*H*S with N=1000, L=2, H=64, S=32: 6000 + 12*2*64*32 = 6000 + 49152
    assert mfu.flops_per_token(1000, 2, 64, 32) == 55152.0
    assert mfu.flops_per_token(1000, None, None, 32) == 6000.0  # attention term needs L and H


def test_n_counts_tied_lm_head_but_not_lookup_only_tables():
    model = get_model("gpt2-tiny").build(0)
    # GPT-2 ties wte to lm_head (a matmul, kept); wpe (64 positions x 64 wide) is only looked up.
    assert mfu.matmul_params(model) == count_params(model) - 64 * 64
    f = mfu.model_flops(model, 32)
    assert (f["layers"], f["hidden"]) == (2, 64)
    assert f["flops_per_token"] == 6 * (count_params(model) - 4096) + 12 * 2 * 64 * 32

    untied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    assert mfu.matmul_params(untied) == 4 * 10 + 10  # the untied input embedding does no multiply-adds
    assert mfu.model_dims(untied) == (None, None)


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA GH200 480GB", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
    ],
)
def test_peak_table_lookup(name, dtype, tflops):
    assert mfu.peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", [None, "", "NVIDIA GeForce GTX 1080", "NVIDIA H100", "NVIDIA A10G"])
def test_unknown_gpu_has_no_peak(name):
    assert mfu.peak_flops(name, "bf16") is None


def test_mfu_and_tflops_per_gpu():
    assert mfu.tflops_per_gpu(1000.0, 1e9) == pytest.approx(1.0)
    assert mfu.mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert mfu.mfu(1000.0, 1e9, None) is None
    assert mfu.peak_dtype("bf16") == mfu.peak_dtype("fp16") == "bf16"


# --- collective bandwidth --------------------------------------------------------------------------------
def test_busbw_follows_nccl_tests_convention():
    assert busbw.bus_factor("all_reduce", 2) == 1.0
    assert busbw.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert busbw.bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert busbw.bus_factor("reduce_scatter", 8) == pytest.approx(0.875)
    # 1 GB all-reduce in 10 ms over 8 ranks: algbw 100 GB/s, busbw 175 GB/s
    assert busbw.algbw_gbps(10**9, 0.01) == pytest.approx(100.0)
    assert busbw.busbw_gbps("all_reduce", 10**9, 0.01, 8) == pytest.approx(175.0)
    with pytest.raises(ValueError, match="unknown collective"):
        busbw.bus_factor("broadcast", 2)


def test_ring_ceiling_only_for_nvlink4_sxm_parts():
    assert busbw.ring_ceiling_gbps("NVIDIA H100 80GB HBM3") == 365.0
    assert busbw.ring_ceiling_gbps("NVIDIA H200") == 365.0
    assert busbw.ring_ceiling_gbps("NVIDIA H100 PCIe") is None
    assert busbw.ring_ceiling_gbps(None) is None


@pytest.fixture
def single_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield CPU
    dist.destroy_process_group()


def test_collective_bandwidth_single_rank_gloo(single_rank_gloo):
    out = busbw.bandwidth_table(
        single_rank_gloo, sizes_bytes=[1000, 4096], iters=2, warmup=1, ceiling_gbps=100.0
    )
    assert (out["backend"], out["world_size"], out["dtype"]) == ("gloo", 1, "fp32")
    assert [(r["op"], r["size_bytes"]) for r in out["results"]] == [
        (op, size) for op in busbw.OPS for size in (1000, 4096)
    ]
    for r in out["results"]:
        assert r["time_s"] > 0 and r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == 0.0 and r["fraction_of_ceiling"] == 0.0  # one rank moves nothing over links


@pytest.mark.slow
def test_collective_bandwidth_two_gloo_ranks():
    pool = RankPool(2, "cpu")
    try:
        out = pool.run(bm.collective_bandwidth, {"sizes_bytes": [4096], "iters": 3, "warmup": 1}, timeout=120)
    finally:
        pool.close()
    assert out[0] == out[1]  # times are the max over ranks, so every rank reports the same table
    by_op = {r["op"]: r for r in out[0]["results"]}
    assert set(by_op) | {s["op"] for s in out[0]["skipped"]} == set(busbw.OPS)
    assert by_op["all_reduce"]["busbw_gbps"] == pytest.approx(
        by_op["all_reduce"]["algbw_gbps"]
    )  # 2(n-1)/n = 1
    assert by_op["all_gather"]["busbw_gbps"] == pytest.approx(by_op["all_gather"]["algbw_gbps"] / 2)
    assert out[0]["ceiling_gbps"] is None


# --- NVML and memory -------------------------------------------------------------------------------------
def test_nvml_sampler_and_memory_are_none_on_cpu():
    s = nvml.NvmlSampler(torch.device("cpu"), interval_s=0.01).start()
    assert s.stop() is None
    assert nvml.device_memory(torch.device("cpu")) is None
    reset_peaks(CPU)
    assert set(memory_stats(CPU).values()) == {None}


def test_throttle_classification():
    assert nvml.reason_names(0x1 | 0x40) == ["gpu_idle", "hw_thermal_slowdown"]
    assert nvml.reason_names(0x800) == ["bit_0x800"]

    def sample(t, mask, mem=100):
        return {
            "t": t,
            "gpu_util_pct": 90.0,
            "sm_clock_mhz": 1980,
            "power_w": 650.0,
            "temp_c": 60,
            "mem_used_bytes": mem,
            "reasons": mask,
        }

    idle_then_hot = nvml.summarize_samples([sample(0.0, 0x1), sample(0.1, 0x40, 300), sample(0.2, 0x0)])
    assert idle_then_hot["throttled"] and idle_then_hot["throttle_reasons"] == ["hw_thermal_slowdown"]
    assert idle_then_hot["clock_event_reasons"]["gpu_idle"] == pytest.approx(1 / 3)
    assert idle_then_hot["mem_used_peak_bytes"] == 300 and idle_then_hot["samples"] == 3

    capped = [sample(0.0, 0x4), sample(0.1, 0x4 | 0x2)]
    s = nvml.summarize_samples(capped)
    assert not s["throttled"] and s["power_capped"]
    assert nvml.summarize_samples(capped, count_power_cap=True)["throttle_reasons"] == ["sw_power_cap"]
    assert nvml.summarize_samples([]) is None


class FakeNvml:
    """The pynvml calls the sampler makes, with the pre-12.535 name for clock-event reasons."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    class _Util:
        gpu = 97

    class _Mem:
        used = 5 << 30

    def __init__(self):
        self.calls = 0

    def nvmlDeviceGetUtilizationRates(self, h):
        self.calls += 1
        return self._Util()

    def nvmlDeviceGetPowerUsage(self, h):
        return 690_000  # mW

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._Mem()

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1755

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetTemperature(self, h, kind):
        raise RuntimeError("not supported")  # an unsupported field must read as None, not fail the run

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0x4 | 0x20


def test_nvml_sampler_thread_with_fake_nvml(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setattr(nvml, "nvml", lambda: fake)
    monkeypatch.setattr(nvml, "device_handle", lambda device: "handle")
    with nvml.NvmlSampler(torch.device("cuda", 0), interval_s=0.005) as s:
        deadline = time.monotonic() + 5
        while fake.calls < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
    out = s.summary
    assert out["samples"] >= 3 and out["samples"] == len(s.samples)
    assert out["gpu_util_pct"] == {"mean": 97.0, "median": 97.0, "max": 97.0}
    assert out["power_w"]["max"] == pytest.approx(690.0)
    assert out["temp_c"] is None and out["sm_clock_max_mhz"] == 1980
    assert out["throttled"] and out["throttle_reasons"] == ["sw_thermal_slowdown"] and out["power_capped"]
    assert out["mem_used_peak_bytes"] == 5 << 30


# --- fingerprint -----------------------------------------------------------------------------------------
def test_fingerprint_on_cpu():
    fp = environment_fingerprint()
    for key in (
        "python",
        "torch",
        "cuda",
        "nccl",
        "driver",
        "deepspeed",
        "transformers",
        "gpu_model",
        "gpu_count",
        "topology",
        "nvlink_links",
        "git_commit",
        "env",
    ):
        assert key in fp
    assert fp["torch"] == torch.__version__
    assert "hostname" not in fp and socket.gethostname() not in json.dumps(fp)
    if torch.cuda.device_count() == 0:
        assert fp["gpu_count"] == 0
    repo = Path(__file__).resolve().parents[1]
    if (repo / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", fp["git_commit"])


def test_git_state_outside_a_checkout_is_none(tmp_path):
    assert git_state(tmp_path) == (None, None)


def test_relevant_env_keeps_nccl_and_cuda_settings_only():
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_CUDA_ARCH_LIST": "9.0a",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOME": "/root",
        "NCCL_IB_SECRET_KEY": "x",
    }
    assert relevant_env(env) == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_DEBUG": "INFO",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_CUDA_ARCH_LIST": "9.0a",
    }


# --- benchmark jobs --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_reply():
    return bm.bench(CPU, RunConfig.from_dict(TINY))


def test_bench_job_at_world_size_1(bench_reply):
    r = bench_reply
    assert len(r["step_times_s"]) == 3 and all(t > 0 for t in r["step_times_s"])
    assert len(r["losses"]) == 5 and all(math.isfinite(x) for x in r["losses"])  # warm-up included
    assert r["flops"]["flops_per_token"] == 6 * (r["n_params"] - 4096) + 12 * 2 * 64 * 32
    assert r["seq_len"] == 32 and r["device_type"] == "cpu"
    assert r["nvml"] is None and set(r["memory"].values()) == {None}
    assert bm.STATE_KEY not in worker.STATE  # the trainer was freed
    assert r["gc"]["collector_on"] is False and len(r["gc"]["step_seconds"]) == 3
    assert gc.isenabled()  # the collector is back after the window


def _make_cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


@pytest.mark.parametrize("keep", [True, False])
def test_gc_watch_keeps_the_collector_out_of_timed_steps_and_counts_it(keep):
    w = GcWatch(keep_collector=keep).start()
    assert gc.isenabled() is keep
    _make_cycles(20_000)  # far past generation 0's threshold: the collector runs if it is on
    w.step()
    _make_cycles(10)
    w.step()
    out = w.stop()
    assert gc.isenabled()
    assert out["collector_on"] is keep and len(out["step_seconds"]) == 2
    if keep:
        assert out["collections"][0] > 0 and out["step_seconds"][0] > 0
        assert out["seconds"] == pytest.approx(sum(out["step_seconds"]))
    else:
        assert out["collections"] == [0, 0, 0] and out["seconds"] == 0


def test_gc_watch_leaves_a_collector_that_was_off_off():
    gc.disable()
    try:
        GcWatch(keep_collector=False).start().stop()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_split_jobs_train_like_the_one_shot_job(bench_reply):
    setup = bm.bench_setup(CPU, RunConfig.from_dict(TINY))
    assert bm.STATE_KEY in worker.STATE and len(setup["warmup_losses"]) == 2
    steps = [bm.bench_step(CPU) for _ in range(3)]
    out = bm.bench_finish(CPU)
    assert bm.STATE_KEY not in worker.STATE
    assert out["step_times_s"] == [s["step_time_s"] for s in steps]
    assert out["losses"] == bench_reply["losses"]  # deterministic fp32: same steps, same losses
    with pytest.raises(RuntimeError, match="bench_setup first"):
        bm.bench_step(CPU)


class FakePool:
    """Stands in for a RankPool: canned per-rank replies, or a JobError."""

    device_type = "cpu"

    def __init__(
        self,
        replies=None,
        oom_from_micro_batch=None,
        exc_type="OutOfMemoryError",
        text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ):
        self.replies = replies
        self.oom_from = oom_from_micro_batch
        self.exc_type = exc_type
        self.text = text
        self.closed = 0
        self.seen = []

    def run(self, job, kwargs, timeout):
        assert job is bm.bench
        cfg = kwargs["cfg"]
        self.seen.append(cfg)
        if self.oom_from is not None and cfg.micro_batch >= self.oom_from:
            outcomes = [RankOutcome(r, "error", self.exc_type, self.text) for r in range(cfg.world_size)]
            raise JobError("bench", len(outcomes), outcomes, "raised")
        return self.replies

    def close(self):
        self.closed += 1


def test_run_benchmark_result_schema(bench_reply, tmp_path):
    cfg = RunConfig.from_dict(TINY)
    res = run_benchmark(FakePool([bench_reply]), cfg)
    assert res["schema"] == SCHEMA and res["status"] == "ok" and res["error"] is None
    m = res["metrics"]
    assert set(m) <= set(METRICS)
    assert {"tokens_per_s", "tokens_per_s_per_gpu", "samples_per_s", "step_time_s", "tflops_per_gpu"} <= set(
        m
    )
    assert "mfu" not in m and "mem_allocated_peak_bytes" not in m  # CPU: no peak, no device memory
    (window,) = bench_reply["windows"]  # one window: the step time is its wall clock per step
    assert m["step_time_s"] == pytest.approx(window["wall_s"] / 3)
    assert window["wall_s"] >= sum(bench_reply["step_times_s"])  # the window holds its steps
    assert res["step_time_s"]["median"] == pytest.approx(sorted(bench_reply["step_times_s"])[1])
    assert m["host_cpu_s"] == pytest.approx(sorted(window["host_cpu_s"])[1])
    assert res["config"]["optimizer_impl"] == "foreach" and res["config"]["timing"] == "events"
    assert m["tokens_per_s"] == pytest.approx(4 * 32 / m["step_time_s"])
    assert "speedup" not in m  # it needs the matrix's 1-GPU baseline: distbench.scaling.annotate
    assert res["step_time_s"]["n"] == 3 and res["losses"] == bench_reply["losses"]
    assert res["step_time_s"]["steps"] == bench_reply["step_times_s"]  # one rank: its own steps
    assert res["config"]["seq_len"] == 32 and res["config"]["device"] == "cpu"
    assert res["nvml"] is None and "git_commit" in res["env"]
    assert res["gc"]["collector_on"] is False and len(res["gc"]["step_seconds"]) == 3
    assert load_results(save_result(res, tmp_path)) == [json.loads(json.dumps(res))]


def test_out_of_memory_is_a_result_and_other_failures_raise():
    cfg = RunConfig.from_dict({**TINY, "world_size": 2})
    pool = FakePool(oom_from_micro_batch=1)
    res = run_benchmark(pool, cfg)
    assert res["status"] == "oom" and "rank(s) 0,1" in res["error"] and res["metrics"] == {}
    assert (
        res["config"]["micro_batch"] == 2
        and [r["exc_type"] for r in res["per_rank"]] == ["OutOfMemoryError"] * 2
    )
    assert pool.closed == 1  # a fresh process group for the next job
    failing = FakePool(oom_from_micro_batch=1, exc_type="ValueError", text="ValueError: bad option")
    with pytest.raises(JobError):
        run_benchmark(failing, cfg)
    assert failing.closed == 0


def test_micro_batch_sweep_stops_at_first_oom(bench_reply):
    cfg = RunConfig.from_dict(TINY)  # accumulation 2
    pool = FakePool([bench_reply], oom_from_micro_batch=4)
    results = sweep_micro_batch(pool, cfg, [8, 1, 2, 4])
    assert [r["status"] for r in results] == ["ok", "ok", "oom"]
    assert [(c.micro_batch, c.global_batch) for c in pool.seen] == [(1, 2), (2, 4), (4, 8)]
