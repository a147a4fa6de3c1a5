"""What an A/B comparison compares: variants of the code under test, each served by its own process.

A variant is written as comma-separated items (an empty spec is this checkout as it is):

    rev=REV          a git revision of this repository, checked out into a temporary worktree
    tree=DIR         another checkout of distbench (its src/ is imported)
    path=DIR         a directory put on the variant's PYTHONPATH, and its working directory (a user's
                     model code at another revision, for a factory `-m package.module:function`);
                     repeat it for more directories
    python=EXE       another interpreter or virtualenv (e.g. a torch or DeepSpeed upgrade)
    env.NAME=VALUE   an environment variable for the variant's ranks (e.g. env.NCCL_ALGO=Ring)

Each variant runs `python -m distbench.gate.serve` in its own process session with its own rank pools, so
both stay warm while the runner alternates between them, and a variant that hangs or dies is killed with
its ranks without touching the other one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from ..errors import ConfigError
from .serve import FDS_ENV

#: Seconds a variant may take to start (interpreter, imports) before it counts as broken.
START_TIMEOUT_S = 120.0
#: Beyond a request's own timeout, the time its reply may take (pool start, build, teardown).
REPLY_MARGIN_S = 300.0


@dataclass(frozen=True)
class Variant:
    label: str
    python: str = sys.executable
    tree: str | None = None
    rev: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    path: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [f"rev={self.rev}"] if self.rev else [f"tree={self.tree}"] if self.tree else ["this checkout"]
        parts += [f"path={p}" for p in self.path]
        if self.python != sys.executable:
            parts.append(f"python={self.python}")
        parts += [f"env.{k}={v}" for k, v in sorted(self.env.items())]
        return ", ".join(parts)


def parse_variant(label: str, spec: str) -> Variant:
    """A Variant from its written form (module doc); ConfigError naming the bad item."""
    python, tree, rev, env, path = sys.executable, None, None, {}, []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"variant {label}: {item!r} is not KEY=VALUE (rev=, tree=, python=, env.NAME=)")
        if key == "rev":
            rev = value
        elif key == "tree":
            if not (Path(value) / "src" / "distbench").is_dir():
                raise ConfigError(
                    f"variant {label}: tree={value} holds no src/distbench; give a distbench checkout"
                )
            tree = str(Path(value).resolve())
        elif key == "path":
            if not Path(value).is_dir():
                raise ConfigError(f"variant {label}: path={value} is not a directory")
            path.append(str(Path(value).resolve()))
        elif key == "python":
            if not os.access(value, os.X_OK):
                raise ConfigError(f"variant {label}: python={value} is not an executable interpreter")
            python = value
        elif key.startswith("env.") and len(key) > 4:
            env[key[4:]] = value
        else:
            raise ConfigError(
                f"variant {label}: unknown item {key!r}; use rev=, tree=, path=, python= or env.NAME="
            )
    if rev and tree:
        raise ConfigError(f"variant {label}: give rev= or tree=, not both")
    return Variant(label, python, tree, rev, env, tuple(path))


class VariantStartError(ConfigError):
    """A variant whose server did not start (its code does not import, its interpreter is broken)."""

    def __init__(self, label: str, message: str) -> None:
        super().__init__(message)
        self.label = label


def git(*args: str, cwd: str | os.PathLike[str] | None = None) -> str:
    """git's output; ConfigError with its last line of errors when it fails."""
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise ConfigError(f"git {' '.join(args)} failed: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip()


def add_worktree(
    rev: str,
    path: str | os.PathLike[str],
    repo: str | os.PathLike[str] | None = None,
    lock: str | None = None,
) -> None:
    """Check `rev` of the repository at `repo` (default: the one around the working directory) out into a
    detached worktree at `path`; with `lock`, locked with that reason (who owns it: `git worktree prune`
    leaves it, and its owner's successor can tell it from others)."""
    top = git("rev-parse", "--show-toplevel", cwd=repo)
    locked = ["--lock", "--reason", lock] if lock else []
    git("worktree", "add", "--detach", "--force", *locked, str(path), rev, cwd=top)


def remove_worktree(path: str | os.PathLike[str]) -> None:
    """Remove a worktree add_worktree made, locked or not, and its entry in its repository (quietly: one
    already deleted leaves an entry that `git worktree prune` drops, if it was not locked)."""
    if Path(path).is_dir():
        subprocess.run(
            ["git", "worktree", "remove", "--force", "--force", str(path)],
            cwd=path,
            capture_output=True,
            timeout=120,
        )


class VariantProcess:
    """One variant's server: started on demand, restarted after a failure, stopped with its ranks."""

    def __init__(self, variant: Variant, workdir: Path, device_type: str, log_dir: Path) -> None:
        self.variant = variant
        self.workdir = workdir
        self.device_type = device_type
        self.tree = variant.tree
        self._worktree: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._requests: IO[str] | None = None
        self._reply_fd: int | None = None
        self._buffer = b""
        self.log = log_dir / f"{variant.label}.log"
        self.info: dict[str, Any] = {}

    def twin(self, n: int) -> VariantProcess:
        """Another server of this variant, on the same checkout (made now if it is a rev=; this process keeps
        and removes it), logging to <label>-<n>.log: a second process to run the variant's requests beside
        this one's (the numerics' runs of one side at once)."""
        self.checkout()
        twin = VariantProcess(
            replace(self.variant, rev=None, tree=self.tree), self.workdir, self.device_type, self.log.parent
        )
        twin.log = self.log.with_name(f"{self.variant.label}-{n}.log")
        return twin

    def checkout(self) -> None:
        """A rev= variant's temporary worktree, made once (remove_checkout takes it away)."""
        if self.variant.rev and self._worktree is None:
            path = str(self.workdir / f"worktree-{self.variant.label}")
            add_worktree(self.variant.rev, path)
            self._worktree, self.tree = path, path

    @property
    def src(self) -> Path:
        """Where the variant's distbench package is imported from: its checkout's src/ (rev=, tree=), or the
        directory this runner's distbench is in."""
        return Path(self.tree) / "src" if self.tree else Path(__file__).resolve().parents[2]

    def environment(self) -> dict[str, str]:
        """The variant's process environment: its env. items, its code first on PYTHONPATH, its path= after.
        The variant's own code first: its checkout, or else the distbench this runner is (for python=); then
        its path= directories (a user's code), also its working directory, which `python -m` puts first."""
        env = {
            **os.environ,
            **self.variant.env,
            "DISTBENCH_AB_DEVICE": self.device_type,
            "PYTHONUNBUFFERED": "1",
        }
        src = str(self.src)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, *self.variant.path, env.get("PYTHONPATH")]))
        return env

    def start(self) -> None:
        self.checkout()
        to_server, from_parent = os.pipe()
        from_server, to_parent = os.pipe()
        env = {**self.environment(), FDS_ENV: f"{to_server},{to_parent}"}
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                [self.variant.python, "-m", "distbench.gate.serve"],
                cwd=self.tree or next(iter(self.variant.path), None),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(to_server, to_parent),
                start_new_session=True,
            )
        os.close(to_server)
        os.close(to_parent)
        self._requests = os.fdopen(from_parent, "w")
        self._reply_fd, self._buffer = from_server, b""
        hello = self._reply(START_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            self.close()
            raise VariantStartError(
                self.variant.label,
                f"variant {self.variant.label} ({self.variant.describe()}) did not start: "
                f"{self._log_tail()} (full log: {self.log})",
            )
        self.info = hello

    @property
    def protocol(self) -> int:
        """What the server can do (gate/serve.py): 2 runs in pieces, 1 (older distbench) whole runs only."""
        return int(self.info.get("protocol", 1))

    def send(self, request: dict[str, Any]) -> bool:
        """Post one request (serve.py's forms); False when the server is gone (it is closed, and restarted by
        the next send)."""
        if self._proc is None or self._proc.poll() is not None:
            self.start()
        assert self._requests is not None
        try:
            self._requests.write(json.dumps(request) + "\n")
            self._requests.flush()
        except BrokenPipeError:
            self.close()
            return False
        return True

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The reply to the request sent last, or None when the server died or did not answer within
        `timeout` plus the reply margin (it is then killed with its ranks)."""
        reply = self._reply(timeout + REPLY_MARGIN_S) if self._reply_fd is not None else None
        if reply is None:
            self.close()
        return reply

    def request(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        return self.receive(timeout) if self.send({**request, "timeout": timeout}) else None

    def run(self, cfg: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The result of one benchmark run of `cfg`, or None when the server died or did not answer in time
        (it is then killed with its ranks and restarted on the next call)."""
        return self.request({"cfg": cfg}, timeout)

    def recycle(self) -> None:
        """Fresh rank processes for the next run (see serve.py); a server that does not answer is restarted."""
        if self._proc is None or self._requests is None:
            return
        try:
            self._requests.write(json.dumps({"recycle": True}) + "\n")
            self._requests.flush()
        except BrokenPipeError:
            self.close()
            return
        if self._reply(REPLY_MARGIN_S) is None:
            self.close()

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON line from the server within `timeout` seconds, or None (timeout or server gone)."""
        assert self._reply_fd is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._reply_fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._reply_fd, 1 << 20)
                if not chunk:
                    return None
                self._buffer += chunk
            elif self._proc is not None and self._proc.poll() is not None:
                return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the server and its ranks: politely (end of requests), then the whole process session."""
        if self._requests is not None:
            try:
                self._requests.close()
            except OSError:
                pass
            self._requests = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None
        if self._reply_fd is not None:
            os.close(self._reply_fd)
            self._reply_fd = None

    def remove_checkout(self) -> None:
        if self._worktree:
            remove_worktree(self._worktree)
            self._worktree = None
