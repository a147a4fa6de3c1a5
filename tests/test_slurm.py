"""scripts/distbench.sbatch under a real Slurm: a controller and a node daemon started on this machine (one
node, auth/none), the script submitted with sbatch, the rendezvous taken from Slurm's environment, parity and
a benchmark written by rank 0. Skips when Slurm's daemons are not installed (Debian: slurm-wlm)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distbench.results import load_results
from leftovers import stop
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ("slurmctld", "slurmd", "sbatch", "sinfo")
missing = [d for d in DAEMONS if shutil.which(d) is None]
pytestmark = [
    pytest.mark.skipif(
        bool(missing),
        reason=f"Slurm not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd must run as root"),
]

CONF = """\
ClusterName=distbench
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path):
    """slurmctld and slurmd in the foreground on loopback ports, with their own config; torn down after."""
    d = tmp_path / "slurm"
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(
        CONF.format(
            host=socket.gethostname().split(".")[0],
            ctld_port=free_port(),
            d_port=free_port(),
            d=d,
            cpus=os.cpu_count(),
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [
        subprocess.Popen(
            [shutil.which(name), "-D", *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for name, extra in (("slurmctld", ["-i"]), ("slurmd", []))
    ]
    try:
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline and "idle" not in state:
            time.sleep(0.5)
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True
            ).stdout
        assert "idle" in state, f"the local Slurm node never became idle ({state!r}); see {d}/slurm*.log"
        yield env
    finally:
        stop(*daemons, grace=15)


def wait_for_job(job_id: str, env: dict[str, str], timeout: float) -> str:
    """`scontrol show job` once the job has ended (polled every 0.5 s: sbatch --wait backs off to 10 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True
        ).stdout
        if any(
            f"JobState={s}" in state for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
        ):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env)
    raise AssertionError(f"Slurm job {job_id} did not end in {timeout:.0f}s")


@pytest.mark.slow  # two daemons, then one 2-rank torchrun step: ~25 s on 2 cores
def test_sbatch_script_runs_distbench_launch_with_slurms_rendezvous(slurm, tmp_path):
    out = tmp_path / "results"
    env = {
        **slurm,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "DISTBENCH_PROCS_PER_NODE": "2",
        "DISTBENCH_RDZV_PORT": str(free_port()),
        "DISTBENCH_PYTHON": sys.executable,
        "DISTBENCH_TORCHRUN_LOGS": str(tmp_path / "torchrun"),
    }
    submit = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes",
            "1",
            "--cpus-per-task",
            str(os.cpu_count()),
            "--time",
            "5",
            "--output",
            str(tmp_path / "job.out"),
            str(ROOT / "scripts" / "distbench.sbatch"),
            "--parity",
            "--",
            "--device",
            "cpu",
            "-s",
            "ddp",
            "-n",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "-o",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    state = wait_for_job(submit.stdout.strip().split(";")[0], env, timeout=300)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + log[-3000:]
    assert "distbench: 1 node(s) x 2 rank(s), rendezvous" in log
    assert "parity ddp ws2 gpt2-tiny (1 node(s)): ok" in log
    (result,) = load_results(out)
    assert result["status"] == "ok" and result["config"]["world_size"] == 2
    assert (result["env"]["nodes"], result["env"]["ranks_per_node"]) == (1, 2)
    assert list((tmp_path / "torchrun").glob("*/attempt_0")), (
        "torchrun's logs went elsewhere (a torchelastic_* in /tmp?)"
    )
