"""Every metric a result can carry, one entry each: which way is better, its unit and display, and who reads it.

A result's `metrics` section is flat ({name: float}). For each name this registry says
- `better`: "higher" or "lower" (the compare gate, the A/B gate and asv read it);
- `unit` and `format`: what the stored value measures, and how reports print it (GiB, ms, %, GB/s);
- `compare`: `distbench compare` compares it when no --metric is given;
- `ab`: what the interleaved A/B gate (gate/ab.py) does with it: "gate" (gated wherever the base's first
  run has it), "gate-host-bound" (gated unless the configuration is device-bound), "device" (a device-side
  candidate: the one the comparison names before it starts is gated, the others reported), "report" (shown
  beside the gated ones, never gated), or "" (not shown);
- `time`: a time metric, throttle-sensitive: a regression of it is attributed to the trace's compute /
  non-compute / idle time;
- `asv`: the asv benchmark that tracks it (benchmarks/bench_training.py builds its tracks from these);
- `source`: what writes it: the bench job's summary ("bench"), scaling.annotate ("scaling"), the trace
  breakdown copied in by the matrix ("trace"), or the collective-bandwidth job ("busbw").

Adding a metric is one entry here, plus the code that measures it; tests/test_registries.py fails for a
metric a result carries without an entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GIB = 1024**3

Better = Literal["higher", "lower"]
AbRole = Literal["gate", "gate-host-bound", "device", "report", ""]
Source = Literal["bench", "scaling", "trace", "busbw"]


@dataclass(frozen=True)
class AsvTrack:
    """How asv tracks a metric. asv 0.6 reads any rise as a regression (no higher-is-better attribute:
    airspeed-velocity/asv#1617), so a higher-is-better metric is tracked as `scale / value`."""

    benchmark: str  # "Class.track_method" in benchmarks/bench_training.py: asv's history is keyed by it
    unit: str
    title: str  # the dashboard's name for it (asv's pretty_name)
    where: str = ""  # which runs have it, where not all do: the dashboard says so beside the title
    scale: float = 1.0
    version: str = "1"  # asv keeps results across code changes while this stays the same

    @property
    def pretty_name(self) -> str:
        return f"{self.title} ({self.where})" if self.where else self.title


@dataclass(frozen=True)
class Metric:
    name: str
    better: Better
    unit: str
    description: str
    format: str = "number"  # a key of FORMATS
    compare: bool = False
    ab: AbRole = ""
    time: bool = False
    asv: AsvTrack | None = None
    source: Source = "bench"
    label: str = ""  # a report's column title, where a table shows the metric

    @property
    def direction(self) -> int:
        """+1 if a larger value is better, -1 if a smaller one is."""
        return 1 if self.better == "higher" else -1

    def asv_value(self, value: float) -> float:
        """The value asv records: lower is better."""
        if self.asv is None:
            raise ValueError(f"asv does not track {self.name}")
        return value * self.asv.scale if self.better == "lower" else self.asv.scale / value


#: display format -> how a value prints
FORMATS = {
    "GiB": lambda v: f"{v / GIB:.2f} GiB",
    "ms": lambda v: f"{v * 1000:.2f} ms",
    "fraction": lambda v: f"{v:.1%}",
    "percent": lambda v: f"{v:.2f}%",
    "GB/s": lambda v: f"{v:.1f} GB/s",
    "rate": lambda v: f"{v:,.0f}",
    "number": lambda v: f"{v:.4g}",
}

_THROUGHPUT = "throughput of the timed steps, from the median window's wall clock per step"

_ENTRIES = [
    Metric(
        "tokens_per_s",
        "higher",
        "tokens/s",
        f"tokens/s of the whole job: {_THROUGHPUT}",
        "rate",
        compare=True,
        ab="report",
        time=True,
    ),
    Metric("tokens_per_s_per_gpu", "higher", "tokens/s", "tokens/s per rank", "rate", time=True),
    Metric(
        "samples_per_s",
        "higher",
        "samples/s",
        f"samples/s of the whole job: {_THROUGHPUT}",
        "rate",
        time=True,
    ),
    Metric("samples_per_s_per_gpu", "higher", "samples/s", "samples/s per rank", "rate", time=True),
    Metric(
        "step_time_s",
        "lower",
        "s",
        "Median steady-state optimizer step time.",
        "ms",
        compare=True,
        ab="gate",
        time=True,
        asv=AsvTrack("StepTime.track_step_time", "seconds", "Step time"),
    ),
    # The device-side candidates (measure/devicetime.py): one is gated, chosen before a comparison starts.
    Metric(
        "device_compute_s",
        "lower",
        "s",
        "device time per step in kernels other than NCCL (busiest rank)",
        "ms",
        ab="device",
    ),
    Metric(
        "device_compute_mean_s",
        "lower",
        "s",
        "device time per step in kernels other than NCCL (mean over ranks)",
        "ms",
        ab="device",
    ),
    Metric(
        "device_compute_floor_s",
        "lower",
        "s",
        "kernels other than NCCL per step, each at its fastest of the sampled steps (busiest rank)",
        "ms",
        ab="device",
        # the history's device-side series: over three runs of seed 004's grid on 2x H200 it stayed within
        # 0.22% of its median in 14 of 15 rows (2.0% in the 15th), where device_compute_s, which carries the
        # other rank's NCCL jitter, moved up to 3.6% at 2 GPUs and the wall figure up to 20% (docs/measurement.md)
        asv=AsvTrack(
            "DeviceCompute.track_device_compute_floor",
            "seconds",
            "Device compute per step, each kernel at its fastest",
            where="GPU runs only",
        ),
    ),
    # Reported, not gated: on one H200 machine its run-to-run spread in a host-bound step was 10-20% (as the
    # wall's), and it misses backward, which autograd runs in a thread of its own.
    Metric("host_cpu_s", "lower", "s", "the training thread's CPU time per step", "ms", ab="report"),
    # Gated where the CPU's counters can be read (none on the H200 virtual machines this suite was measured
    # on): the host work of a step as a count, which the host's speed does not move.
    Metric(
        "host_instructions",
        "lower",
        "instructions",
        "user-mode instructions the training thread retired per step (CPU counters, where readable)",
        ab="gate-host-bound",
    ),
    Metric(
        "host_cycles",
        "lower",
        "cycles",
        "user-mode CPU cycles of the training thread per step (CPU counters, where readable)",
        ab="report",
    ),
    Metric(
        "mfu",
        "higher",
        "fraction",
        "model FLOPs utilization against the GPU's peak",
        "fraction",
        compare=True,
        time=True,
        asv=AsvTrack(
            "Mfu.track_inverse_mfu",
            "x peak-FLOP time",
            "1 / MFU",
            where="GPU runs only",
        ),
    ),
    Metric("tflops_per_gpu", "higher", "TFLOP/s", "model TFLOP/s per GPU", time=True),
    Metric(
        "mem_allocated_peak_bytes",
        "lower",
        "bytes",
        "torch peak allocated bytes per GPU over the timed steps (max over ranks)",
        "GiB",
        compare=True,
        ab="gate",
        asv=AsvTrack(
            "Memory.track_peak_mem_allocated",
            "bytes",
            "Peak memory allocated per GPU",
            where="GPU runs only",
        ),
        label="Peak allocated",
    ),
    Metric(
        "mem_reserved_peak_bytes",
        "lower",
        "bytes",
        "torch caching-allocator peak reserved bytes per GPU (max over ranks)",
        "GiB",
        compare=True,
        asv=AsvTrack(
            "Memory.track_peak_mem_reserved",
            "bytes",
            "Peak memory reserved per GPU",
            where="GPU runs only",
        ),
        label="Peak reserved",
    ),
    Metric(
        "nvml_mem_used_peak_bytes",
        "lower",
        "bytes",
        "NVML device memory peak: adds NCCL buffers and the CUDA context, which torch does not see",
        "GiB",
        compare=True,
        asv=AsvTrack(
            "DeviceMemory.track_peak_mem_nvml",
            "bytes",
            "Peak device memory per GPU, NVML",
            where="GPU runs only",
        ),
        label="Peak NVML (device)",
    ),
    Metric(
        "busbw_gbps",
        "higher",
        "GB/s",
        "collective bus bandwidth (nccl-tests convention)",
        "GB/s",
        compare=True,
        source="busbw",
        asv=AsvTrack(
            "BusBandwidth.track_ms_per_bus_gb",
            "ms/GB",
            "1 / bus bandwidth",
            where="world size > 1",
            scale=1000.0,
        ),
    ),
    Metric("algbw_gbps", "higher", "GB/s", "collective algorithm bandwidth", "GB/s", source="busbw"),
    Metric(
        "speedup", "higher", "x", "tokens/s over the workload's 1-GPU baseline (scaling.py)", source="scaling"
    ),
    Metric(
        "scaling_efficiency",
        "higher",
        "fraction",
        "speedup / world size: 1.0 is linear scaling",
        "fraction",
        source="scaling",
        asv=AsvTrack(
            "Scaling.track_inverse_scaling_efficiency",
            "x ideal time",
            "1 / scaling efficiency",
        ),
    ),
    Metric(
        "step_gcycles", "lower", "Gcycles", "SM clock cycles per step, where NVML read the clock", ab="report"
    ),
    Metric(
        "device_comm_s",
        "lower",
        "s",
        "device time per step in NCCL kernels (busiest rank)",
        "ms",
        ab="report",
    ),
    Metric(
        "device_busy_s", "lower", "s", "device time per step with any kernel running (busiest rank)", "ms"
    ),
    Metric("busy_ratio", "higher", "ratio", "device busy time / wall step time", ab="report"),
    Metric(
        "config_overhead_s",
        "lower",
        "s",
        "what a configuration costs beyond its steps in a warm pool: build, wrap, teardown, IPC",
    ),
    Metric(
        "compute_pct", "higher", "%", "share of traced time in compute kernels", "percent", source="trace"
    ),
    Metric(
        "non_compute_pct",
        "lower",
        "%",
        "share of traced time in non-compute kernels",
        "percent",
        source="trace",
    ),
    Metric("idle_pct", "lower", "%", "share of traced time the GPU idled", "percent", source="trace"),
    Metric(
        "overlap_pct",
        "higher",
        "%",
        "share of communication overlapped with compute",
        "percent",
        source="trace",
    ),
]

METRICS: dict[str, Metric] = {m.name: m for m in _ENTRIES}

#: `distbench compare`'s default: one throughput, one time, the efficiency, the memory peaks and bus bandwidth;
#: the per-GPU and percentage variants are redundant with these and would only repeat a verdict.
COMPARED = tuple(m.name for m in _ENTRIES if m.compare)


def names(
    *, source: Source | None = None, ab: AbRole | None = None, unit: str | None = None
) -> tuple[str, ...]:
    """Metric names in registry order; only those of one `source`, A/B role or `unit` when given."""
    return tuple(
        m.name
        for m in _ENTRIES
        if (source is None or m.source == source)
        and (ab is None or m.ab == ab)
        and (unit is None or m.unit == unit)
    )


def fmt_metric(metric: str, value: float | None) -> str:
    """A metric value in the unit people read it in (GiB, ms, %, GB/s); "—" for none, 4 digits for a metric
    without an entry."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    m = METRICS.get(metric)
    return FORMATS[m.format if m else "number"](value)
