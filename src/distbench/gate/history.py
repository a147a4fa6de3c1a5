"""What a bisect walks (gate/bisect.py): its ordered candidates, and how each one is made runnable.

* Revisions of a git repository (`--repo`, default the one around the working directory): GOOD, then
  `git rev-list --first-parent --reverse GOOD..BAD`. A merge is one step, as a pull request that landed
  on main is; to look inside one, bisect again between its parents. A probed revision is checked out once,
  into a detached worktree of its own under the bisect's output directory, removed at the end. The worktree
  is locked with its owner's process id (OWNER), so that those of a bisect that was killed are told from a
  running one's and removed by the next (remove_abandoned).
  - distbench's own history (the bad revision holds src/distbench): each revision is a `tree=` variant, so
    the revision's distbench runs the benchmark, as `distbench ab --base rev=...` runs it.
  - any other repository: this distbench runs, with the revision's worktree (and its src/, if it has one)
    on PYTHONPATH and as the working directory (a `path=` variant), so that a model factory
    `-m package.module:function` builds the model from that revision's code.
  `--build CMD` runs in a revision's worktree before its first probe; a build that fails skips it.
* Variants (`--variants FILE`): one `distbench ab` variant per line, in order, the first line the good end
  and the last the bad one (blank lines and `#` comments are skipped); a `rev=` line is checked out once.

A pytest node runs at a candidate in a process group of its own (killed whole at the timeout), from the
candidate's checkout, with the candidate's interpreter and environment.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ConfigError
from .bisect import Candidate, Outcome
from .variants import Variant, VariantStartError, add_worktree, git, parse_variant, remove_worktree

#: The lock reason of a bisect's worktrees (the process that checked them out, and its host), and how it
#: reads back.
OWNER = "distbench bisect: pid {pid} on {host}"
OWNED = re.compile(r"distbench bisect: pid (\d+) on (.+)")


@dataclass(frozen=True)
class History:
    candidates: list[Candidate]
    source: str  # what the candidates are, in words
    kind: Literal["distbench", "user", "variants"]
    repo: Path | None = None


def from_git(repo: str | os.PathLike[str], good: str, bad: str) -> History:
    """GOOD and the first-parent revisions of GOOD..BAD, oldest first; ConfigError for a repository, a
    revision or a range that cannot be bisected."""
    if not Path(repo).is_dir():
        raise ConfigError(f"--repo {repo} is not a directory")
    try:
        top = Path(git("rev-parse", "--show-toplevel", cwd=repo))
    except ConfigError:
        raise ConfigError(f"--repo {repo} is not in a git repository") from None
    shas = {}
    for flag, rev in (("--good", good), ("--bad", bad)):
        try:
            shas[flag] = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=top)
        except ConfigError:
            raise ConfigError(f"{flag} {rev} is not a commit of {top}") from None
    g, b = shas["--good"], shas["--bad"]
    if subprocess.run(["git", "merge-base", "--is-ancestor", g, b], cwd=top, capture_output=True).returncode:
        raise ConfigError(f"--good {good} is not an ancestor of --bad {bad}: give an older --good")
    lines = git("log", "--first-parent", "--reverse", "--format=%H %s", f"{g}..{b}", cwd=top).splitlines()
    if not lines:
        raise ConfigError(f"{good}..{bad} holds no revision: --good and --bad are the same commit")
    subject = git("log", "-1", "--format=%s", g, cwd=top)
    revs = [(g, subject)] + [tuple(line.split(" ", 1)) if " " in line else (line, "") for line in lines]
    candidates = [Candidate(spec=sha, label=f"{sha[:10]} {text}".strip()) for sha, text in revs]
    own = subprocess.run(
        ["git", "cat-file", "-e", f"{b}:src/distbench/__init__.py"], cwd=top, capture_output=True
    )
    if own.returncode == 0:
        return History(candidates, "revisions of distbench (each revision's own src/ runs)", "distbench", top)
    return History(candidates, f"revisions of {top.name} (on PYTHONPATH of this distbench)", "user", top)


def from_file(path: str | os.PathLike[str]) -> History:
    """The variants of a file, one per line; ConfigError naming the line of one that does not parse."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read --variants {path}: {e}") from None
    candidates = []
    for number, line in enumerate(text.splitlines(), 1):
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue
        try:
            parse_variant(f"line {number}", spec)
        except ConfigError as e:
            raise ConfigError(f"--variants {path}:{number}: {e}") from None
        candidates.append(Candidate(spec=spec, label=spec))
    if len(candidates) < 2:
        raise ConfigError(f"--variants {path} needs at least two variants (good first, bad last)")
    return History(candidates, f"variants of {Path(path).name}", "variants")


@dataclass
class Checkouts:
    """Each candidate made runnable once: a worktree (built, if asked) per revision, a variant per line."""

    history: History
    workdir: Path
    log_dir: Path
    build: list[str] = field(default_factory=list)  # argv run in a revision's worktree before its probes
    timeout: float = 1800.0
    _trees: dict[int, Path] = field(default_factory=dict)
    _broken: dict[int, str] = field(default_factory=dict)  # index -> why its build failed

    def __post_init__(self) -> None:
        if self.history.repo is not None:
            git("worktree", "prune", cwd=self.history.repo)

    def variant(self, index: int, label: str) -> Variant:
        """Candidate `index` as a variant labelled `label`; VariantStartError when it does not build."""
        c = self.history.candidates[index]
        if self.history.kind == "variants":
            v = parse_variant(label, c.spec)
            if v.rev:
                v = dataclasses.replace(v, rev=None, tree=str(self._tree(index, v.rev, None)))
            return v
        tree = self._tree(index, c.spec, self.history.repo)
        if index in self._broken:
            raise VariantStartError(label, f"{label} {c.label} does not build: {self._broken[index]}")
        if self.history.kind == "distbench":
            return Variant(label, tree=str(tree))
        return Variant(label, path=tuple(str(p) for p in (tree, tree / "src") if p.is_dir()))

    def _tree(self, index: int, rev: str, repo: Path | None) -> Path:
        if index not in self._trees:
            path = self.workdir / f"candidate-{index}"
            add_worktree(rev, path, repo, lock=OWNER.format(pid=os.getpid(), host=socket.gethostname()))
            self._trees[index] = path
            if self.build:
                rc, tail = run_logged(
                    self.build, path, dict(os.environ), self.timeout, self.log_dir / f"build-{index}.log"
                )
                if rc != 0:
                    self._broken[index] = f"`{shlex.join(self.build)}` {_ended(rc, self.timeout)}: {tail}"
        return self._trees[index]

    def close(self) -> None:
        for path in self._trees.values():
            remove_worktree(path)
        self._trees.clear()


def remove_abandoned(repo: Path) -> list[str]:
    """Remove the worktrees in `repo` of bisects that are no longer running (killed, so never closed): those
    locked by a bisect of this host whose process is gone. Their paths."""
    removed = []
    for entry in git("worktree", "list", "--porcelain", cwd=repo).split("\n\n"):
        fields = {key: value for key, _, value in (line.partition(" ") for line in entry.splitlines())}
        owner = OWNED.fullmatch(fields.get("locked", ""))
        if owner and owner[2] == socket.gethostname() and not _running(int(owner[1])):
            git("worktree", "remove", "--force", "--force", fields["worktree"], cwd=repo)
            removed.append(fields["worktree"])
    return removed


def _running(pid: int) -> bool:
    """Whether process `pid` of this host is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: running
        pass
    return True


def _ended(rc: int | None, timeout: float) -> str:
    return f"timed out after {timeout:.0f} s" if rc is None else f"exited {rc}"


def run_logged(
    argv: list[str], cwd: Path | str | None, env: dict[str, str], timeout: float, log: Path
) -> tuple[int | None, str]:
    """Run `argv` in a process group of its own, output to `log`; (exit status, or None when it ran past
    `timeout` and the group was killed; the output's last line)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running, at the timeout or not
            except ProcessLookupError:
                pass
            proc.wait()
    lines = log.read_text(errors="replace").strip().splitlines()
    return rc, (lines[-1] if lines else "(no output)")


def run_test(variant: Variant, nodeid: str, timeout: float, log: Path) -> tuple[Outcome, str]:
    """The pytest node at one candidate, judged by node_outcome; a skip says why. Marker filters of the
    candidate's configuration are lifted (`-m ""`): the node was named."""
    env = {**os.environ, **variant.env}
    code = [str(Path(variant.tree) / "src")] if variant.tree else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*code, *variant.path, env.get("PYTHONPATH")]))
    cwd = variant.tree or next(iter(variant.path), None)
    argv = [variant.python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "", nodeid]
    rc, _ = run_logged(argv, cwd, env, timeout, log)
    outcome, said = node_outcome(rc, log.read_text(errors="replace"))
    if outcome != "skip":
        return outcome, said
    why = "nothing ran (skipped, deselected or xfailed)" if rc == 0 else _ended(rc, timeout)
    return "skip", f"{nodeid}: {why}: {said} (log: {log.name})"


def node_outcome(rc: int | None, output: str) -> tuple[Outcome, str]:
    """What one pytest run of a node says of its candidate, from its exit status (None: killed at the
    timeout) and output: "good" only when the node ran and passed (exit 0, a count passed, none failed or
    errored), "bad" only when it ran and failed (exit 1, a count failed). Anything else is a "skip": a node
    that did not run (skipped, deselected, xfailed, not collected, an error in collection or in a fixture,
    no pytest at that candidate, a timeout) is neither a pass nor a failure. With pytest's summary line and
    the first error it printed (its first `E` line), in one line."""
    lines = output.strip().splitlines()
    last = lines[-1] if lines else "(no output)"
    counts = {word.rstrip("s"): int(k) for k, word in re.findall(r"\b(\d+) (passed|failed|errors?)\b", last)}
    raised = next((m[1] for line in lines if (m := re.match(r"E {3}\s*(\S.*)", line))), None)
    said = f"{last}: {raised}" if raised else last
    if rc == 0 and counts.get("passed") and not counts.get("failed") and not counts.get("error"):
        return "good", said
    if rc == 1 and counts.get("failed"):
        return "bad", said
    return "skip", said
