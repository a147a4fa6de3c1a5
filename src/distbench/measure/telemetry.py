"""Live telemetry for Prometheus: per-GPU NVML samples under DCGM's field names, and per-configuration step
metrics labelled by configuration and rank, served over HTTP (`distbench run --prometheus [ADDR:]PORT`) or
written for node_exporter's textfile collector (`--textfile DIR`).

GPU gauges carry dcgm-exporter's names, units and `gpu` / `modelName` labels, so dashboards built on
dcgm-exporter (seed 000's) read them unchanged. GPUs are sampled every `interval_s` from this process
through NVML (no CUDA context). Step metrics land when a configuration finishes (its step-time median and
spread per rank, tokens/s, MFU, peak memory). Without NVML (CPU machines) only the step metrics export.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server, write_to_textfile

from ..config import config_label
from .nvml import nvml, read_sample

#: DCGM field name -> (key of nvml.read_sample, scale to DCGM's unit, help).
GPU_FIELDS: dict[str, tuple[str, float, str]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("gpu_util_pct", 1.0, "GPU utilization (in %)."),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0, "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0, "Power draw (in W)."),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1.0, "GPU temperature (in C)."),
    "DCGM_FI_DEV_FB_USED": ("mem_used_bytes", 1.0 / 2**20, "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("reasons", 1.0, "Throttle reasons (NVML clock-event bitmask)."),
}
TEXTFILE_NAME = "distbench.prom"


def parse_listen(value: str) -> tuple[str, int]:
    """`[ADDR:]PORT` -> (addr, port); all interfaces when no address is given (Prometheus scrapes remotely)."""
    addr, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prometheus takes [ADDR:]PORT, e.g. 9400 or 127.0.0.1:9400, not {value!r}")
    return addr or "0.0.0.0", int(port)


class Telemetry:
    """A registry of GPU and step metrics, an optional HTTP endpoint and an optional textfile, kept live by a
    sampling thread until close()."""

    def __init__(
        self,
        *,
        listen: tuple[str, int] | None = None,
        textfile_dir: str | Path | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.listen, self.interval_s = listen, interval_s
        self.textfile = Path(textfile_dir) / TEXTFILE_NAME if textfile_dir else None
        self.registry = CollectorRegistry()
        self.gpu = {
            name: Gauge(name, help_, ["gpu", "modelName"], registry=self.registry)
            for name, (_, _, help_) in GPU_FIELDS.items()
        }
        labels = ["configuration", "rank"]
        self.step_time = Gauge(
            "distbench_step_time_seconds",
            "Optimizer step time of a configuration per rank (stat: median, p10, p90 over the timed steps).",
            [*labels, "stat"],
            registry=self.registry,
        )
        self.peak_memory = Gauge(
            "distbench_peak_memory_bytes",
            "Peak device memory of a configuration per rank (kind: allocated, reserved).",
            [*labels, "kind"],
            registry=self.registry,
        )
        self.tokens = Gauge(
            "distbench_tokens_per_second",
            "Throughput of a configuration (all ranks).",
            ["configuration"],
            registry=self.registry,
        )
        self.mfu = Gauge(
            "distbench_mfu_ratio",
            "Model FLOPs utilization of a configuration.",
            ["configuration"],
            registry=self.registry,
        )
        self.done = Counter(
            "distbench_configurations",
            "Configurations finished, by status.",
            ["status"],
            registry=self.registry,
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._handles: list[tuple[str, str, Any]] | None = None  # (index, model name, NVML handle)

    def start(self) -> Telemetry:
        if self.listen is not None:
            self._server, _ = start_http_server(self.listen[1], self.listen[0], registry=self.registry)
        if self.textfile is not None:
            self.textfile.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="distbench-telemetry", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            self.sample_gpus()
            self.flush()
            if self._stop.wait(self.interval_s):
                return

    def sample_gpus(self) -> None:
        """One NVML reading of every GPU on this machine into the DCGM gauges (nothing without NVML)."""
        nv = nvml()
        if nv is None:
            return
        if self._handles is None:
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            self._handles = [(str(i), str(nv.nvmlDeviceGetName(h)), h) for i, h in enumerate(handles)]
        for gpu, model, h in self._handles:
            sample = read_sample(nv, h)
            for name, (key, scale, _) in GPU_FIELDS.items():
                if sample[key] is not None:
                    self.gpu[name].labels(gpu, model).set(sample[key] * scale)

    def record(self, result: dict[str, Any]) -> None:
        """A finished configuration's step metrics (a result as run_matrix returns it)."""
        label = config_label(result["config"])
        self.done.labels(result["status"]).inc()
        metrics = result.get("metrics") or {}
        if "tokens_per_s" in metrics:
            self.tokens.labels(label).set(metrics["tokens_per_s"])
        if "mfu" in metrics:
            self.mfu.labels(label).set(metrics["mfu"])
        for r in result.get("per_rank") or []:
            rank = str(r["rank"])
            for stat in ("median", "p10", "p90"):
                value = (r.get("step_time_s") or {}).get(stat)
                if value is not None:
                    self.step_time.labels(label, rank, stat).set(value)
            for kind in ("allocated", "reserved"):
                value = r.get(f"mem_{kind}_peak_bytes")
                if value is not None:
                    self.peak_memory.labels(label, rank, kind).set(value)
        self.flush()

    def flush(self) -> None:
        """Rewrite the textfile (atomically, as node_exporter requires), when there is one."""
        if self.textfile is not None:
            with self._lock:
                write_to_textfile(str(self.textfile), self.registry)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
