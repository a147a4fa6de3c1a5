"""Multi-node on one machine: two torchrun agents (2 nodes x 2 gloo ranks) meet at a local c10d rendezvous and
run `distbench launch`: parity against the single-process reference and a benchmark at world sizes 2 (one
node) and 4 (both), a model that fails on the second node reported with that rank's traceback, and every
process gone within a bound; a stranger process that writes a hostile job into a live launch's store. Also
the topology in the fingerprint and the intra/inter-node report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distbench.report import write_report
from distbench.results import load_results, make_result
from distbench.runtime.cluster import Launch, job_environment
from distbench.runtime.fingerprint import launch_topology
from distbench.strategies.fsdp import hybrid_shape
from hostile_pickles import Call, Glob, assemble
from leftovers import TAG_ENV, new_tag, stop, tagged_processes
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
FAILING = "cluster_models:fails_on_last_rank"
#: Seconds both agents get to start 4 ranks (torch + transformers imports), run 2x4 parity and benchmark jobs,
#: fail one, and exit: about 40 s alone on 2 cores.
BOUND_S = 240


def torchrun_agents(
    out: Path,
    nnodes: int,
    nproc: int,
    launch_args: list[str],
    run_args: list[str],
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """`nnodes` torchrun agents on this machine, as on `nnodes` hosts, meeting at one c10d endpoint (on
    `port`, default a free one), with `env` added to this process's environment."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])
        ),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    endpoint = f"127.0.0.1:{port or free_port()}"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nnodes),
                "--nproc-per-node",
                str(nproc),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                out.name,
                "--max-restarts",
                "0",
                "--log-dir",  # torchrun's default is a new torchelastic_* in /tmp, never removed
                str(out.parent / f"torchrun-agent{i}"),
                "-m",
                "distbench.cli",
                "launch",
                *launch_args,
                "--",
                "--device",
                "cpu",
                "-o",
                str(out),
                *run_args,
            ],
            env=env,
            stdout=(out.parent / f"agent{i}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(nnodes)
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One 2x2 launch: parity, then the benchmark, of ddp at ws 2 and 4 for a good and a failing model."""
    out = tmp_path_factory.mktemp("launch") / "results"
    t0 = time.monotonic()
    agents = torchrun_agents(
        out,
        2,
        2,
        ["--parity"],
        [
            "-s",
            "ddp",
            "-n",
            "2,4",
            "-m",
            f"gpt2-tiny,{FAILING}",
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--timeout",
            "60",
        ],
    )
    try:
        codes = [a.wait(timeout=max(1.0, BOUND_S - (time.monotonic() - t0))) for a in agents]
    finally:
        stop(*agents, grace=30)
    logs = "\n".join(p.read_text() for p in sorted(out.parent.glob("agent*.log")))
    return {"out": out, "codes": codes, "seconds": time.monotonic() - t0, "logs": logs}


@pytest.mark.slow  # shares one 2x2 launch: ~35 s on 2 cores, most of it 4 ranks importing torch
def test_a_failure_on_one_node_fails_the_launch_and_every_process_exits(launched):
    # A configuration failed: rank 0 exits 1 and hands that status to every follower, so both agents say so.
    assert launched["codes"] == [1, 1], launched["logs"][-3000:]
    assert launched["seconds"] < BOUND_S


@pytest.mark.slow  # shares one 2x2 launch: ~35 s on 2 cores, most of it 4 ranks importing torch
def test_parity_across_nodes_matches_the_reference(launched):
    rows = {
        (r["config"]["model"], r["config"]["world_size"]): r
        for r in json.loads((launched["out"] / "parity.json").read_text())
    }
    assert {k: r["status"] for k, r in rows.items()} == {
        ("gpt2-tiny", 2): "ok",
        ("gpt2-tiny", 4): "ok",
        (FAILING, 2): "ok",
        (FAILING, 4): "error",
    }
    assert "rank 3" in rows[(FAILING, 4)]["error"]
    assert "planted failure on rank 3" in rows[(FAILING, 4)]["error"]
    # the run's --seq-len, not the tier's default (on GPUs 256, past gpt2-tiny's 64 positions)
    assert {r["config"]["seq_len"] for r in rows.values()} == {32}


@pytest.mark.slow  # shares one 2x2 launch: ~35 s on 2 cores, most of it 4 ranks importing torch
def test_benchmark_results_carry_topology_and_the_failing_ranks_traceback(launched):
    results = {(r["config"]["model"], r["config"]["world_size"]): r for r in load_results(launched["out"])}
    assert set(results) == {
        ("gpt2-tiny", 2),
        ("gpt2-tiny", 4),
        (FAILING, 2),
        (FAILING, 4),
    }  # one each: rank 0
    for key in [("gpt2-tiny", 2), ("gpt2-tiny", 4), (FAILING, 2)]:
        assert results[key]["status"] == "ok", results[key]["error"]
        assert results[key]["metrics"]["tokens_per_s"] > 0
    env = results[("gpt2-tiny", 4)]["env"]
    assert (env["nodes"], env["ranks_per_node"]) == (2, 2)
    assert env["interconnect"] == {"intra_node": "host", "inter_node": "tcp"}
    failed = results[(FAILING, 4)]
    assert failed["status"] == "error"
    assert "===== rank 3: error" in failed["error"] and "planted failure on rank 3" in failed["error"]


@pytest.mark.slow  # shares one 2x2 launch: ~35 s on 2 cores, most of it 4 ranks importing torch
def test_report_separates_intra_from_inter_node_scaling(launched, tmp_path):
    md = write_report(load_results(launched["out"]), tmp_path).read_text()
    section = md.split("### Within a node and across nodes")[1].split("\n#")[0]
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ddp")
    ]
    # gpt2-tiny's workload; the failing model has no ok run across nodes, so no such section
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("2", "1", "intra-node (host)"),
        ("4", "2", "inter-node (tcp)"),
    ]
    assert md.count("### Within a node and across nodes") == 1


def test_inter_node_efficiency_is_against_one_full_node(tmp_path):
    env = {
        "nodes": 2,
        "ranks_per_node": 2,
        "interconnect": {"intra_node": "nvlink", "inter_node": "infiniband"},
    }
    wl = {"model": "m", "precision": "bf16", "seq_len": 8, "global_batch": 8, "micro_batch": 1}
    rs = [
        make_result({"strategy": "ddp", "world_size": ws, **wl}, metrics={"tokens_per_s": tps}, env=env)
        for ws, tps in ((1, 100.0), (2, 180.0), (4, 270.0))
    ]
    md = write_report(rs, tmp_path).read_text()
    section = md.split("### Within a node and across nodes")[1]
    assert "| ddp | 2 | 1 | intra-node (nvlink) | 180 | 90.0% | — |" in section
    assert "| ddp | 4 | 2 | inter-node (infiniband) | 270 | — | 75.0% |" in section  # 270 / (2 x 180)


def test_single_host_results_have_no_node_section(tmp_path):
    rs = [
        make_result(
            {"strategy": "ddp", "world_size": ws, "model": "m"},
            metrics={"tokens_per_s": 1.0},
            env=launch_topology({}),
        )
        for ws in (1, 2)
    ]
    assert "across nodes" not in write_report(rs, tmp_path).read_text()


def test_world_sizes_must_be_whole_nodes_of_the_launch():
    launch = Launch.from_env(
        {
            "RANK": "0",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        }
    )
    assert [launch.job_nodes(n) for n in (1, 2, 4, 8)] == [1, 1, 1, 2]
    with pytest.raises(Exception, match="not whole nodes of 4 ranks; use a multiple of 4"):
        launch.job_nodes(6)
    with pytest.raises(Exception, match="exceeds the 8 launched ranks"):
        launch.job_nodes(16)
    with pytest.raises(Exception, match="runs in every process of a torchrun job"):
        Launch.from_env({})


@pytest.mark.slow  # one agent, 2 ranks, a job left to time out: ~25 s on 2 cores
def test_a_hung_rank_is_reported_with_its_stack_and_every_process_exits(tmp_path):
    out = tmp_path / "results"
    t0 = time.monotonic()
    (agent,) = torchrun_agents(
        out,
        1,
        2,
        [],
        [
            "-s",
            "ddp",
            "-n",
            "2",
            "-m",
            "cluster_models:hangs_on_last_rank",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--timeout",
            "8",
        ],
    )
    try:
        code = agent.wait(timeout=120)
    finally:
        stop(agent, grace=30)
    log = (tmp_path / "agent0.log").read_text()
    assert code == 1 and time.monotonic() - t0 < 120, log[-3000:]
    (result,) = load_results(out)
    assert result["status"] == "error"
    assert "rank 1 did not finish in 8s" in result["error"]
    rank1 = result["error"].split("===== rank 1: timeout =====")[1]
    assert "Python stack at timeout" in rank1 and "hangs_on_last_rank" in rank1


@pytest.mark.slow  # one 1x2 launch: ~25 s on 2 cores
def test_a_rank_killed_by_a_signal_leaves_its_configuration_and_stack_in_the_log(tmp_path):
    """A rank that dies by SIGSEGV (as in a crash inside NCCL) writes no traceback of its own: the log still
    says which configuration it ran and, through faulthandler, the Python stack it died in, down to the
    collective it had entered."""
    out = tmp_path / "results"
    model = "cluster_models:segfaults_on_last_rank"
    (agent,) = torchrun_agents(
        out,
        1,
        2,
        [],
        ["-s", "ddp", "-n", "2", "-m", model, "--steps", "1", "--warmup", "0", "--timeout", "30"],
    )
    try:
        code = agent.wait(timeout=120)
    finally:
        stop(agent, grace=30)
    log = (tmp_path / "agent0.log").read_text()
    assert code != 0, log[-3000:]
    assert (
        f"distbench launch rank 1: job 0: distbench.jobs.bench:bench (ddp ws2 {model}) on 2 ranks" in log
    ), log[-3000:]
    assert "Segmentation fault" in log, log[-3000:]
    dying = log[log.index("Segmentation fault") :]
    assert "all_reduce" in dying and "segfault_inside_all_reduce" in dying, dying[:3000]


def test_a_job_sees_its_own_world_in_the_launchers_variables(monkeypatch):
    """DeepSpeed reads WORLD_SIZE as the world: a job of 1 rank in a launch of 2 nodes x 2 must see 1."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    launch = Launch(rank=0, world_size=4, local_rank=0, local_world_size=2)
    for n, local in ((1, 1), (2, 2), (4, 2)):
        with job_environment(launch, n):
            assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"]) == (str(n), str(local))
        assert os.environ["WORLD_SIZE"] == "4" and "LOCAL_WORLD_SIZE" not in os.environ


def test_hybrid_mesh_is_nodes_by_ranks_per_node_across_nodes():
    assert hybrid_shape(16, nodes=2) == (2, 8)
    assert hybrid_shape(12, nodes=3) == (3, 4)
    assert hybrid_shape(4) == (2, 2)  # one node: two replicas, as before


def test_launch_topology_from_torchruns_environment(monkeypatch):
    monkeypatch.setattr("distbench.machine.gpu_names", lambda: [])
    monkeypatch.setattr("distbench.machine.nvlink_links", lambda: None)
    two_nodes = launch_topology({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (two_nodes["nodes"], two_nodes["ranks_per_node"]) == (2, 4)
    assert two_nodes["interconnect"]["inter_node"] in ("infiniband", "tcp")  # this machine's HCAs decide
    assert launch_topology({}) == {
        "nodes": 1,
        "ranks_per_node": None,
        "interconnect": {"intra_node": "host", "inter_node": None},
    }
    monkeypatch.setattr("distbench.machine.gpu_names", lambda: ["NVIDIA H200"] * 2)
    monkeypatch.setattr("distbench.machine.nvlink_links", lambda: [18, 18])
    assert launch_topology({})["interconnect"]["intra_node"] == "nvlink"
    # a gloo run on that machine goes through the host and TCP, not over its GPUs' links or HCAs
    on_host = launch_topology({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, device_type="cpu")
    assert on_host["interconnect"] == {"intra_node": "host", "inter_node": "tcp"}
    assert launch_topology({}, device_type="cuda")["interconnect"]["intra_node"] == "nvlink"


# A second 2x2 launch, ~40 s on 2 cores: nightly. Per submission the shared 2x2 launch above trains across two
# torchrun nodes at parity, and the CPU tier builds fsdp_hybrid's nodes-by-ranks mesh (test_meshes.py, and
# test_hybrid_mesh_is_nodes_by_ranks_per_node_across_nodes below) and trains it at parity on one node.
@pytest.mark.slow
@pytest.mark.nightly
def test_the_hybrid_mesh_spans_the_nodes_at_parity(tmp_path):
    """fsdp_hybrid across two nodes: at world size 4 the mesh is (nodes x ranks per node), replicating across
    the nodes and sharding within each, and the losses are the single-process reference's, also once its
    checkpoint, saved across both nodes, continues on one."""
    out = tmp_path / "results"
    agents = torchrun_agents(
        out,
        2,
        2,
        ["--parity"],
        [
            "-s",
            "fsdp_hybrid",
            "-n",
            "2,4",
            "-m",
            "gpt2-tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--timeout",
            "60",
        ],
    )
    try:
        codes = [a.wait(timeout=BOUND_S) for a in agents]
    finally:
        stop(*agents, grace=30)
    logs = "\n".join(p.read_text() for p in sorted(out.parent.glob("agent*.log")))
    assert codes == [0, 0], logs[-3000:]
    rows = json.loads((out / "parity.json").read_text())
    assert {r["check"]: r["status"] for r in rows} == {
        "fsdp_hybrid ws2 gpt2-tiny (1 node(s))": "ok",
        "fsdp_hybrid ws4 gpt2-tiny (2 node(s))": "ok",
        "fsdp_hybrid gpt2-tiny saved at ws4 (2 node(s)), resumed at ws2 (1 node(s))": "ok",
    }, rows
    assert "parity fsdp_hybrid ws4 gpt2-tiny (2 node(s)): ok" in logs
    assert not (out / "parity-runs").exists()  # the shared runs and checkpoints went with the launch


@pytest.mark.slow  # a 1x2 launch per payload, stopped at its first job: ~15 s each on 2 cores
@pytest.mark.parametrize(
    "payload,when",
    [
        ("pickle", "now"),
        # nightly: a JSON job that would run code is refused as the pickle is, and a path outside --output
        # after the rank's post as before it
        pytest.param("json-os.system", "now", marks=pytest.mark.nightly),
        pytest.param("json-path-outside-output", "now", marks=pytest.mark.nightly),
        ("json-path-outside-output", "after-post"),
    ],
)
def test_a_stranger_writing_a_job_into_the_store_runs_nothing_and_stops_the_launch(payload, when, tmp_path):
    """A stranger process writes job/0 into a live launch's store (found where torchrun's rendezvous
    publishes it): a pickle whose load would create a marker, JSON naming os.system, or the held-out audit's
    reference_job told to keep its tensors in an existing file outside --output (issue 45). `now`: before
    rank 0 posts job/0, so rank 0 finds its key taken and says why a follower refuses what it holds (the
    follower may say so first). `after-post`: it replaces rank 0's job/0 as soon as it is there. Either way
    nothing ran, the file outside is as it was, the launch exits non-zero and no process of it remains."""
    marker, outside = tmp_path / "payload-ran", tmp_path / "outside.bin"
    outside.write_bytes(b"not the launch's")
    cfg = {"strategy": "ddp", "world_size": 2, "model": "gpt2-tiny", "global_batch": 4, "steps": 1}
    spec = {
        "pickle": assemble(Call(Glob("builtins", "open"), (str(marker), "w")), 4),
        "json-os.system": json.dumps(
            {"job": "os:system", "kwargs": {"command": f"touch {marker}"}, "world_size": 2, "timeout": 10}
        ).encode(),
        "json-path-outside-output": json.dumps(
            {
                "job": "distbench.jobs.checks:reference_job",
                "kwargs": {"cfg": cfg, "keep_tensors_at": str(outside)},
                "world_size": 2,
                "timeout": 30,
            }
        ).encode(),
    }[payload]
    (tmp_path / "payload").write_bytes(spec)
    tag, port, out = new_tag(), free_port(), tmp_path / "results"
    out.mkdir()
    tagged = {**os.environ, TAG_ENV: tag}
    stranger = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "stranger.py"), "127.0.0.1", str(port), out.name]
        + ["distbench/attempt_0/job/0", str(tmp_path / "payload"), when],
        env=tagged,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_args = ["-s", "ddp", "-n", "2", "-m", "gpt2-tiny", "--steps", "1", "--warmup", "0", "--timeout", "30"]
    (agent,) = torchrun_agents(out, 1, 2, [], run_args, port=port, env={TAG_ENV: tag})
    try:
        code = agent.wait(timeout=120)
        said = stranger.communicate(timeout=30)[0]
    finally:
        stop(agent, grace=30)
        stranger.kill()
    log = (tmp_path / "agent0.log").read_text()
    assert "stranger wrote distbench/attempt_0/job/0" in said, said
    assert code != 0, log[-3000:]
    assert not marker.exists()
    assert outside.read_bytes() == b"not the launch's", log[-3000:]
    refusals = [line for line in log.splitlines() if "refused job/0 from torchrun's store" in line]
    expected = {
        "pickle": "not UTF-8 JSON",
        "json-os.system": "key 'job': 'os:system' is not a job",
        "json-path-outside-output": f"key 'kwargs.keep_tensors_at': '{outside}' lies outside",
    }[payload]
    if when == "now":
        # Rank 0 finds its key taken and says what the follower makes of it; the follower says so itself when
        # it reads job/0 before torchrun stops it (rank 0's exit stops it: a race, either way is right).
        taken = [
            line
            for line in log.splitlines()
            if "job/0 was in torchrun's store before rank 0 posted it" in line
        ]
        assert len(taken) == 1 and f"a follower refuses what it holds: {expected}" in taken[0], log[-3000:]
        assert all(r.startswith("distbench launch: rank 1 refused job/0") and expected in r for r in refusals)
        assert len(refusals) <= 1, log[-3000:]
    else:
        # The follower polls for its job every 0.5 s, the stranger every 0.5 ms: the follower all but always
        # reads the swapped job and refuses it; in the rare read before the swap both ranks run rank 0's job
        # and rank 0 finds its key changed once the replies are in.
        refused = len(refusals) == 1 and expected in refusals[0]
        assert refused or "job/0 in torchrun's store was changed after rank 0 posted it" in log, log[-3000:]
    end = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < end:
        time.sleep(0.1)
    assert tagged_processes(tag) == {}


def _two_nodes_of_one_rank(tmp_path: Path, launch_args: list[str], run_args: list[str], bound: float) -> dict:
    """Two torchrun agents of one gloo rank each, as two hosts of one GPU each: exit codes, seconds, logs."""
    out = tmp_path / "results"
    t0 = time.monotonic()
    agents = torchrun_agents(out, 2, 1, launch_args, run_args)
    try:
        codes = [a.wait(timeout=max(1.0, bound - (time.monotonic() - t0))) for a in agents]
    finally:
        stop(*agents, grace=30)
    logs = {i: (tmp_path / f"agent{i}.log").read_text() for i in range(2)}
    return {"out": out, "codes": codes, "seconds": time.monotonic() - t0, "logs": logs}


@pytest.mark.slow  # two agents of one rank, 2 DeepSpeed stages x 2 world sizes, parity, resumes, bench: ~2 min
def test_deepspeed_holds_parity_across_two_nodes_of_one_rank(tmp_path):
    """Each job of a launch forms its own world: zero2 at world size 2 after world size 1 on rank 0 found
    DeepSpeed's clone of the destroyed 1-rank world (rank 0 raised, rank 1 waited in its collective), and
    ZeRO-3 at world size 1 of a 2-rank launch was refused by zero.Init for WORLD_SIZE=2."""
    run_args = ["-s", "zero2,zero3", "-n", "1,2", "-m", "gpt2-tiny", "--steps", "2", "--warmup", "1"]
    got = _two_nodes_of_one_rank(tmp_path, ["--parity"], [*run_args, "--timeout", "60"], bound=400)
    assert got["codes"] == [0, 0], got["logs"][0][-3000:] + got["logs"][1][-3000:]
    rows = json.loads((got["out"] / "parity.json").read_text())
    assert {r["check"]: r["status"] for r in rows} == {
        **{f"{s} ws{n} gpt2-tiny ({n} node(s))": "ok" for s in ("zero2", "zero3") for n in (1, 2)},
        **{
            f"{s} gpt2-tiny saved at ws2 (2 node(s)), resumed at ws1 (1 node(s))": "ok"
            for s in ("zero2", "zero3")
        },
    }, [r["error"] for r in rows if r["error"]]


@pytest.mark.slow  # two agents of one rank, one zero2 job left to hang: ~47 s on 2 loaded cores
def test_a_hang_in_a_zero2_step_makes_every_rank_say_where_it_waited_and_exit(tmp_path):
    """Rank 1 sleeps inside its forward; rank 0 waits in the step's gradient all-reduce. When the job's bound
    passes (--timeout 20: DeepSpeed's engine build on 2 loaded cores takes most of 10 s), every rank prints
    one line naming itself, the job, its configuration and where it waited, and both agents exit non-zero."""
    model = "cluster_models:hangs_in_a_step_on_last_rank"
    run_args = ["-s", "zero2", "-n", "2", "-m", model, "--steps", "2", "--warmup", "0", "--timeout", "20"]
    got = _two_nodes_of_one_rank(tmp_path, [], run_args, bound=120)
    every = "\n".join(got["logs"].values())
    assert all(c not in (0, None) for c in got["codes"]), every[-3000:]
    assert got["seconds"] < 75, f"{got['seconds']:.0f}s"
    job = f"job 0: distbench.jobs.bench:bench (zero2 ws2 {model}) on 2 ranks"
    lines = {
        r: [ln for ln in every.splitlines() if ln.startswith(f"distbench launch rank {r}: {job}: ")]
        for r in (0, 1)
    }
    said = {r: [ln for ln in found if ln.endswith("; exiting 1")] for r, found in lines.items()}
    assert [len(said[0]), len(said[1])] == [1, 1], lines
    assert "waiting in torch.distributed.all_reduce" in said[0][0] or "outcome of rank(s) 1" in said[0][0], (
        said
    )
    assert "waiting in cluster_models.py" in said[1][0] and "planted_hang_in_forward" in said[1][0], said
