"""NVML sampling of this rank's GPU during timed steps: utilization, SM clock, power, temperature, memory
and clock-event (throttle) reasons.

A run whose clocks were pulled down by a slowdown is flagged `throttled`: its numbers are not comparable.
Reasons that count as throttling (THROTTLE_REASONS):

* hw_slowdown, hw_thermal_slowdown, hw_power_brake_slowdown: the hardware cut clocks (overheating, power
  supply or an external power-brake signal): a machine problem.
* sw_thermal_slowdown: the driver cut clocks because the GPU or its memory ran too hot.

Reasons that do not count: gpu_idle (nothing to run, e.g. between benchmark rounds),
applications_clocks_setting (clocks pinned by the admin), sync_boost, display_clock_setting, and by default
sw_power_cap: big GEMM workloads on H100/H200 sit at the board power limit in normal steady-state
operation, so flagging it would flag every large run. It is reported as `power_capped` and counts as
throttling with `count_power_cap=True` (use that when comparing machines with different power limits).

Without a GPU or without NVML, everything here is a no-op that reports None and never raises.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

import torch

from ..machine import nvml

# Bit values are fixed by NVML's ABI (nvmlClocksEventReason* == the older nvmlClocksThrottleReason*).
REASON_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THROTTLE_REASONS = frozenset(
    {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def device_handle(device: torch.device | None) -> Any | None:
    """NVML handle of a torch CUDA device, matched by UUID (NVML ignores CUDA_VISIBLE_DEVICES and may order
    GPUs differently from CUDA), then PCI bus id, then index when no device mask is set. None on CPU."""
    if device is None or device.type != "cuda":
        return None
    nv = nvml()
    if nv is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    candidates = []
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        candidates.append(lambda: nv.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"))
    if hasattr(props, "pci_bus_id"):
        bus = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        candidates.append(lambda: nv.nvmlDeviceGetHandleByPciBusId(bus))
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        candidates.append(lambda: nv.nvmlDeviceGetHandleByIndex(index))
    for get in candidates:
        try:
            return get()
        except Exception:
            continue
    return None


def device_memory(device: torch.device | None) -> tuple[int, int] | None:
    """(used, total) bytes of the whole GPU as NVML sees it (CUDA context, NCCL buffers and the driver's
    reservation included in used, and in total, which is larger than torch's total_memory by that
    reservation); None on CPU or without NVML."""
    h, nv = device_handle(device), nvml()
    if h is None or nv is None:
        return None
    try:
        info = nv.nvmlDeviceGetMemoryInfo(h)
        return int(info.used), int(info.total)
    except Exception:
        return None


def reason_names(mask: int) -> list[str]:
    """Names of the clock-event reason bits set in `mask` (unknown bits as hex)."""
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(REASON_BITS)
    names += [f"bit_{1 << i:#x}" for i in range(unknown.bit_length()) if unknown >> i & 1]
    return names


def _current_reasons(nv: Any, h: Any) -> int:
    get = (
        getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return int(get(h))


def _read(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # a field this GPU or driver does not support
        return None


def read_sample(nv: Any, h: Any) -> dict[str, Any]:
    """One reading of the GPU; fields a GPU does not support are None."""
    util = _read(nv.nvmlDeviceGetUtilizationRates, h)
    power_mw = _read(nv.nvmlDeviceGetPowerUsage, h)
    mem = _read(nv.nvmlDeviceGetMemoryInfo, h)
    return {
        "t": time.monotonic(),
        "gpu_util_pct": None if util is None else float(util.gpu),
        "sm_clock_mhz": _read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
        "power_w": None if power_mw is None else power_mw / 1000.0,
        "temp_c": _read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        "mem_used_bytes": None if mem is None else int(mem.used),
        "reasons": _read(_current_reasons, nv, h),
    }


def _agg(values: list[float | None]) -> dict[str, float] | None:
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "max": max(xs)}


def summarize_samples(
    samples: list[dict[str, Any]], *, count_power_cap: bool = False, sm_clock_max_mhz: int | None = None
) -> dict[str, Any] | None:
    """mean/median/max per field, the fraction of samples showing each clock-event reason, and the flags."""
    if not samples:
        return None
    masks = [s["reasons"] for s in samples if s.get("reasons") is not None]
    seen: dict[str, float] = {}
    for m in masks:
        for name in reason_names(m):
            seen[name] = seen.get(name, 0.0) + 1.0 / len(masks)
    counted = THROTTLE_REASONS | ({"sw_power_cap"} if count_power_cap else set())
    mem = [s["mem_used_bytes"] for s in samples if s.get("mem_used_bytes") is not None]
    return {
        "samples": len(samples),
        "duration_s": samples[-1]["t"] - samples[0]["t"],
        "gpu_util_pct": _agg([s.get("gpu_util_pct") for s in samples]),
        "sm_clock_mhz": _agg([s.get("sm_clock_mhz") for s in samples]),
        "sm_clock_max_mhz": sm_clock_max_mhz,
        "power_w": _agg([s.get("power_w") for s in samples]),
        "temp_c": _agg([s.get("temp_c") for s in samples]),
        "mem_used_peak_bytes": max(mem) if mem else None,
        "clock_event_reasons": dict(sorted(seen.items())),
        "throttle_reasons": sorted(counted & set(seen)),
        "throttled": bool(counted & set(seen)),
        "power_capped": "sw_power_cap" in seen,
        "count_power_cap": count_power_cap,
    }


class NvmlSampler:
    """Samples one GPU from a background thread every `interval_s` between start() and stop().

    A sample is also taken at start and at stop, so even a short window has two. On CPU or without NVML,
    start() does nothing and stop() returns None.
    """

    def __init__(
        self, device: torch.device | None, interval_s: float = 0.1, *, count_power_cap: bool = False
    ):
        self.device = device
        self.interval_s = interval_s
        self.count_power_cap = count_power_cap
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nv: Any = None
        self._h: Any = None
        self.summary: dict[str, Any] | None = None

    def start(self) -> NvmlSampler:
        try:
            self._h = device_handle(self.device)
            if self._h is None:
                return self
            self._nv = nvml()
            self.samples = [read_sample(self._nv, self._h)]
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="distbench-nvml", daemon=True)
            self._thread.start()
        except Exception:
            self._thread = None
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(read_sample(self._nv, self._h))
            except Exception:
                pass

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling and return the summary (None when nothing was sampled)."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 1.0)
        self._thread = None
        try:
            self.samples.append(read_sample(self._nv, self._h))
            max_clock = _read(self._nv.nvmlDeviceGetMaxClockInfo, self._h, self._nv.NVML_CLOCK_SM)
            self.summary = summarize_samples(
                self.samples, count_power_cap=self.count_power_cap, sm_clock_max_mhz=max_clock
            )
        except Exception:
            self.summary = None
        return self.summary

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
