"""Telemetry for Prometheus: DCGM-named GPU gauges and per-configuration step metrics over HTTP and in a
textfile, scraped from a live `distbench run` and by a real Prometheus server; the Grafana dashboard asks
only for metrics that are exported."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from distbench.measure import telemetry as tm
from distbench.results import make_result
from leftovers import stop
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def a_result() -> dict:
    cfg = {
        "strategy": "ddp",
        "world_size": 2,
        "model": "gpt2-tiny",
        "precision": "fp32",
        "seq_len": 32,
        "global_batch": 8,
        "micro_batch": 2,
    }
    per_rank = [
        {
            "rank": r,
            "step_time_s": {"median": 0.02 + r / 100, "p10": 0.01, "p90": 0.05},
            "mem_allocated_peak_bytes": 1000 + r,
            "mem_reserved_peak_bytes": None,
        }
        for r in (0, 1)
    ]
    return make_result(cfg, metrics={"tokens_per_s": 1234.5, "mfu": 0.25}, per_rank=per_rank)


class FakeNvml:
    """Two GPUs, as NVML names them."""

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H200"


def fake_sample(nv, h: int) -> dict:
    return {
        "t": 0.0,
        "gpu_util_pct": 97.0 + h,
        "sm_clock_mhz": 1980,
        "power_w": 612.5,
        "temp_c": 55,
        "mem_used_bytes": 3 * 2**30,
        "reasons": 0x4 if h else None,
    }


def test_gpu_samples_and_step_metrics_are_served_and_written(tmp_path, monkeypatch):
    monkeypatch.setattr(tm, "nvml", FakeNvml)
    monkeypatch.setattr(tm, "read_sample", fake_sample)
    port = free_port()
    t = tm.Telemetry(listen=("127.0.0.1", port), textfile_dir=tmp_path, interval_s=0.05).start()
    try:
        t.record(a_result())
        text = scrape(port)
    finally:
        t.close()
    label = 'configuration="ddp ws2 gpt2-tiny fp32 s32 gb8 mb2"'
    for line in [
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",modelName="NVIDIA H200"} 98.0',
        'DCGM_FI_DEV_FB_USED{gpu="0",modelName="NVIDIA H200"} 3072.0',  # MiB, as dcgm-exporter reports it
        'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="1",modelName="NVIDIA H200"} 4.0',
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",modelName="NVIDIA H200"} 612.5',
        f"distbench_tokens_per_second{{{label}}} 1234.5",
        f'distbench_step_time_seconds{{{label},rank="1",stat="median"}} 0.03',
        f'distbench_peak_memory_bytes{{{label},kind="allocated",rank="1"}} 1001.0',
        'distbench_configurations_total{status="ok"} 1.0',
    ]:
        assert line in text, line
    assert 'gpu="0",modelName="NVIDIA H200"} 0' not in text.split("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")[-1]
    assert (tmp_path / tm.TEXTFILE_NAME).read_text() == text  # node_exporter reads the same exposition


@pytest.mark.parametrize(
    "value, want", [("9400", ("0.0.0.0", 9400)), ("127.0.0.1:9400", ("127.0.0.1", 9400))]
)
def test_listen_address(value, want):
    assert tm.parse_listen(value) == want


def test_a_bad_listen_address_is_refused_with_the_form():
    with pytest.raises(ValueError, match=r"--prometheus takes \[ADDR:\]PORT"):
        tm.parse_listen("localhost")


@pytest.mark.slow  # a real `distbench run` (one rank, two repeats): ~10 s on 2 cores
def test_a_live_run_is_scraped_while_it_runs(tmp_path):
    port = free_port()
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distbench.cli",
            "run",
            "--device",
            "cpu",
            "-s",
            "single",
            "-n",
            "1",
            "--repeats",
            "2",
            "--steps",
            "30",
            "--warmup",
            "1",
            "-o",
            str(tmp_path / "out"),
            "--prometheus",
            f"127.0.0.1:{port}",
            "--textfile",
            str(tmp_path / "prom"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = None
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                text = scrape(port)
            except OSError:  # not serving yet
                text = ""
            if 'distbench_configurations_total{status="ok"} 1.0' in text:
                seen = text
                break
            time.sleep(0.05)
        running = proc.poll() is None
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert seen is not None and running, "no scrape showed the first repeat while the second was running"
    assert re.search(
        r'distbench_step_time_seconds\{configuration="single ws1 gpt2-tiny fp32 s\d+ gb\d+ mb2",'
        r'rank="0",stat="median"\} [0-9.e-]+',
        seen,
    )
    assert (
        'distbench_configurations_total{status="ok"} 2.0'
        in (tmp_path / "prom" / tm.TEXTFILE_NAME).read_text()
    )


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="no prometheus binary (Debian: apt-get install prometheus)"
)
@pytest.mark.slow  # a real Prometheus server started and scraping: ~7 s on 2 cores
def test_a_real_prometheus_server_scrapes_the_endpoint(tmp_path):
    port, prom_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: distbench, static_configs: [{{targets: ['127.0.0.1:{port}']}}]}}]\n"
    )
    t = tm.Telemetry(listen=("127.0.0.1", port)).start()
    t.record(a_result())
    server = subprocess.Popen(
        [
            shutil.which("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    got: list = []
    try:
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{prom_port}/api/v1/query?query=distbench_tokens_per_second", timeout=5
                ) as r:
                    got = json.load(r)["data"]["result"]
            except OSError:  # still starting
                continue
    finally:
        stop(server, grace=20)
        t.close()
    assert got, (tmp_path / "prometheus.log").read_text()[-2000:]
    assert got[0]["metric"]["job"] == "distbench"
    assert got[0]["metric"]["configuration"] == "ddp ws2 gpt2-tiny fp32 s32 gb8 mb2"
    assert float(got[0]["value"][1]) == 1234.5


def test_the_dashboard_queries_only_exported_metrics():
    dash = json.loads((ROOT / "dashboards" / "distbench.json").read_text())
    exported = set(tm.GPU_FIELDS) | {m.name for m in tm.Telemetry().registry.collect()}
    queried = {re.match(r"\w+", t["expr"]).group(0) for p in dash["panels"] for t in p["targets"]}
    assert queried <= exported, queried - exported
    assert "DCGM_FI_DEV_GPU_UTIL" in queried
