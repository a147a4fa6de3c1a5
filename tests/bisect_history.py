"""Synthetic git histories for `distbench bisect`: a tiny user package whose step is a sleep, with commits that
make it slower, break its import, or break a test of it. Built with git in a temporary directory; commit i
is candidate i of the bisect.

The model sleeps PERIOD_S in its forward and runs on one thread: the rest of a distbench step is 1-2 ms, so
a step on 2 shared cores took 51-57 ms at a load of 3, and a 10% slowdown stands far above it. With torch's
two threads (a rank's default on 2 cores), every parallel op waited for the other thread whenever the
machine's other jobs held it, and 50 ms sleeps took 52 to 140 ms a step at a load of 5.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: Seconds a step sleeps at the good end.
PERIOD_S = 0.05

MODEL = '''"""A model whose step is a sleep: {note}."""

import time

import torch
from torch import nn

{broken}PERIOD_S = {period!r}


class Sleepy(nn.Module):
    vocab_size = 16
    seq_len = 8

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        time.sleep(PERIOD_S)
        return self.head(self.embed(input_ids))


def build() -> nn.Module:
    torch.set_num_threads(1)  # a second thread waits at every parallel op on a busy machine
    return Sleepy()
'''

TEST = """from sleepy.model import PERIOD_S


def test_the_step_is_short():
    assert PERIOD_S < {limit!r}
"""

GIT_ENV = {
    "GIT_AUTHOR_NAME": "bisect test",
    "GIT_AUTHOR_EMAIL": "bisect@example.invalid",
    "GIT_COMMITTER_NAME": "bisect test",
    "GIT_COMMITTER_EMAIL": "bisect@example.invalid",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def build_history(
    repo: Path,
    commits: int,
    *,
    slower: dict[int, float] | None = None,
    broken: set[int] = frozenset(),  # type: ignore[assignment]
    test_limit: float = 1.0,
) -> list[str]:
    """A repository at `repo` with commit 0 (the good end) and `commits` more, oldest first; returns their
    ids. `slower[i]`: from commit i on, the step's sleep is multiplied by that factor (factors compound);
    commits in `broken` do not import (the next commit repairs it). tests/test_sleepy.py fails once the
    sleep reaches `test_limit`."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "sleepy").mkdir()
    (repo / "sleepy" / "__init__.py").write_text("")
    (repo / "tests").mkdir()
    period, ids = PERIOD_S, []
    for i in range(commits + 1):
        period *= (slower or {}).get(i, 1.0)
        bad_import = "import sleepy_missing_module  # broken on purpose\n\n" if i in broken else ""
        note = f"revision {i}"
        (repo / "sleepy" / "model.py").write_text(
            MODEL.format(note=note, broken=bad_import, period=round(period, 6))
        )
        (repo / "tests" / "test_sleepy.py").write_text(TEST.format(limit=test_limit))
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", note)
        ids.append(git(repo, "rev-parse", "HEAD"))
    return ids
