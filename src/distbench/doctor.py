"""`distbench doctor`: what this machine has, and the known breakages it would hit, each with its fix.

Runs on any machine: no GPU, no nvidia-smi and no DeepSpeed are reported, not raised. DeepSpeed and
transformers are looked up by package metadata, not imported: importing DeepSpeed probes the accelerator and
can itself trip over the breakages this is meant to explain. The machine's facts come from distbench/machine.py,
as the fingerprint's do; this module judges them.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from .machine import COMM_ENV_PREFIXES, NO_NVIDIA_SMI, cuda_devices, nccl_version, package_version, topology

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"

#: NVLink multicast (NVLS) must stay off on the H100/H200 machines of the GPU tier and many clusters.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok / warn / fail / info
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def check_python() -> Check:
    return Check("python", INFO, f"{platform.python_version()} ({sys.executable})")


def check_torch() -> list[Check]:
    try:
        import torch
    except ImportError:
        return [
            Check(
                "torch",
                FAIL,
                "not installed",
                "pip install torch (CPU: --index-url https://download.pytorch.org/whl/cpu)",
            )
        ]
    cuda = torch.version.cuda
    checks = [Check("torch", OK, f"{torch.__version__} (CUDA build {cuda or 'none: CPU-only wheel'})")]
    if cuda and torch.cuda.is_available():
        nccl = (
            nccl_version()
            if torch.distributed.is_available() and torch.distributed.is_nccl_available()
            else None
        )
        checks.append(
            Check(
                "nccl",
                OK if nccl else WARN,
                nccl or "torch built without NCCL",
                "" if nccl else "install a CUDA build of torch with NCCL for multi-GPU runs",
            )
        )
    return checks


def check_packages() -> list[Check]:
    ds, tf = package_version("deepspeed"), package_version("transformers")
    return [
        Check(
            "deepspeed",
            OK if ds else WARN,
            ds or "not installed: zero0/zero1/zero2/zero3 strategies unavailable",
            "" if ds else "pip install deepspeed",
        ),
        Check(
            "transformers",
            OK if tf else FAIL,
            tf or "not installed: no workload models",
            "" if tf else "pip install transformers",
        ),
    ]


def check_gpus(devices: list[str]) -> Check:
    if not devices:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return Check("gpus", INFO, f"no CUDA devices{extra}: CPU tier only (`pytest`)")
    return Check("gpus", OK, f"{len(devices)} visible: " + "; ".join(devices))


def check_topology() -> Check:
    matrix, why = topology()
    if matrix is not None:
        return Check("topology", INFO, matrix)
    if why == NO_NVIDIA_SMI:
        return Check("topology", INFO, f"{why}: GPU topology unknown")
    return Check("topology", WARN, why)


def check_nccl_env(env: Mapping[str, str]) -> Check:
    names = sorted(k for k in env if k.startswith(COMM_ENV_PREFIXES))
    return Check("nccl env", INFO, ", ".join(f"{k}={env[k]}" for k in names) or "none set")


def check_multicast(env: Mapping[str, str], have_gpus: bool) -> Check:
    """NVLink multicast (NVLS) left on breaks or slows collectives on the GPU-tier machines."""
    wrong = {k: env.get(k) for k, v in MULTICAST_OFF.items() if env.get(k) != v}
    if not wrong:
        return Check(
            "nvlink multicast", OK, "off (" + ", ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items()) + ")"
        )
    detail = "not disabled: " + ", ".join(
        f"{k}={v if v is not None else '<unset>'}" for k, v in wrong.items()
    )
    fix = "export " + " ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items())
    return Check("nvlink multicast", WARN if have_gpus else INFO, detail, fix)


_ARCH = re.compile(r"^\d+\.\d+(\+PTX)?$")


def check_cuda_arch_list(env: Mapping[str, str], deepspeed_installed: bool) -> Check:
    """TORCH_CUDA_ARCH_LIST entries like "9.0a" break DeepSpeed's op builder (it int()s each part)."""
    raw = env.get("TORCH_CUDA_ARCH_LIST")
    if raw is None:
        return Check("TORCH_CUDA_ARCH_LIST", OK, "unset (DeepSpeed's JIT builds use the visible GPUs' archs)")
    entries = [e for e in re.split(r"[;\s]+", raw.strip()) if e]
    bad = [e for e in entries if not _ARCH.match(e)]
    if not bad:
        return Check("TORCH_CUDA_ARCH_LIST", OK, raw)
    fixed = []
    for e in entries:
        m = re.match(r"^(\d+\.\d+)", e)
        v = (m.group(1) + ("+PTX" if e.endswith("+PTX") else "")) if m else None
        if v and v not in fixed:
            fixed.append(v)
    detail = (
        f"{raw!r} has {', '.join(map(repr, bad))}: DeepSpeed's op builder cannot parse it and its "
        f"FusedAdam JIT build fails with `invalid literal for int() with base 10: "
        f"'{bad[0].split('.', 1)[-1].split('+')[0]}'`"
    )
    if not deepspeed_installed:
        detail += " (DeepSpeed is not installed yet)"
    value = ";".join(fixed)
    value = f'"{value}"' if ";" in value else value  # unquoted, the shell would run "9.0" as a command
    fix = f"export TORCH_CUDA_ARCH_LIST={value}" if fixed else "unset TORCH_CUDA_ARCH_LIST"
    return Check("TORCH_CUDA_ARCH_LIST", FAIL if deepspeed_installed else WARN, detail, fix)


def check_max_connections(env: Mapping[str, str]) -> Check:
    v = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if v is None:
        return Check("CUDA_DEVICE_MAX_CONNECTIONS", OK, "unset (driver default)")
    detail = f"{v}" + (
        ": one hardware queue serializes kernels from NCCL and compute streams, which can lower "
        "the comm/compute overlap FSDP and DDP rely on (Megatron sets it for tensor parallelism)"
        if v == "1"
        else ""
    )
    return Check(
        "CUDA_DEVICE_MAX_CONNECTIONS",
        INFO,
        detail,
        "unset CUDA_DEVICE_MAX_CONNECTIONS unless the stack needs it" if v == "1" else "",
    )


#: A JIT build's lock older than this is taken for an interrupted build (DeepSpeed's CUDA ops build in minutes).
STALE_LOCK_S = 30 * 60


def check_extension_locks(root: str, now: float) -> Check:
    """torch's JIT extension builds (DeepSpeed's ops) hold ROOT/<build>/<op>/lock while they compile; a build
    that was killed leaves it, and every later build of that op, in every test and rank that needs it, waits
    for it forever (seen: a killed run's lock held DeepSpeed's CPU op for an hour, and each DeepSpeed test hung
    until its timeout)."""
    stale = []
    for lock in sorted(Path(root).glob("*/*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # the build finished meanwhile
            continue
        if age > STALE_LOCK_S:
            stale.append(f"{lock} ({age / 60:.0f} min old)")
    if not stale:
        return Check("extension builds", OK, f"no interrupted build under {root}")
    return Check(
        "extension builds",
        WARN,
        "an interrupted build left its lock, and every build of that op waits for it: " + "; ".join(stale),
        "when no compiler is running, remove it: rm " + " ".join(s.split(" (")[0] for s in stale),
    )


def extensions_root(env: Mapping[str, str]) -> str:
    """Where torch builds JIT extensions: TORCH_EXTENSIONS_DIR, else its per-user cache folder."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return env["TORCH_EXTENSIONS_DIR"]
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()


def run_checks(env: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in reading order. `env` defaults to os.environ (tests pass their own)."""
    env = os.environ if env is None else env
    devices = cuda_devices()
    checks = [
        check_python(),
        *check_torch(),
        *check_packages(),
        check_gpus(devices),
        check_topology(),
        check_nccl_env(env),
        check_multicast(env, bool(devices)),
        check_cuda_arch_list(env, package_version("deepspeed") is not None),
        check_max_connections(env),
    ]
    if package_version("torch") is not None:
        checks.append(check_extension_locks(extensions_root(env), time.time()))
    return checks


def render(checks: list[Check]) -> str:
    """Plain text, one block per check, fixes spelled out."""
    mark = {OK: "[ ok ]", WARN: "[warn]", FAIL: "[FAIL]", INFO: "[info]"}
    lines = []
    for c in checks:
        first, *rest = c.detail.splitlines() or [""]
        lines.append(f"{mark[c.status]} {c.name}: {first}")
        lines += [f"         {line}" for line in rest]
        if c.fix:
            lines.append(f"         fix: {c.fix}")
    failed = sum(c.status == FAIL for c in checks)
    warned = sum(c.status == WARN for c in checks)
    lines.append(f"{failed} failed, {warned} warnings")
    return "\n".join(lines)
