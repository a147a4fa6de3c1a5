"""What a launch's store carries is data, never code (issue 30, item 6; src/distbench/runtime/jobspec.py).

torchrun's store takes writes from anyone who reaches its port. Every hostile or malformed message a
stranger could write there (a pickle whose load would create a marker file, in binary and in protocol 0's
ASCII; JSON naming os.system or torch.save as the job; unknown, missing, duplicated and mistyped keys; a
model factory, strategy option or path this rank's command line does not name; a world size or timeout
beyond the launch's; malformed outcomes; 8 MiB values) must be a JobSpecError of one short line naming the
key, and never run. A follower refuses one, says so in one line, posts why and stops; rank 0 stops when a
job key it posts was written before it, or changed while the job ran. Issue 45: a job swapped in right after
rank 0's post is refused by the follower when any path argument of any registered job leaves --output, and
run by no rank when it passes every check but is not rank 0's. The bites plant from outside the decoders a
tired engineer would write (unpickling, resolving any name, skipping the admission of models or paths, lax
types) and expect these checks to fail. tests/test_cluster.py has a stranger do this to a live torchrun
launch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pickle
import sys
import time
import typing
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist

from distbench.config import LocalPath, RunConfig, check_value
from distbench.errors import QUOTED_CHARS, ConfigError, JobSpecError
from distbench.jobs.bench import bench, collective_bandwidth, trace
from distbench.jobs.registry import LAUNCH_JOBS
from distbench.runtime import cluster, jobspec
from distbench.runtime.cluster import REFUSED, Cluster, Launch, follow
from distbench.runtime.context import RankContext
from distbench.runtime.jobspec import Admission, Job, JobRegistry, Stop, decode_outcome
from distbench.runtime.worker import resolve
from hostile_pickles import Call, Glob, assemble

CFG = RunConfig(strategy="ddp", world_size=2, model="gpt2-tiny", global_batch=4, micro_batch=2, steps=2)
DELETE = object()
#: The held-out audit's oversized job name (issue 45): 8 MiB, which a refusal once echoed whole.
BIG = "x" * (8 << 20)
#: "A few hundred characters": the longest refusal a follower prints, whatever a stranger wrote.
LINE_CHARS = 700


def admission(root: Path) -> Admission:
    """This rank's command line: gpt2-tiny, no options, --output root/out, 2 ranks, --timeout 60."""
    return Admission(frozenset({"gpt2-tiny"}), {}, str(root / "out"), world_size=2, timeout=60.0)


def _with(data: bytes, **changes: Any) -> bytes:
    """A job message with keys changed (dotted paths as a__b__c; DELETE removes one)."""
    msg = json.loads(data)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = msg
        for p in parents:
            node = node[p]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return json.dumps(msg).encode()


def cut(value: str) -> str:
    """How a refusal quotes a long string: its start and its length."""
    return f"{value[:QUOTED_CHARS]!r}... ({len(value):,} characters)"


def hostile_specs(root: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (what a stranger writes as a job, the text its refusal must hold). Payloads that run create
    files named root/ran-*."""
    good = LAUNCH_JOBS.encode(bench, {"cfg": CFG, "nvml": False}, 2, 60.0)
    traced = LAUNCH_JOBS.encode(trace, {"cfg": CFG, "out_dir": str(root / "out" / "t")}, 2, 60.0)
    ran = root / "ran"
    return {
        "pickle": (assemble(Call(Glob("builtins", "open"), (f"{ran}-pickle", "w")), 4), "not UTF-8 JSON"),
        "pickle-protocol-0-ascii": (f"(S'touch {ran}-p0'\nios\nsystem\n.".encode(), "not JSON"),
        "job-os.system": (
            _with(good, job="os:system", kwargs={"command": f"touch {ran}-os"}),
            "key 'job': 'os:system'",
        ),
        "job-torch.save": (_with(good, job="torch:save", kwargs={"f": f"{ran}-torch-save"}), "key 'job'"),
        "job-unregistered-suite-job": (
            _with(good, job="distbench.jobs.bench:collective_bandwidth", kwargs={}),
            "key 'job'",
        ),
        "job-not-a-string": (_with(good, job=["os", "system"]), "key 'job'"),
        "old-pickled-format-key": (_with(good, target="distbench.jobs.bench:bench"), "unknown key 'target'"),
        "missing-timeout": (_with(good, timeout=DELETE), "key 'timeout' is missing"),
        "kwargs-not-an-object": (_with(good, kwargs=[1]), "key 'kwargs'"),
        "unknown-parameter": (_with(good, kwargs__evil=1), "key 'kwargs.evil'"),
        "missing-parameter": (_with(good, kwargs__cfg=DELETE), "key 'kwargs.cfg' is missing"),
        "cfg-not-an-object": (_with(good, kwargs__cfg="ddp"), "key 'kwargs.cfg'"),
        "cfg-unknown-field": (_with(good, kwargs__cfg__evil=1), "unknown config key 'evil'"),
        "cfg-mistyped-field": (_with(good, kwargs__cfg__steps="5"), "steps"),
        "model-factory-not-on-the-command-line": (
            _with(good, kwargs__cfg__model="hostile_pickles:SetstateGadget"),
            "key 'kwargs.cfg.model'",
        ),
        "option-not-on-the-command-line": (
            _with(good, kwargs__cfg__options={"ds_config": str(root / "evil.json")}),
            "key 'kwargs.cfg.options.ds_config'",
        ),
        "path-outside-output": (
            _with(traced, kwargs__out_dir=str(root / "elsewhere")),
            "key 'kwargs.out_dir'",
        ),
        "path-climbing-out-of-output": (
            _with(traced, kwargs__out_dir=str(root / "out" / ".." / "up")),
            "key 'kwargs.out_dir'",
        ),
        "int-for-bool": (_with(good, kwargs__nvml=1), "key 'kwargs.nvml'"),
        "string-world-size": (_with(good, world_size="2"), "key 'world_size'"),
        "world-size-beyond-the-launch": (_with(good, world_size=8), "key 'world_size'"),
        "cfg-for-another-world-size": (_with(good, kwargs__cfg__world_size=1), "key 'kwargs'"),
        "timeout-beyond-the-launch": (_with(good, timeout=1e9), "key 'timeout'"),
        "nan-timeout": (good.replace(b'"timeout": 60.0', b'"timeout": NaN'), "NaN"),
        "duplicate-key": (good.replace(b'{"job"', b'{"job": "os:system", "job"'), "'job' appears twice"),
        "stop-with-a-string-status": (b'{"stop": true, "status": "0"}', "key 'status'"),
        "stop-with-a-job": (b'{"stop": true, "status": 0, "job": "os:system"}', "unknown key 'job'"),
        "stop-false": (b'{"stop": false, "status": 0}', "key 'stop'"),
        "a-json-array": (b"[]", "not an object"),
        "deep-nesting": (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        **oversized_specs(),
    }


@functools.cache
def oversized_specs() -> dict[str, tuple[bytes, str]]:
    """Each place a refusal quotes what the stranger wrote, given 8 MiB of it: the refusal holds its start and
    its size, not all of it (built once: megabytes each)."""
    good = LAUNCH_JOBS.encode(bench, {"cfg": CFG, "nvml": False}, 2, 60.0)
    traced = LAUNCH_JOBS.encode(trace, {"cfg": CFG, "out_dir": "/"}, 2, 60.0)
    return {
        "oversized-job-name": (_with(good, job=BIG), f"key 'job': {cut(BIG)} is not a job a launch runs"),
        "oversized-unknown-key": (_with(good, **{BIG: 1}), f"unknown key {cut(BIG)} (a job message"),
        "oversized-parameter-name": (
            _with(good, **{f"kwargs__{BIG}": 1}),
            f"key {cut(f'kwargs.{BIG}')}: distbench.jobs.bench:bench has no such parameter",
        ),
        "oversized-argument": (_with(good, kwargs__nvml=BIG), f"key 'kwargs.nvml' = {cut(BIG)} is invalid"),
        "oversized-model": (
            _with(good, kwargs__cfg__model=BIG),
            f"key 'kwargs.cfg.model': {cut(BIG)} is not a model",
        ),
        "oversized-config-key": (
            _with(good, **{f"kwargs__cfg__{BIG}": 1}),
            f"unknown config key {cut(BIG)}.",
        ),
        "oversized-option-name": (
            _with(good, kwargs__cfg__options={BIG: 1}),
            f"key {cut(f'kwargs.cfg.options.{BIG}')}: not the value",
        ),
        "oversized-path": (
            _with(traced, kwargs__out_dir=f"/{BIG}"),
            f"key 'kwargs.out_dir': {cut(f'/{BIG}')} lies outside",
        ),
        "oversized-stop": (json.dumps({"stop": BIG, "status": 0}).encode(), f"must be true, not {cut(BIG)}"),
        "oversized-status": (
            b'{"stop": true, "status": 1' + b"0" * 4000 + b"}",
            "0000 is no exit status (0-255)",
        ),
    }


def hostile_outcomes(root: Path) -> dict[str, bytes]:
    """What a stranger writes as a follower's outcome."""
    return {
        "pickle": assemble(Call(Glob("builtins", "open"), (f"{root}/ran-outcome", "w")), 4),
        "extra-key": b'{"status": "ok", "reply": 1, "eval": "x"}',
        "oversized-key": json.dumps({"status": "ok", "reply": 1, BIG: 1}).encode(),
        "unknown-status": b'{"status": "crashed", "text": ""}',
        "error-without-text": b'{"status": "error", "exc_type": "E"}',
        "text-not-a-string": b'{"status": "error", "exc_type": "E", "text": ["x"]}',
    }


def spec_problems(root: Path) -> Iterator[str]:
    """Each hostile job and outcome through the decoders: a problem unless refused with one JobSpecError
    line of at most a few hundred characters holding the expected text, and nothing ran."""
    root.mkdir(exist_ok=True)
    checks: list[tuple[str, Callable[[], Any], str]] = [
        (f"job {name}", lambda d=data: LAUNCH_JOBS.decode(d, admission(root)), expected)
        for name, (data, expected) in hostile_specs(root).items()
    ]
    checks += [
        (f"outcome {name}", lambda d=data: decode_outcome(d, 1), "")
        for name, data in hostile_outcomes(root).items()
    ]
    for what, decode, expected in checks:
        try:
            got = decode()
            yield f"{what} was accepted: {got!r}"[:300]
        except JobSpecError as e:
            if expected not in str(e) or "\n" in str(e) or len(str(e)) > LINE_CHARS:
                yield (
                    f"{what}: refused as {str(e)[:LINE_CHARS]!r} ({len(str(e)):,} characters), which should "
                    f"be one short line holding {expected!r}"
                )
        except Exception as e:  # noqa: BLE001 - anything but a refusal is a finding
            yield f"{what} raised {type(e).__name__}: {e}"[:300]
        if any(root.glob("ran-*")):
            yield f"{what} ran its payload"
            for f in root.glob("ran-*"):
                f.unlink()


def test_every_hostile_job_and_outcome_is_refused_in_one_line_and_runs_nothing(tmp_path):
    assert list(spec_problems(tmp_path)) == []


def test_the_launch_jobs_travel_and_arrive_as_sent(tmp_path):
    adm = admission(tmp_path)
    out_dir = str(tmp_path / "out" / "traces" / "r1")
    for fn, kwargs in [
        (bench, {"cfg": CFG, "nvml": False}),
        (trace, {"cfg": CFG, "out_dir": out_dir, "steps": 2}),
    ]:
        data = LAUNCH_JOBS.encode(fn, kwargs, 2, 60.0)
        digest = hashlib.sha256(data).digest()
        assert LAUNCH_JOBS.decode(data, adm) == Job(
            f"distbench.jobs.bench:{fn.__name__}", fn, kwargs, 2, 60.0, digest
        )
    assert LAUNCH_JOBS.decode(b'{"stop": true, "status": 3}', adm) == Stop(3)
    assert decode_outcome(b'{"status": "ok", "reply": {"x": [1.5]}}', 1) == {
        "status": "ok",
        "reply": {"x": [1.5]},
    }
    with pytest.raises(JobSpecError, match="collective_bandwidth is not one a launch runs"):
        LAUNCH_JOBS.encode(collective_bandwidth, {}, 2, 60.0)


def _decode_by_unpickling(data: bytes) -> Any:
    return pickle.loads(data)


def _decode_any_name(self: JobRegistry, data: bytes, adm: Admission) -> Job | Stop:
    """The old follower, over JSON: any module:function, its arguments as sent."""
    msg = json.loads(data)
    if "stop" in msg:
        return Stop(msg["status"])
    return Job(msg["job"], resolve(msg["job"]), msg["kwargs"], msg["world_size"], msg["timeout"], b"")


SPEC_MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "unpickles": lambda mp: mp.setattr(jobspec, "_json_object", _decode_by_unpickling),
    "resolves-any-name": lambda mp: mp.setattr(JobRegistry, "decode", _decode_any_name),
    "admits-any-model-or-option": lambda mp: mp.setattr(Admission, "check_config", lambda *a: None),
    "admits-any-path": lambda mp: mp.setattr(Admission, "check_path", lambda *a: None),
    "lax-types": lambda mp: mp.setattr(jobspec, "_checked", lambda annotation, value, key: value),
}


@pytest.mark.parametrize("mutant", list(SPEC_MUTANTS))
def test_a_decoder_that_admits_more_fails_the_check(mutant, monkeypatch, tmp_path):
    SPEC_MUTANTS[mutant](monkeypatch)
    assert next(spec_problems(tmp_path), None), f"the hostile specs pass a decoder that {mutant}"


def _launch(rank: int) -> Launch:
    return Launch(rank=rank, world_size=2, local_rank=rank, local_world_size=2)


FOLLOWED = [
    "pickle",
    "job-torch.save",
    "model-factory-not-on-the-command-line",
    "path-outside-output",
    "oversized-job-name",
]


@pytest.mark.parametrize("spec", FOLLOWED)
def test_a_follower_refuses_a_hostile_job_in_one_line_runs_nothing_and_stops_the_launch(
    spec, tmp_path, capsys
):
    """Through the follower's own loop, whatever decoder it uses: job/0 is hostile, job/1 a stop that only a
    follower that took job/0 reaches (its timeout cut to 1 s: a rank that ran it gives up on its peers)."""
    data, expected = hostile_specs(tmp_path)[spec]
    store = dist.HashStore()
    store.set("job/0", data if spec == "pickle" else _with(data, timeout=1))
    store.set("job/1", b'{"stop": true, "status": 0}')
    assert follow(_launch(1), store, torch.device("cpu"), LAUNCH_JOBS, admission(tmp_path)) == 1
    assert not list(tmp_path.glob("ran-*"))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("distbench launch: rank 1 refused job/0 from torchrun's store: ") and expected in line
    )
    assert len(line) <= LINE_CHARS
    assert store.get(REFUSED).decode().startswith("rank 1 refused job/0")  # every other rank stops on it


def _text_parameters() -> list[tuple[str, str]]:
    """(job, parameter) for every parameter of every registered job that takes a string, whatever its name or
    its annotation's metadata say: each could name a file on the rank's machine."""
    cases = []
    for name, fn in LAUNCH_JOBS.jobs.items():
        hints = typing.get_type_hints(fn, include_extras=True)
        for param in list(inspect.signature(fn).parameters)[1:]:
            try:
                check_value(hints[param], "/a/path", param)
            except ConfigError:
                continue
            cases.append((name, param))
    return cases


def _job_naming(name: str, param: str, path: str) -> bytes:
    """Job `name` with `param` naming `path` and its other required arguments in order (1 s timeout)."""
    fn = LAUNCH_JOBS.jobs[name]
    kwargs: dict[str, Any] = {}
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.name == param or p.default is p.empty:
            kwargs[p.name] = CFG if p.annotation in (RunConfig, "RunConfig") else path
    kwargs[param] = path
    return LAUNCH_JOBS.encode(fn, kwargs, 2, 1.0)


@pytest.mark.parametrize("name,param", _text_parameters())
def test_a_path_of_any_job_swapped_in_after_rank_0_posts_is_refused_before_anything_runs(
    name, param, tmp_path, capsys
):
    """Issue 45: a stranger swaps job/0, right after rank 0 posts a job, for a registered job whose
    path-valued argument names an existing file outside --output. The follower refuses it in one line naming
    the key and writes nothing; rank 0, with the same rules, would not post it."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the launch's")
    before = outside.stat().st_mtime_ns
    swapped = _job_naming(name, param, str(outside))
    store = dist.HashStore()
    cluster._post(store, "job/0", LAUNCH_JOBS.encode(bench, {"cfg": CFG, "nvml": False}, 2, 60.0))
    store.set("job/0", swapped)  # the stranger
    store.set("job/1", b'{"stop": true, "status": 0}')
    assert follow(_launch(1), store, torch.device("cpu"), LAUNCH_JOBS, admission(tmp_path)) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"distbench launch: rank 1 refused job/0 from torchrun's store: key 'kwargs.{param}': "
    )
    assert "lies outside this rank's --output" in line
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == (b"not the launch's", before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.bin"]
    rank_0 = Cluster(_launch(0), dist.HashStore(), torch.device("cpu"), LAUNCH_JOBS, admission(tmp_path))
    with pytest.raises(JobSpecError, match=f"key 'kwargs.{param}'"):
        rank_0.run_job(2, LAUNCH_JOBS.jobs[name], json.loads(swapped)["kwargs"] | {"cfg": CFG}, timeout=1.0)
    assert not rank_0.store.check(["job/0"])


def writes_where_told(ctx: RankContext, cfg: RunConfig, dump_to: str | None = None) -> dict[str, Any]:
    """A job whose path parameter is annotated as plain text."""
    return {}


def takes_declared_text(
    ctx: RankContext, cfg: RunConfig, at: LocalPath | None = None, mode: Literal["a", "b"] = "a"
) -> dict[str, Any]:
    """A job whose text parameters are a LocalPath and a Literal."""
    return {}


def test_a_job_taking_text_other_than_a_local_path_cannot_be_registered():
    with pytest.raises(
        TypeError, match="parameter dump_to takes text, which could name a file; annotate it LocalPath"
    ):
        JobRegistry([writes_where_told])
    assert list(JobRegistry([takes_declared_text]).jobs) == ["test_jobspec:takes_declared_text"]


def test_rank_0_quotes_a_forged_refusal_in_one_short_line():
    """The refusal every rank stops on is itself a key a stranger can write: 8 MiB with newlines in it."""
    store = dist.HashStore()
    forged = "a\nforged\x1b[2J" + BIG
    store.set(REFUSED, forged)
    with pytest.raises(JobSpecError) as refused:
        cluster._wait_key(store, "out/0/1", None)
    said = str(refused.value)
    assert said.startswith("a\\nforged\\x1b[2J") and said.endswith(f"({len(forged):,} characters)")
    assert "\n" not in said and len(said) <= LINE_CHARS


def test_a_launch_admits_what_its_own_command_line_names(tmp_path):
    from distbench.commands import launch, run
    from distbench.commands.parser import build_parser
    from distbench.workloads.models import MODELS

    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    args = build_parser([run]).parse_args(
        [
            "run",
            "-s",
            "zero2",
            "-m",
            "gpt2-tiny,mypkg.models:build",
            "--ds-config",
            str(ds),
            "-o",
            str(tmp_path),
        ]
        + ["--timeout", "90"]
    )
    adm = launch.admission(args, _launch(0), "cpu")
    assert adm.models >= {*MODELS, "mypkg.models:build"} and "mypkg.other:build" not in adm.models
    assert adm.options == {"ds_config": str(ds)}
    assert (adm.output, adm.world_size, adm.timeout) == (str(tmp_path), 2, 90.0)


def test_rank_0_stops_when_a_job_key_was_written_before_it(tmp_path):
    store = dist.HashStore()
    store.set("job/0", b'{"stop": true, "status": 0}')
    cluster = Cluster(_launch(0), store, torch.device("cpu"), LAUNCH_JOBS, admission(tmp_path))
    for _ in range(2):  # the first job, and every one after it
        with pytest.raises(
            JobSpecError, match=r"job/0 was in torchrun's store before rank 0 posted it: .*; it holds a stop$"
        ):
            cluster.run_job(2, bench, {"cfg": CFG}, timeout=2.0)  # short: a rank 0 that ran it gives up soon
    assert store.get("job/0") == b'{"stop": true, "status": 0}'  # nothing of rank 0's was posted over it


def test_rank_0_says_why_a_follower_refuses_the_job_it_found_in_its_key(tmp_path):
    """Torchrun stops the followers once rank 0 has exited, maybe before one read the stranger's job: rank 0's
    own line must say what is wrong with it."""
    store = dist.HashStore()
    store.set("job/0", b'{"job": "os:system", "kwargs": {}, "world_size": 1, "timeout": 1}')
    cluster = Cluster(_launch(0), store, torch.device("cpu"), LAUNCH_JOBS, admission(tmp_path))
    with pytest.raises(
        JobSpecError, match=r"; a follower refuses what it holds: key 'job': 'os:system' is not a job"
    ):
        cluster.run_job(2, bench, {"cfg": CFG}, timeout=2.0)


#: The store the job below writes to, as a stranger would while the job runs.
_STRANGERS_STORE: list[dist.Store] = []


def overwrites_its_own_job(ctx: RankContext) -> dict[str, Any]:
    """A job during which a stranger replaces the job's key with a job of its own."""
    _STRANGERS_STORE[0].set("job/0", b'{"job": "os:system", "kwargs": {}, "world_size": 1, "timeout": 1}')
    return {"rank": ctx.rank}


def test_rank_0_stops_when_its_posted_job_changes_while_it_runs(tmp_path):
    store = dist.HashStore()
    _STRANGERS_STORE[:] = [store]
    jobs = JobRegistry([overwrites_its_own_job])
    cluster = Cluster(_launch(0), store, torch.device("cpu"), jobs, admission(tmp_path))
    with pytest.raises(JobSpecError, match="job/0 in torchrun's store was changed after rank 0 posted it"):
        cluster.run_job(1, overwrites_its_own_job, {}, timeout=60.0)
    assert cluster.refused


def leaves_a_mark(ctx: RankContext, at: LocalPath) -> dict[str, Any]:
    """A job that leaves a file for each rank that runs it, in the directory it is told."""
    Path(at).mkdir(parents=True, exist_ok=True)
    (Path(at) / f"rank{ctx.rank}").touch()
    return {"rank": ctx.rank}


MARKS = JobRegistry([leaves_a_mark])


def _exit_status(pid: int, within_s: float) -> int:
    """The forked rank's exit status; it is killed, and the test fails, when it takes longer."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"rank 1 did not exit within {within_s:.0f} s")


@pytest.mark.parametrize("swapped", [False, True])
def test_a_job_swapped_after_rank_0_posts_it_is_run_by_no_rank(swapped, monkeypatch, tmp_path):
    """Two ranks over gloo, rank 1 a forked process. A stranger swaps job/0 right after rank 0 posts it (a
    hook on the post; rank 1 reads only after it) for the same job told to mark another directory inside
    --output: a job every check passes, yet not rank 0's. The ranks' digests of what they read differ, so
    both refuse and neither marks anything. Unswapped, both run it."""
    out = tmp_path / "out"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    post = cluster._post

    def post_then_swap(s: dist.Store, key: str, data: bytes) -> None:
        post(s, key, data)
        if swapped:
            s.set(key, MARKS.encode(leaves_a_mark, {"at": str(out / "swapped")}, 2, 30.0))
        s.set("posted", "1")

    monkeypatch.setattr(cluster, "_post", post_then_swap)
    monkeypatch.setattr(cluster, "_JOB_POLL_S", 0.02)  # rank 1 waiting for its next job
    # After each job a rank collects its garbage: seconds in a pytest process's heap; this job leaves none.
    monkeypatch.setattr(cluster, "gc", SimpleNamespace(collect=lambda: 0))
    pid = os.fork()
    if pid == 0:  # rank 1: follow the launch, its stderr to a file
        code = 3
        try:
            with open(tmp_path / "rank1.err", "w") as sys.stderr:
                mine = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
                mine.wait(["posted"])
                code = follow(_launch(1), mine, torch.device("cpu"), MARKS, admission(tmp_path))
        finally:
            os._exit(code)
    rank_0 = Cluster(_launch(0), store, torch.device("cpu"), MARKS, admission(tmp_path))
    try:
        if swapped:
            with pytest.raises(
                JobSpecError, match=r"job/0 .* was changed after rank 0 posted it \(rank\(s\) 1 read"
            ):
                rank_0.run_job(2, leaves_a_mark, {"at": str(out / "posted")}, timeout=30.0)
        else:
            assert rank_0.run_job(2, leaves_a_mark, {"at": str(out / "posted")}, timeout=30.0) == [
                {"rank": 0},
                {"rank": 1},
            ]
    finally:
        rank_0.release(int(swapped))  # a rank 1 that ran the job waits for the next
        status = _exit_status(pid, 30.0)
    said = (tmp_path / "rank1.err").read_text().splitlines()
    marks = sorted(str(p.relative_to(out)) for p in out.rglob("rank*")) if out.exists() else []
    if swapped:
        assert (status, marks) == (1, [])
        (line,) = said
        assert line.startswith("distbench launch: rank 1 refused job/0 from torchrun's store: job/0 ") and (
            "rank(s) 1 read other bytes, so no rank ran it" in line
        )
    else:
        assert (status, marks, said) == (0, ["posted/rank0", "posted/rank1"], [])


# --- each refusal's own words, and the registry's rules, each with its expectation written out -----------------


def takes_nothing(ctx: RankContext) -> dict[str, Any]:
    """A job of no arguments."""
    return {}


def counts_unnamed(ctx: RankContext, *sizes: int) -> dict[str, Any]:
    """A job whose arguments have no names."""
    return {}


def takes_any_options(ctx: RankContext, **options: int) -> dict[str, Any]:
    """A job whose arguments are named only by the sender."""
    return {}


def unannotated(ctx: RankContext, cfg: RunConfig, n=1) -> dict[str, Any]:
    """A job with a parameter of no annotation."""
    return {}


def _refusal(data: bytes, adm: Admission, jobs: JobRegistry = LAUNCH_JOBS) -> str:
    with pytest.raises(JobSpecError) as refused:
        jobs.decode(data, adm)
    return str(refused.value)


def test_each_refusal_names_its_key_and_says_what_is_wrong_and_what_to_do(tmp_path):
    """A follower prints the refusal as its one line: what a stranger wrote, quoted short, and what to do."""
    adm = admission(tmp_path)
    good = LAUNCH_JOBS.encode(bench, {"cfg": CFG, "nvml": False}, 2, 60.0)
    assert _refusal(_with(good, kwargs__cfg__model="mypkg.models:build"), adm) == (
        "key 'kwargs.cfg.model': 'mypkg.models:build' is not a model this rank's command line names (a factory "
        "is code the rank would import); name it with --model on every node"
    )
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    assert _refusal(_with(good, kwargs__cfg__options={"ds_config": str(ds)}), adm) == (
        "key 'kwargs.cfg.options.ds_config': not the value this rank's command line gives it; give every node "
        "the same --ds-config / --config"
    )
    pickled = b"\x80\x04\x95\x11\x00\x00\x00\x00\x00\x00\x00\x8c"
    assert _refusal(pickled, adm) == (
        "not UTF-8 JSON (starts b'\\x80\\x04\\x95\\x11\\x00\\x00\\x00\\x00'): distbench sends JSON only, and "
        "refuses a pickle unread"
    ), "the first 8 bytes, no more"
    assert _refusal(b'{"job": ', adm).startswith("not JSON (JSONDecodeError: Expecting value")
    assert _refusal(b"[1]", adm) == "a JSON list, not an object"
    assert _refusal(b'"job"', adm) == "a JSON str, not an object"
    assert _refusal(_with(good, target="x"), adm) == (
        "unknown key 'target' (a job message has job, kwargs, world_size, timeout)"
    )
    assert _refusal(b'{"stop": true, "status": 0, "job": 1}', adm) == (
        "unknown key 'job' (a stop message has stop, status)"
    )
    assert _refusal(_with(good, job="os:system"), adm) == (
        "key 'job': 'os:system' is not a job a launch runs (registered: distbench.jobs.bench:bench, "
        "distbench.jobs.bench:trace, distbench.jobs.checks:reference_job, distbench.jobs.train:train)"
    )
    assert (
        _refusal(_with(good, world_size=8), adm) == "key 'world_size': 8 exceeds the 2 ranks of this launch"
    )
    assert (
        _refusal(_with(good, timeout=61), adm) == "key 'timeout': 61 s exceeds this launch's --timeout 60 s"
    )
    assert _refusal(_with(good, timeout="60"), adm).startswith("key 'timeout' = '60' is invalid")
    assert _refusal(_with(good, kwargs=[1]), adm) == "key 'kwargs' must be an object, not list"
    assert _refusal(_with(good, kwargs__evil=1), adm) == (
        "key 'kwargs.evil': distbench.jobs.bench:bench has no such parameter (it takes cfg, nvml)"
    )
    assert _refusal(_with(good, kwargs__cfg="ddp"), adm) == (
        "key 'kwargs.cfg' must be an object of RunConfig fields, not str"
    )
    none = JobRegistry([takes_nothing])
    sent = none.encode(takes_nothing, {}, 1, 1.0)
    assert _refusal(_with(sent, kwargs__n=1), adm, none) == (
        "key 'kwargs.n': test_jobspec:takes_nothing has no such parameter (it takes none)"
    )
    with pytest.raises(JobSpecError) as refused:
        decode_outcome(b'{"status": "ok", "reply": 1, "eval": "x"}', 1)
    assert str(refused.value) == (
        "the outcome posted for rank 1 is not one a follower writes (keys ['eval', 'reply', 'status'])"
    )


def test_a_job_not_registered_is_not_sent_and_the_sender_is_told_where_to_register_it():
    jobs = JobRegistry([takes_nothing, leaves_a_mark])
    with pytest.raises(JobSpecError) as refused:
        jobs.encode(bench, {"cfg": CFG}, 2, 60.0)
    assert str(refused.value) == (
        "job distbench.jobs.bench:bench is not one a launch runs (registered: test_jobspec:leaves_a_mark, "
        "test_jobspec:takes_nothing); add it to distbench.jobs.registry"
    )


def test_a_strategy_option_is_admitted_with_the_value_this_ranks_command_line_gives_it_and_no_other(tmp_path):
    ours, theirs = tmp_path / "ds.json", tmp_path / "other.json"
    ours.write_text("{}")
    theirs.write_text("{}")
    adm = Admission(frozenset({"gpt2-tiny"}), {"ds_config": str(ours)}, str(tmp_path / "out"), 2, 60.0)
    cfg = dataclasses.replace(CFG, options={"ds_config": str(ours)})
    good = LAUNCH_JOBS.encode(bench, {"cfg": cfg}, 2, 60.0)
    job = LAUNCH_JOBS.decode(good, adm)
    assert isinstance(job, Job) and job.kwargs["cfg"].options == {"ds_config": str(ours)}
    with pytest.raises(JobSpecError, match="key 'kwargs.cfg.options.ds_config': not the value"):
        LAUNCH_JOBS.decode(_with(good, kwargs__cfg__options={"ds_config": str(theirs)}), adm)


def test_a_stop_carries_an_exit_status_of_0_to_255_and_no_other(tmp_path):
    adm = admission(tmp_path)
    assert LAUNCH_JOBS.decode(b'{"stop": true, "status": 0}', adm) == Stop(0)
    assert LAUNCH_JOBS.decode(b'{"stop": true, "status": 255}', adm) == Stop(255)
    assert _refusal(b'{"stop": true, "status": 256}', adm) == "key 'status': 256 is no exit status (0-255)"


def test_a_registry_checks_each_argument_against_the_registered_jobs_own_signature(tmp_path):
    """A registry made from jobs (not only the launch's): each parameter after the RankContext, as annotated;
    those without a default required, those with one optional; a LocalPath (or LocalPath | None) only inside
    --output; a Literal only its values."""
    adm = admission(tmp_path)
    jobs = JobRegistry([takes_declared_text, leaves_a_mark])
    inside, outside = str(tmp_path / "out" / "a"), str(tmp_path / "elsewhere")
    only_cfg = jobs.encode(takes_declared_text, {"cfg": CFG}, 2, 60.0)
    job = jobs.decode(only_cfg, adm)
    assert isinstance(job, Job) and job.kwargs == {"cfg": CFG}, "an argument with a default was required"
    every = jobs.encode(takes_declared_text, {"cfg": CFG, "at": inside, "mode": "b"}, 2, 60.0)
    job = jobs.decode(every, adm)
    assert isinstance(job, Job) and job.kwargs == {"cfg": CFG, "at": inside, "mode": "b"}
    assert _refusal(_with(every, kwargs__cfg=DELETE), adm, jobs) == (
        "key 'kwargs.cfg' is missing: test_jobspec:takes_declared_text needs it"
    )
    assert _refusal(_with(every, kwargs__at=outside), adm, jobs).startswith(
        f"key 'kwargs.at': {outside!r} lies outside this rank's --output"
    )
    assert _refusal(_with(every, kwargs__mode="c"), adm, jobs).startswith(
        "key 'kwargs.mode' = 'c' is invalid"
    )
    mark = jobs.encode(leaves_a_mark, {"at": inside}, 2, 60.0)
    job = jobs.decode(mark, adm)
    assert isinstance(job, Job) and job.kwargs == {"at": inside}, "a LocalPath was refused inside --output"
    assert _refusal(_with(mark, kwargs__at=outside), adm, jobs).startswith("key 'kwargs.at': ")
    assert _refusal(_with(mark, kwargs__at=DELETE), adm, jobs) == (
        "key 'kwargs.at' is missing: test_jobspec:leaves_a_mark needs it"
    )


def test_a_job_whose_arguments_lack_a_name_or_an_annotation_cannot_be_registered():
    """Its arguments from the network would have no schema to be checked against: *args, **kwargs, or a
    parameter without an annotation; and text other than a LocalPath could name any file."""
    for job, param in [(counts_unnamed, "sizes"), (takes_any_options, "options"), (unannotated, "n")]:
        with pytest.raises(TypeError) as refused:
            JobRegistry([job])
        assert str(refused.value) == (
            f"test_jobspec:{job.__name__} cannot run under a launch: its parameter {param} needs a name and an "
            "annotation, which its arguments from the network are checked against"
        )
    with pytest.raises(TypeError) as refused:
        JobRegistry([writes_where_told])
    assert str(refused.value) == (
        "test_jobspec:writes_where_told cannot run under a launch: its parameter dump_to takes text, which "
        "could name a file; annotate it LocalPath (or LocalPath | None), which each rank confines to its "
        "--output, or a Literal of the values it takes"
    )


def test_a_job_is_sent_only_as_strict_json():
    """No NaN or infinity (JSON has none, and every decoder refuses them) and nothing JSON cannot hold."""
    for timeout in (float("nan"), float("inf")):
        with pytest.raises(JobSpecError) as refused:
            LAUNCH_JOBS.encode(bench, {"cfg": CFG}, 2, timeout)
        assert str(refused.value).startswith(
            "the arguments of job distbench.jobs.bench:bench cannot travel as JSON (Out of range float values"
        )
    with pytest.raises(JobSpecError) as refused:
        LAUNCH_JOBS.encode(bench, {"cfg": CFG, "nvml": object()}, 2, 60.0)
    assert str(refused.value) == (
        "the arguments of job distbench.jobs.bench:bench cannot travel as JSON (Object of type object is not "
        "JSON serializable)"
    )


def test_a_followers_outcome_arrives_as_it_sent_it_error_or_reply():
    ok = {"status": "ok", "reply": {"loss": [2.5, 2.25]}}
    assert decode_outcome(jobspec.encode_outcome(ok, "j"), 1) == ok
    error = {"status": "error", "exc_type": "RuntimeError", "text": "NCCL timeout"}
    assert decode_outcome(jobspec.encode_outcome(error, "j"), 1) == error
    assert decode_outcome(json.dumps(error).encode(), 3) == error


@pytest.mark.parametrize("reply", [torch.ones(1), float("nan")], ids=["tensor", "nan"])
def test_a_reply_that_cannot_travel_as_json_becomes_that_ranks_error(reply):
    """Not an outcome rank 0 would refuse as a stranger's (NaN is no JSON), nor a crash of the follower: an
    error outcome that says what to do."""
    sent = jobspec.encode_outcome({"status": "ok", "reply": {"x": reply}}, "distbench.jobs.bench:bench")
    got = decode_outcome(sent, 1)
    assert set(got) == {"status", "exc_type", "text"} and (got["status"], got["exc_type"]) == (
        "error",
        "TypeError",
    )
    assert got["text"].startswith(
        "distbench.jobs.bench:bench returned data that cannot travel as JSON to rank 0 ("
    )
    assert got["text"].endswith("); return tensors from rank 0 only")
