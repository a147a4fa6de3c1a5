"""Rules of what an A/B comparison compares (gate/variants.py): how a variant is written and described, the
environment and interpreter its server gets, and how the runner talks to that server, waits for it and stops
it. The servers here are a few lines of Python standing in for `python -m distbench.gate.serve` (a variant's
python= is any executable): they start in a fraction of a second and train nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distbench.errors import ConfigError
from distbench.gate import variants
from distbench.gate.serve import FDS_ENV
from distbench.gate.variants import Variant, VariantProcess, VariantStartError, parse_variant

#: a variant server that answers each request with what it saw: the request, its argv, working directory,
#: stdin and the environment variables the test asks about (and logs each request to FAKE_LOG); {"op": "hang"}
#: gets no answer, "die" ends it, "orphan" ends it leaving a child with the reply pipe, "slow" answers after
#: 1.3 s, "split" in two writes, "child" starts a process in its session and answers its pid, "deaf" stops
#: reading requests, "stubborn" makes it stay after the end of its requests
FAKE_SERVER = """\
import json, os, subprocess, sys, time
r, w = (int(x) for x in os.environ[{fds!r}].split(","))
hello = json.loads(os.environ.get("FAKE_HELLO", '{{"ready": true, "protocol": 4}}'))
if hello is None:
    print("ImportError: this variant's distbench does not import", file=sys.stderr)
    sys.exit(1)
requests, replies = os.fdopen(r), os.fdopen(w, "w")
replies.write(json.dumps(hello) + "\\n")
replies.flush()
stubborn = False
for line in requests:
    req = json.loads(line)
    if os.environ.get("FAKE_LOG"):
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(line)
    op = req.get("op")
    if req.get("recycle"):
        replies.write(json.dumps({{"recycled": True}}) + "\\n")
        replies.flush()
        continue
    if op == "hang":  # no answer, ever (and, at the end of requests, an exit)
        continue
    if op == "die":
        sys.exit(3)
    if op == "orphan":  # a rank that outlives the server, holding the reply pipe open
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=(w,))
        sys.exit(3)
    if op == "slow":
        time.sleep(1.3)
    stubborn = stubborn or op == "stubborn"
    reply = {{"request": req, "argv": sys.argv[1:], "cwd": os.getcwd(), "stdin": os.readlink("/proc/self/fd/0"),
             "env": {{k: os.environ.get(k) for k in req.get("show", [])}}}}
    if op == "child":
        reply["pid"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid
    if op == "two":
        replies.write(json.dumps({{"first": 1}}) + "\\n" + json.dumps({{"second": 2}}) + "\\n")
        replies.flush()
        continue
    text = json.dumps(reply) + "\\n"
    if op == "split":  # one reply in two writes, apart
        replies.write(text[:20])
        replies.flush()
        time.sleep(0.2)
        text = text[20:]
    replies.write(text)
    replies.flush()
    if op == "deaf":  # stops reading requests, ends soon after
        requests.close()
        time.sleep(0.5)
        sys.exit(0)
if stubborn:  # does not end at the end of its requests
    time.sleep(60)
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    """An executable that stands where a variant's interpreter would and runs FAKE_SERVER."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER.format(fds=FDS_ENV))
    exe = tmp_path / "python-fake"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def server(fake_python: str, tmp_path: Path):
    proc = VariantProcess(Variant("head", python=fake_python), tmp_path / "work", "cpu", tmp_path)
    yield proc
    proc.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def gone(pid: int, within: float = 5.0) -> bool:
    """The process ended within `within` seconds (a SIGKILL is delivered, not waited for)."""
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


# ---- how a variant is written ------------------------------------------------------------------------------


def test_a_variants_items_are_read_whatever_their_order_and_spacing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev=, tree=, path= (repeatable, in order), python=, env.NAME=; spaces around items and empty items are
    ignored; a value keeps any '=' after the first."""
    tree = tmp_path / "tree"
    (tree / "src" / "distbench").mkdir(parents=True)
    (tmp_path / "p1").mkdir()
    v = parse_variant(
        "base", f" tree={tree} ,, env.A=x=y ,path={tmp_path / 'p1'},env.B=2, python={sys.executable} "
    )
    assert v == Variant(
        "base", sys.executable, str(tree.resolve()), None, {"A": "x=y", "B": "2"}, (str(tmp_path / "p1"),)
    )
    assert parse_variant("head", "rev=v1.2,env.NCCL_ALGO=Ring") == Variant(
        "head", rev="v1.2", env={"NCCL_ALGO": "Ring"}
    )
    assert parse_variant("head", "") == Variant("head")
    monkeypatch.chdir(tmp_path)  # relative tree= and path= are resolved where the command runs
    rel = parse_variant("x", "tree=tree,path=p1")
    assert (rel.tree, rel.path) == (str(tree.resolve()), (str((tmp_path / "p1").resolve()),))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rev=", "variant head: 'rev=' is not KEY=VALUE (rev=, tree=, python=, env.NAME=)"),
        ("env.=1", "variant head: unknown item 'env.'; use rev=, tree=, path=, python= or env.NAME="),
        ("ENV.X=1", "variant head: unknown item 'ENV.X'"),
        ("rev=a,tree={tree}", "variant head: give rev= or tree=, not both"),
        ("tree={tmp}", "variant head: tree={tmp} holds no src/distbench; give a distbench checkout"),
        ("path={tmp}/missing", "variant head: path={tmp}/missing is not a directory"),
        ("python={tmp}/missing", "variant head: python={tmp}/missing is not an executable interpreter"),
    ],
)
def test_a_bad_item_is_refused_naming_the_variant_and_the_item(
    tmp_path: Path, spec: str, message: str
) -> None:
    tree = tmp_path / "tree"
    (tree / "src" / "distbench").mkdir(parents=True)
    (tmp_path / "plain").write_text("not executable")
    spec = spec.format(tree=tree, tmp=tmp_path)
    with pytest.raises(ConfigError) as e:
        parse_variant("head", spec)
    assert str(e.value).startswith(message.format(tmp=tmp_path))
    with pytest.raises(ConfigError, match="not an executable"):
        parse_variant("head", f"python={tmp_path / 'plain'}")


def test_a_variant_is_described_by_its_code_then_its_paths_interpreter_and_environment(
    tmp_path: Path,
) -> None:
    """What the report and a start failure call a variant: its code (rev=, else tree=, else this checkout),
    each path=, the interpreter only where it is not this one, and env. items sorted by name."""
    assert Variant("a").describe() == "this checkout"
    assert Variant("a", rev="v1", env={"Z": "1", "A": "2"}).describe() == "rev=v1, env.A=2, env.Z=1"
    v = Variant("a", python="/opt/py/bin/python", tree="/t", path=("/p", "/q"))
    assert v.describe() == "tree=/t, path=/p, path=/q, python=/opt/py/bin/python"
    assert Variant("a", python=sys.executable, tree="/t").describe() == "tree=/t"


def test_a_start_failure_names_its_variant() -> None:
    e = VariantStartError("head", "variant head did not start")
    assert isinstance(e, ConfigError) and e.label == "head" and str(e) == "variant head did not start"


# ---- the server's process ------------------------------------------------------------------------------------


def test_the_servers_environment_puts_the_variants_code_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The variant's env. items over this process's environment, the device and unbuffered output set, and
    PYTHONPATH: the variant's src (its checkout's, or this distbench's), then its path= directories, then
    what PYTHONPATH was."""
    monkeypatch.setenv("PYTHONPATH", "/before")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    monkeypatch.setenv("KEPT", "1")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    v = Variant(
        "head", tree="/t", env={"NCCL_ALGO": "Ring", "DISTBENCH_AB_DEVICE": "ignored"}, path=("/p", "/q")
    )
    env = VariantProcess(v, tmp_path, "cuda", tmp_path).environment()
    assert env["PYTHONPATH"] == os.pathsep.join(["/t/src", "/p", "/q", "/before"])
    assert (env["NCCL_ALGO"], env["KEPT"], env["DISTBENCH_AB_DEVICE"], env["PYTHONUNBUFFERED"]) == (
        "Ring",
        "1",
        "cuda",
        "1",
    )
    monkeypatch.delenv("PYTHONPATH")
    this = VariantProcess(Variant("base"), tmp_path, "cpu", tmp_path)
    assert this.src == Path(variants.__file__).resolve().parents[2]  # the src/ this distbench is in
    assert this.environment()["PYTHONPATH"] == str(this.src)


def test_a_server_starts_with_its_interpreter_announces_itself_and_answers_in_order(
    server: VariantProcess,
) -> None:
    """`python -m distbench.gate.serve` with the variant's interpreter, in its tree (or first path=) or here;
    the first line is the server's hello (its protocol: 1 where it names none); each request goes with its
    timeout and its reply comes back, a line at a time."""
    assert server.request({"op": "x"}, 5.0)["request"] == {"op": "x", "timeout": 5.0}
    assert server.info == {"ready": True, "protocol": 4} and server.protocol == 4
    got = server.run({"strategy": "ddp"}, 7.0)
    assert got["request"] == {"cfg": {"strategy": "ddp"}, "timeout": 7.0}
    assert got["argv"] == ["-m", "distbench.gate.serve"] and got["cwd"] == os.getcwd()
    assert server.send({"op": "two"})
    assert server.receive(5.0) == {"first": 1} and server.receive(5.0) == {"second": 2}
    server.info = {"ready": True}
    assert server.protocol == 1


def test_a_server_runs_in_its_tree_or_its_first_path(fake_python: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "src" / "distbench").mkdir(parents=True)
    (tmp_path / "p").mkdir()
    for variant, where, src in (
        (Variant("t", python=fake_python, tree=str(tree)), tree, tree / "src"),
        (Variant("p", python=fake_python, path=(str(tmp_path / "p"), str(tree))), tmp_path / "p", None),
    ):
        proc = VariantProcess(variant, tmp_path, "cpu", tmp_path)
        try:
            got = proc.request({"show": ["PYTHONPATH", "DISTBENCH_AB_DEVICE"]}, 5.0)
        finally:
            proc.close()
        assert got["cwd"] == str(where) and got["env"]["DISTBENCH_AB_DEVICE"] == "cpu"
        assert got["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(src or proc.src)


def test_a_server_that_does_not_start_is_a_start_error_with_its_log(
    server: VariantProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No hello, or one that is not ready: VariantStartError naming the variant, what it is, the last lines
    of its log and where the log is; nothing is left running."""
    monkeypatch.setenv("FAKE_HELLO", "null")
    with pytest.raises(VariantStartError) as e:
        server.start()
    assert e.value.label == "head" and str(e.value) == (
        f"variant head (this checkout, python={server.variant.python}) did not start: ImportError: this "
        f"variant's distbench does not import (full log: {server.log})"
    )
    assert server._proc is None and server._reply_fd is None
    monkeypatch.setenv("FAKE_HELLO", '{"ready": false}')
    with pytest.raises(VariantStartError):
        server.start()


def test_the_log_tail_is_its_last_lines_or_says_there_is_none(server: VariantProcess) -> None:
    server.log.write_text("".join(f"line {i}\n" for i in range(8)))
    assert server._log_tail() == "line 3 | line 4 | line 5 | line 6 | line 7"
    assert server._log_tail(2) == "line 6 | line 7"
    server.log = server.log.parent / "missing" / "head.log"
    assert server._log_tail() == "(no log)"


def test_a_server_that_does_not_answer_in_time_is_killed_and_the_next_request_starts_another(
    server: VariantProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply may take the request's timeout plus REPLY_MARGIN_S; past that receive() answers None and the
    server goes (with its session); the next request starts a fresh one."""
    monkeypatch.setattr(variants, "REPLY_MARGIN_S", 0.5)
    first = server.request({"op": "child"}, 5.0)
    child = first["pid"]
    started = time.monotonic()
    assert server.request({"op": "hang"}, 0.3) is None
    assert 0.8 <= time.monotonic() - started < 5
    assert server._proc is None and gone(child)
    assert server.request({"op": "x"}, 5.0)["request"]["op"] == "x"


def test_a_server_that_dies_answers_none_at_once_and_is_restarted(server: VariantProcess) -> None:
    assert server.request({"op": "x"}, 5.0) is not None
    started = time.monotonic()
    assert server.request({"op": "die"}, 120.0) is None
    assert time.monotonic() - started < 10 and server._proc is None
    assert server.request({"op": "x"}, 5.0) is not None


def test_recycling_asks_for_fresh_ranks_and_a_server_that_does_not_answer_it_is_stopped(
    server: VariantProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """{"recycle": true} (serve.py closes its rank pools); a server that gives no answer within
    REPLY_MARGIN_S is stopped. A server not started has nothing to recycle."""
    server.recycle()
    assert server._proc is None
    assert server.request({"op": "x"}, 5.0) is not None
    server.recycle()  # the fake answers the recycle like any request
    assert server._proc is not None and server._buffer == b""
    monkeypatch.setattr(variants, "REPLY_MARGIN_S", 0.3)
    server._proc.kill()
    server._proc.wait()
    server.recycle()
    assert server._proc is None


def test_closing_ends_the_servers_whole_session_and_its_pipes(server: VariantProcess) -> None:
    """The server's ranks live in its process session: close() takes them all, and the pipes' descriptors."""
    child = server.request({"op": "child"}, 5.0)["pid"]
    fd = server._reply_fd
    server.close()
    assert gone(child) and server._proc is None and server._requests is None
    with pytest.raises(OSError):
        os.fstat(fd)
    server.close()  # twice is harmless


def test_a_rev_variant_is_checked_out_once_into_a_locked_worktree_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev=: a detached worktree of the repository around here, made once under the work folder; with a lock
    reason the worktree is locked (prune leaves it); remove_worktree takes it, locked or not."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout

    git("init", "-q", "-b", "main")
    (repo / "f").write_text("1\n")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    wt = tmp_path / "wt"
    variants.add_worktree("main", wt, repo, lock="owned by test")  # a branch's name: its commit, detached
    listed = git("worktree", "list", "--porcelain")
    assert f"worktree {wt}" in listed and "locked owned by test" in listed and "detached" in listed
    variants.remove_worktree(wt)
    assert not wt.exists() and str(wt) not in git("worktree", "list")
    with pytest.raises(
        ConfigError, match=r"git rev-parse --verify nope failed: \[.fatal: Needed a single revision.\]"
    ):
        variants.git("rev-parse", "--verify", "nope", cwd=repo)
    assert variants.git("rev-parse", "--abbrev-ref", "HEAD", cwd=repo) == "main"
    variants.remove_worktree(tmp_path / "gone")  # nothing there: nothing to do
    proc = VariantProcess(Variant("base", rev="HEAD"), tmp_path / "work", "cpu", tmp_path)
    proc.workdir.mkdir()
    monkeypatch.chdir(repo)  # a rev= is of the repository around the command
    proc.checkout()
    proc.checkout()
    assert proc.tree == str(tmp_path / "work" / "worktree-base") and (Path(proc.tree) / "f").exists()
    assert git("worktree", "list").count("worktree-base") == 1
    proc.remove_checkout()
    assert not (tmp_path / "work" / "worktree-base").exists()
    proc.remove_checkout()
    proc.checkout()  # once more after its removal: checked out anew
    assert (Path(proc.tree) / "f").exists()
    proc.remove_checkout()


def test_a_worktree_whose_folder_was_deleted_unseen_is_checked_out_again_and_git_errors_say_their_last_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A killed run's worktree folder may be gone while git still lists it: add_worktree forces the checkout
    over it. A failing git is a ConfigError with the last line git wrote; removing a folder that is not a
    worktree fails quietly (git's words are captured, not printed)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)
    (repo / "f").write_text("1\n")
    subprocess.run(["git", "add", "f"], cwd=repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one"],
        cwd=repo,
        check=True,
    )
    wt = tmp_path / "wt"
    variants.add_worktree("HEAD", wt, repo)
    subprocess.run(["rm", "-rf", str(wt)], check=True)
    variants.add_worktree("HEAD", wt, repo)
    assert (wt / "f").exists()
    with pytest.raises(ConfigError) as e:
        variants.git("log", "no-such-revision", cwd=repo)
    assert (
        str(e.value)
        == "git log no-such-revision failed: [\"'git <command> [<revision>...] -- [<file>...]'\"]"
    )
    capfd.readouterr()
    (tmp_path / "plain").mkdir()
    variants.remove_worktree(tmp_path / "plain")
    assert capfd.readouterr() == ("", "") and (tmp_path / "plain").is_dir()


@pytest.fixture
def hanging_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `git` that never answers first on PATH, and subprocess.run's bounds scaled down 1000x, so that 120 s
    is met in 0.12 s; a run without a bound is cut at 5 s."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "git").write_text("#!/bin/sh\nexec sleep 30\n")
    (bin_ / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    run = subprocess.run

    def scaled(*args, timeout=None, **kwargs):
        return run(*args, timeout=5.0 if timeout is None else timeout / 1000, **kwargs)

    monkeypatch.setattr(subprocess, "run", scaled)


@pytest.fixture
def scaled_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Popen.wait's bounds scaled down 100x (30 s: 0.3 s); a wait without a bound is cut at 5 s."""
    wait = subprocess.Popen.wait

    def scaled(self, timeout=None):
        return wait(self, timeout=5.0 if timeout is None else timeout / 100)

    monkeypatch.setattr(subprocess.Popen, "wait", scaled)


def test_a_git_that_hangs_is_stopped_within_its_bound(
    hanging_git: list[float | None], tmp_path: Path
) -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        variants.git("status", cwd=tmp_path)
    (tmp_path / "wt").mkdir()
    with pytest.raises(subprocess.TimeoutExpired):
        variants.remove_worktree(tmp_path / "wt")
    assert time.monotonic() - started < 2.0


@pytest.mark.usefixtures("scaled_wait")
def test_a_server_that_stays_after_its_requests_end_is_killed_with_its_session(
    server: VariantProcess,
) -> None:
    """close() ends the requests and waits a bounded while (30 s) for the server to go, then kills its
    session."""
    child = server.request({"op": "child"}, 5.0)["pid"]
    server.request({"op": "stubborn"}, 5.0)
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 3.0 and gone(child) and server._proc is None


def test_a_server_is_given_no_input_of_the_runners(server: VariantProcess) -> None:
    """Its stdin is /dev/null, whatever the runner's is (a terminal, a pipe)."""
    read, write = os.pipe()
    saved = os.dup(0)
    os.dup2(read, 0)
    try:
        server.start()
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)
    assert server.request({"op": "x"}, 5.0)["stdin"] == "/dev/null"


def test_a_reply_is_read_whole_across_writes_and_however_long_it_takes_within_the_bound(
    server: VariantProcess,
) -> None:
    """A reply in pieces is joined up to its newline; a server still working after a second of silence is
    waited for (it is checked on, not given up)."""
    assert server.request({"op": "split"}, 5.0)["request"]["op"] == "split"
    started = time.monotonic()
    assert server.request({"op": "slow"}, 5.0)["request"]["op"] == "slow"
    assert time.monotonic() - started >= 1.3 and server._proc is not None


def test_a_server_that_dies_leaving_its_ranks_with_the_pipe_is_given_up_within_a_second(
    server: VariantProcess,
) -> None:
    """Its ranks may keep the reply pipe open after the server is gone: the wait checks on the server itself
    every second, so a dead one is not waited for until the request's timeout."""
    assert server.request({"op": "x"}, 5.0) is not None
    started = time.monotonic()
    assert server.request({"op": "orphan"}, 60.0) is None
    assert time.monotonic() - started < 1.9 and server._proc is None


def test_no_reply_is_read_at_or_past_its_deadline(
    server: VariantProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the clock standing at the deadline (a timeout of 0) nothing is read, even a reply already there."""
    assert server.send({"op": "x"})
    time.sleep(0.3)  # its reply is in the pipe
    monkeypatch.setattr(variants.time, "monotonic", lambda: 100.0)
    assert server._reply(0.0) is None


def test_a_reply_asked_of_a_server_not_running_is_none(server: VariantProcess) -> None:
    assert server.receive(1.0) is None and server._proc is None


def test_a_server_that_stopped_reading_is_closed_and_the_send_says_so(server: VariantProcess) -> None:
    assert server.request({"op": "deaf"}, 5.0) is not None
    time.sleep(0.1)
    assert server.send({"op": "x"}) is False and server._proc is None


def test_recycling_sends_the_recycle_request(
    server: VariantProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "requests.log"))
    assert server.request({"op": "x"}, 5.0) is not None
    server.recycle()
    logged = [json.loads(line) for line in (tmp_path / "requests.log").read_text().splitlines()]
    assert logged == [{"op": "x", "timeout": 5.0}, {"recycle": True}] and server._proc is not None


def test_a_log_with_bytes_that_are_not_utf_8_is_still_read(server: VariantProcess) -> None:
    server.log.write_bytes(b"rank 0: \xff\xfe garbled\nImportError: no module\n")
    assert server._log_tail() == "rank 0: \ufffd\ufffd garbled | ImportError: no module"


# ---- the bounds of the runner's own waits, on simulated time ------------------------------------------------


def _git_taking(seconds: float, monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """subprocess.run as for a `git` that answers after `seconds`: past a bound shorter than that it raises
    TimeoutExpired (as subprocess.run does when it stops the process), else it answers. The bounds asked."""
    asked: list[float | None] = []

    def run(args, *, timeout=None, **kwargs):
        asked.append(timeout)
        if timeout is not None and seconds > timeout:
            raise subprocess.TimeoutExpired(args, timeout)
        return subprocess.CompletedProcess(args, 0, stdout="answer\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    return asked


@pytest.mark.parametrize(("seconds", "answers"), [(119.9, True), (120.1, False)])
def test_a_git_command_is_waited_for_two_minutes_and_no_longer(
    seconds: float, answers: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """git() (a rev-parse, a worktree add) gives git 120 s: a slow one that answers within them is read, one
    still going past them is stopped (TimeoutExpired), a second later is already too late."""
    _git_taking(seconds, monkeypatch)
    if answers:
        assert variants.git("rev-parse", "HEAD", cwd=tmp_path) == "answer"
    else:
        with pytest.raises(subprocess.TimeoutExpired):
            variants.git("rev-parse", "HEAD", cwd=tmp_path)


@pytest.mark.parametrize(("seconds", "answers"), [(119.9, True), (120.1, False)])
def test_removing_a_worktree_waits_for_git_two_minutes_and_no_longer(
    seconds: float, answers: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """remove_worktree gives `git worktree remove` the same 120 s: within them it returns quietly, past them
    the hung git is stopped (TimeoutExpired)."""
    (tmp_path / "wt").mkdir()
    asked = _git_taking(seconds, monkeypatch)
    if answers:
        assert variants.remove_worktree(tmp_path / "wt") is None
    else:
        with pytest.raises(subprocess.TimeoutExpired):
            variants.remove_worktree(tmp_path / "wt")
    assert len(asked) == 1


class _Server:
    """A variant's server process that ends by itself `after` seconds past the end of its requests, unless its
    session is killed first, on simulated time (Popen's wait, poll, pid and returncode)."""

    pid = 424242

    def __init__(self, after: float) -> None:
        self.after = after
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and timeout < self.after:
                raise subprocess.TimeoutExpired("distbench.gate.serve", timeout)
            self.returncode = 0
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


@pytest.mark.parametrize(("after", "returncode"), [(29.9, 0), (30.1, -signal.SIGKILL)])
def test_closing_gives_the_server_30_seconds_to_end_by_itself_then_kills_its_session(
    after: float, returncode: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() ends the requests and waits 30 s for the server to finish on its own (it exits 0, its own
    teardown done); one still there after them is killed with SIGKILL. Either way its session is then killed,
    for the ranks it leaves."""
    server = _Server(after)
    killed: list[tuple[int, int]] = []

    def killpg(pgid: int, sig: int) -> None:
        killed.append((pgid, sig))
        if server.returncode is None:
            server.returncode = -sig

    monkeypatch.setattr(os, "killpg", killpg)
    proc = VariantProcess(Variant("head"), tmp_path / "work", "cpu", tmp_path)
    proc._proc = server  # type: ignore[assignment]
    proc.close()
    assert server.returncode == returncode
    assert killed == [(424242, signal.SIGKILL)] and proc._proc is None


def test_a_twin_of_a_rev_variant_runs_its_first_servers_worktree_and_makes_none(
    monkeypatch, tmp_path
) -> None:
    """A rev= variant's twin: the worktree its first server made, once; the twin itself a tree= of it (it makes
    and removes no checkout), on the same device type and temporary directory."""
    made: list[str] = []
    monkeypatch.setattr(variants, "add_worktree", lambda rev, path: made.append(path))
    monkeypatch.setattr(variants, "remove_worktree", lambda path: made.append(f"removed {path}"))
    first = VariantProcess(Variant("base", rev="v1"), tmp_path, "cuda", tmp_path)
    twin = first.twin(1)
    twin.checkout()
    twin.remove_checkout()
    where = str(tmp_path / "worktree-base")
    assert made == [where] and (twin.tree, twin.variant.rev) == (where, None)
    assert (twin.workdir, twin.device_type) == (tmp_path, "cuda")
    first.remove_checkout()
    assert made == [where, f"removed {where}"]


def test_a_twin_serves_the_same_checkout_and_logs_apart(tmp_path) -> None:
    """A twin of a rev= variant runs the worktree its first server made (one checkout, removed once, by the
    first) and writes a log of its own."""
    first = VariantProcess(Variant("base", tree=str(tmp_path / "tree")), tmp_path, "cpu", tmp_path)
    twin = first.twin(2)
    assert (twin.tree, twin.variant.rev, twin.log.name) == (str(tmp_path / "tree"), None, "base-2.log")
    assert twin.src == first.src and twin.environment()["PYTHONPATH"] == first.environment()["PYTHONPATH"]
