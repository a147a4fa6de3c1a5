"""The environment fingerprint every result carries: what a number depends on besides the code under test.

Safe in the pytest process: the machine's facts come from distbench/machine.py's NVML and nvidia-smi probes,
never from creating a CUDA context (which would take memory on GPU 0 that rank 0's measurements would then
see). Works without GPUs, NVML, git or nvidia-smi: what cannot be read is None. The hostname is left out on
purpose (results get shared).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import machine

#: Environment variables that change performance or behaviour of distributed runs.
ENV_PREFIXES = (*machine.COMM_ENV_PREFIXES, "DISTBENCH_")
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_CUDA_ARCH_LIST",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "DS_ACCELERATOR",
)
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)


def environment_fingerprint(device_type: str | None = None) -> dict[str, Any]:
    """Versions, GPUs, topology, git commit and relevant environment variables, as a JSON-able dict.

    `gpus` lists every GPU NVML sees on the machine; `gpu_count` the ones visible to this process.
    `device_type` is the run's ("cpu", "cuda"; None: unknown), which decides the links its ranks use.
    """
    import distbench

    names = machine.gpu_names()
    commit, dirty = git_state(Path(distbench.__file__).resolve().parent)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "distbench": distbench.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": machine.nccl_version(),
        "driver": machine.driver_version(),
        "deepspeed": machine.package_version("deepspeed"),
        "transformers": machine.package_version("transformers"),
        "gpu_model": " + ".join(sorted(set(names))) if names else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpus": names,
        "nvlink_links": machine.nvlink_links(),
        "topology": _topology(),
        **launch_topology(device_type=device_type),
        "git_commit": commit,
        "git_dirty": dirty,
        "env": relevant_env(),
    }


def launch_topology(
    environ: Mapping[str, str] | None = None, device_type: str | None = None
) -> dict[str, Any]:
    """The launched world: `nodes` and `ranks_per_node` from torchrun's environment (1 node and None for the
    single-host pool, whose ranks are all on this machine), and the links between ranks (`interconnect`:
    intra_node nvlink / pcie / host, inter_node infiniband / tcp when the launch spans nodes). A run on
    `device_type` "cpu" talks over gloo through the host and TCP whatever GPUs and HCAs the machine has."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    per_node = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    nodes = int(env["WORLD_SIZE"]) // per_node if per_node and "WORLD_SIZE" in env else 1
    on_host = device_type == "cpu"
    links = None if on_host else machine.nvlink_links()
    intra = "nvlink" if links and any(links) else ("pcie" if not on_host and machine.gpu_names() else "host")
    inter = None
    if nodes > 1:
        ib = Path("/sys/class/infiniband")
        inter = "infiniband" if not on_host and ib.is_dir() and any(ib.iterdir()) else "tcp"
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "interconnect": {"intra_node": intra, "inter_node": inter},
    }


def nodes_spanned(world_size: int, ranks_per_node: int | None) -> int:
    """Nodes a job of `world_size` ranks spans when ranks fill nodes in order (as torchrun numbers them)."""
    return 1 if not ranks_per_node else -(-world_size // ranks_per_node)


def relevant_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables in ENV_NAMES or with an ENV_PREFIXES prefix (none that look like credentials)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(env.items())
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


@functools.cache
def _topology() -> str | None:
    """`nvidia-smi topo -m`, read once per process (a subprocess per result would add up)."""
    return machine.topology()[0]
