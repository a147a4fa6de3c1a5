"""What this machine is: the one module that probes it. The fingerprint every result carries
(runtime/fingerprint.py) and `distbench doctor` (doctor.py) read their facts here.

Every probe answers on any machine: without GPUs, NVML, nvidia-smi or a package, what cannot be read is None
(or says why), never an exception. GPU facts come from NVML and nvidia-smi, which create no CUDA context;
only cuda_devices() asks torch, for what NVML does not know (the devices this process sees, their SM arch).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from importlib import metadata
from typing import Any

#: Environment variables of the communication stack (NCCL, symmetric memory, NVSHMEM), by prefix.
COMM_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_")

_nvml_state: dict[str, Any] = {}
_init_lock = threading.Lock()


def nvml() -> Any | None:
    """The initialised pynvml module, or None when NVML (library or driver) is unavailable."""
    with _init_lock:
        if "module" not in _nvml_state:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_state["module"] = pynvml
            except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
                _nvml_state["module"] = None
        return _nvml_state["module"]


def package_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (the package is not imported), or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nccl_version() -> str | None:
    """The NCCL torch was built with, or None (CPU-only torch builds have no NCCL bindings)."""
    try:
        import torch

        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        return None


def driver_version() -> str | None:
    nv = nvml()
    try:
        return None if nv is None else str(nv.nvmlSystemGetDriverVersion())
    except Exception:
        return None


def gpu_names() -> list[str]:
    """The name of every GPU NVML sees on the machine (CUDA_VISIBLE_DEVICES does not hide any)."""
    nv = nvml()
    if nv is None:
        return []
    try:
        return [
            str(nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i)))
            for i in range(nv.nvmlDeviceGetCount())
        ]
    except Exception:
        return []


def nvlink_links() -> list[int] | None:
    """Active NVLink links per GPU (NVML order); None without NVML or GPUs."""
    nv = nvml()
    if nv is None:
        return None
    try:
        counts = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            n = 0
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                try:
                    n += nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
                except Exception:  # link does not exist on this GPU
                    continue
            counts.append(n)
        return counts or None
    except Exception:
        return None


def cuda_devices() -> list[str]:
    """'index: name, memory, sm arch' per CUDA device this process sees; empty without CUDA. Creates a CUDA
    context: not for the pytest process, whose GPU 0 rank 0 measures."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(f"{i}: {p.name}, {p.total_memory / 1024**3:.0f} GiB, sm_{p.major}{p.minor}")
        return out
    except Exception as e:  # a broken driver must not stop a probe
        return [f"error querying CUDA devices: {e}"]


#: topology()'s reason where nvidia-smi is not installed (no NVIDIA driver: a CPU machine, usually).
NO_NVIDIA_SMI = "nvidia-smi not found"


def topology() -> tuple[str | None, str]:
    """(`nvidia-smi topo -m`, the GPU/NIC connection matrix, ""), or (None, why it could not be read)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, NO_NVIDIA_SMI
    try:
        p = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi topo -m failed: {e}"
    if p.returncode:
        return None, f"nvidia-smi topo -m exited {p.returncode}: {p.stderr.strip()}"
    text = _strip_ansi(p.stdout).strip()  # nvidia-smi underlines the header with escape codes
    return (text, "") if text else (None, "nvidia-smi topo -m printed nothing")


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
