"""The environment fingerprint every result carries: what a number depends on besides the code under test.

Safe in the pytest process: GPU facts come from NVML and nvidia-smi, never from creating a CUDA context
(which would take memory on GPU 0 that rank 0's measurements would then see). Works without GPUs, NVML,
git or nvidia-smi: what cannot be read is None. The hostname is left out on purpose (results get shared).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

#: Environment variables that change performance or behaviour of distributed runs.
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "DISTBENCH_")
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_CUDA_ARCH_LIST", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "DS_ACCELERATOR",
)
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def environment_fingerprint() -> dict[str, Any]:
    """Versions, GPUs, topology, git commit and relevant environment variables, as a JSON-able dict.

    `gpus` lists every GPU NVML sees on the machine; `gpu_count` the ones visible to this process.
    """
    import distbench

    names = _gpu_names()
    commit, dirty = git_state(Path(distbench.__file__).resolve().parent)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "distbench": distbench.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "driver": _driver_version(),
        "deepspeed": _pkg_version("deepspeed"),
        "transformers": _pkg_version("transformers"),
        "gpu_model": " + ".join(sorted(set(names))) if names else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpus": names,
        "nvlink_links": _nvlink_links(),
        "topology": _topology(),
        **launch_topology(),
        "git_commit": commit,
        "git_dirty": dirty,
        "env": relevant_env(),
    }


def launch_topology(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The launched world: `nodes` and `ranks_per_node` from torchrun's environment (1 node and None for the
    single-host pool, whose ranks are all on this machine), and the links between ranks (`interconnect`:
    intra_node nvlink / pcie / host, inter_node infiniband / tcp when the launch spans nodes)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    per_node = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    nodes = int(env["WORLD_SIZE"]) // per_node if per_node and "WORLD_SIZE" in env else 1
    links = _nvlink_links()
    intra = "nvlink" if links and any(links) else ("pcie" if _gpu_names() else "host")
    inter = None
    if nodes > 1:
        ib = Path("/sys/class/infiniband")
        inter = "infiniband" if ib.is_dir() and any(ib.iterdir()) else "tcp"
    return {"nodes": nodes, "ranks_per_node": per_node, "interconnect": {"intra_node": intra, "inter_node": inter}}


def nodes_spanned(world_size: int, ranks_per_node: int | None) -> int:
    """Nodes a job of `world_size` ranks spans when ranks fill nodes in order (as torchrun numbers them)."""
    return 1 if not ranks_per_node else -(-world_size // ranks_per_node)


def relevant_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables in ENV_NAMES or with an ENV_PREFIXES prefix (none that look like credentials)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return {
        k: v for k, v in sorted(env.items())
        if (k in ENV_NAMES or k.startswith(ENV_PREFIXES)) and not _SECRET.search(k)
    }


def git_state(path: Path) -> tuple[str | None, bool | None]:
    """(commit, has uncommitted changes to tracked files) of the checkout holding `path`; (None, None) when
    `path` is not tracked in a git checkout (e.g. distbench installed from a wheel)."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    # A site-packages inside some other repository must not report that repository's commit.
    if git("ls-files", "--error-unmatch", "__init__.py") is None:
        return None, None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def _pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # CPU-only torch builds have no NCCL bindings
        return None


def _nvml() -> Any | None:
    from ..measure.nvml import nvml

    return nvml()


def _driver_version() -> str | None:
    nv = _nvml()
    try:
        return None if nv is None else str(nv.nvmlSystemGetDriverVersion())
    except Exception:
        return None


def _gpu_names() -> list[str]:
    nv = _nvml()
    if nv is None:
        return []
    try:
        return [str(nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i))) for i in range(nv.nvmlDeviceGetCount())]
    except Exception:
        return []


def _nvlink_links() -> list[int] | None:
    """Active NVLink links per GPU (NVML order); None without NVML or GPUs."""
    nv = _nvml()
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


@functools.cache
def _topology() -> str | None:
    """`nvidia-smi topo -m` (the GPU/NIC connection matrix), or None where nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = _ANSI.sub("", p.stdout).strip()  # nvidia-smi underlines the header with escape codes
    return text if p.returncode == 0 and text else None
