"""doctor runs on a bare CPU machine and names the known breakages with their fix."""

from __future__ import annotations

import shutil

import pytest

from distbench import doctor
from distbench.doctor import FAIL, INFO, OK, WARN, check_cuda_arch_list, check_multicast, render, run_checks


def by_name(checks):
    return {c.name: c for c in checks}


def test_runs_cleanly_without_gpu_or_nvidia_smi(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(doctor, "cuda_devices", lambda: [])
    checks = by_name(run_checks({}))
    assert {
        "python",
        "torch",
        "deepspeed",
        "transformers",
        "gpus",
        "topology",
        "nccl env",
        "nvlink multicast",
        "TORCH_CUDA_ARCH_LIST",
        "CUDA_DEVICE_MAX_CONNECTIONS",
    } <= set(checks)
    assert checks["topology"].status == INFO and "nvidia-smi not found" in checks["topology"].detail
    assert checks["gpus"].status == INFO and "CPU tier only" in checks["gpus"].detail
    assert checks["nvlink multicast"].status == INFO  # no GPUs: nothing to break
    assert all(c.status in (OK, WARN, FAIL, INFO) for c in checks.values())
    assert "failed" in render(list(checks.values()))


def test_arch_list_with_letter_suffix_fires_with_its_fix(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(doctor, "package_version", lambda dist: "0.16.0" if dist == "deepspeed" else "5.0")
    check = by_name(run_checks())["TORCH_CUDA_ARCH_LIST"]
    assert check.status == FAIL
    assert "invalid literal for int() with base 10: '0a'" in check.detail
    assert check.fix == "export TORCH_CUDA_ARCH_LIST=9.0"
    assert "fix: export TORCH_CUDA_ARCH_LIST=9.0" in render([check])


def test_arch_list_without_suffix_passes(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert by_name(run_checks())["TORCH_CUDA_ARCH_LIST"].status == OK


@pytest.mark.parametrize(
    "value, fix",
    [
        ("8.0;9.0a", 'export TORCH_CUDA_ARCH_LIST="8.0;9.0"'),
        ("9.0a 10.0a+PTX", 'export TORCH_CUDA_ARCH_LIST="9.0;10.0+PTX"'),
    ],
)
def test_arch_list_mixed_entries(value, fix):
    check = check_cuda_arch_list({"TORCH_CUDA_ARCH_LIST": value}, deepspeed_installed=True)
    assert check.status == FAIL and check.fix == fix


@pytest.mark.parametrize("value", ["8.0;8.6;9.0", "7.5 8.0 9.0+PTX", "9.0+PTX"])
def test_arch_lists_deepspeed_parses_are_ok(value):
    assert check_cuda_arch_list({"TORCH_CUDA_ARCH_LIST": value}, deepspeed_installed=True).status == OK


def test_arch_suffix_without_deepspeed_is_a_warning():
    check = check_cuda_arch_list({"TORCH_CUDA_ARCH_LIST": "9.0a"}, deepspeed_installed=False)
    assert check.status == WARN and "not installed" in check.detail


def test_multicast_reported_and_fixed():
    on = check_multicast({"NCCL_NVLS_ENABLE": "1"}, have_gpus=True)
    assert on.status == WARN and "NCCL_NVLS_ENABLE=1" in on.detail
    assert on.fix == "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    off = check_multicast(
        {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"},
        have_gpus=True,
    )
    assert off.status == OK


def test_nccl_env_and_max_connections_listed():
    checks = by_name(run_checks({"NCCL_DEBUG": "INFO", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}))
    assert "NCCL_DEBUG=INFO" in checks["nccl env"].detail
    assert checks["CUDA_DEVICE_MAX_CONNECTIONS"].fix


def test_an_interrupted_extension_build_is_named_with_the_lock_to_remove(tmp_path):
    """A JIT build's lock older than STALE_LOCK_S is a killed build's: named with its age and the rm that frees
    every later build; a fresh lock (a build compiling now) and a finished build's folder are fine."""
    import os

    old = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    now = 1_000_000.0
    os.utime(old, (now - 3600, now - 3600))
    os.utime(fresh, (now - 60, now - 60))
    check = doctor.check_extension_locks(str(tmp_path), now)
    assert check.status == WARN
    assert f"{old} (60 min old)" in check.detail and str(fresh) not in check.detail
    assert check.fix.endswith(f"rm {old}")
    os.utime(old, (now - doctor.STALE_LOCK_S + 1, now - doctor.STALE_LOCK_S + 1))
    assert doctor.check_extension_locks(str(tmp_path), now).status == OK


def test_extensions_are_looked_for_where_torch_builds_them(monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    assert doctor.extensions_root({"TORCH_EXTENSIONS_DIR": "/x/ext"}) == "/x/ext"
    assert doctor.extensions_root({}) == get_default_build_root()
