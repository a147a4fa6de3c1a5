"""Persistent rank processes per world size, so a configuration costs its training steps, not a process start.

A RankPool starts `world_size` spawned processes that join one process group (NCCL with one GPU per rank,
or gloo on CPU) and then run jobs sent from the pytest process. A job that raises in any rank, hangs past
its timeout, or loses a rank fails with every rank's traceback or Python stack (faulthandler); the pool is
then rebuilt on next use, and the session goes on.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ResourceError
from .affinity import rank_cpus
from .worker import STACK_SIGNAL, worker_main

_EXIT_GRACE_S = 5.0


@dataclass
class RankOutcome:
    """What one rank did with a job."""

    rank: int
    status: str  # "ok", "error", "timeout" (no reply in time) or "crashed" (process died)
    exc_type: str | None = None
    text: str = ""  # traceback for "error", Python stack for "timeout", exit code for "crashed"


class JobError(RuntimeError):
    """A job failed in at least one rank. `outcomes` holds every rank's status and traceback or stack."""

    def __init__(self, target: str, world_size: int, outcomes: list[RankOutcome], why: str) -> None:
        self.target = target
        self.world_size = world_size
        self.outcomes = outcomes
        parts = [f"job {target} failed at world size {world_size}: {why}"]
        for o in outcomes:
            head = f"{o.status}" + (f" ({o.exc_type})" if o.exc_type else "")
            parts.append(f"===== rank {o.rank}: {head} =====")
            if o.text:
                parts.append(o.text.rstrip())
        super().__init__("\n".join(parts))

    @property
    def exc_types(self) -> set[str]:
        return {o.exc_type for o in self.outcomes if o.exc_type}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(device_type: str) -> dict[str, str]:
    """Environment every rank gets on top of the parent's."""
    env = {
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
        "DS_ACCELERATOR": "cuda" if device_type == "cuda" else "cpu",
    }
    if device_type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class RankPool:
    """`world_size` persistent rank processes sharing one process group."""

    def __init__(
        self,
        world_size: int,
        device_type: str = "cpu",
        *,
        start_timeout: float = 180.0,
        error_grace: float = 10.0,
    ) -> None:
        self.world_size = world_size
        self.device_type = device_type
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self._procs: list[mp.process.BaseProcess] = []
        self._task_qs: list[Any] = []
        self._result_q: Any = None
        self._job_ids = itertools.count()
        self._stack_dir: str | None = None
        self.jobs_run = 0
        self.starts = 0

    # --- lifecycle -----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        cpus = [rank_cpus(r, self.world_size) for r in range(self.world_size)]  # a bad setting raises here
        ctx = mp.get_context("spawn")
        self._stack_dir = tempfile.mkdtemp(prefix=f"distbench-ws{self.world_size}-")
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        env = rank_env(self.device_type)
        for r in range(self.world_size):
            p = ctx.Process(
                target=worker_main,
                args=(r, self.world_size, self.device_type, port, env, self._task_qs[r], self._result_q,
                      self._stack_file(r), cpus[r]),
                name=f"distbench-ws{self.world_size}-rank{r}",
                daemon=False,  # ranks may start their own subprocesses (compile workers)
            )
            p.start()
            self._procs.append(p)
        self.starts += 1
        outcomes = self._collect(-1, time.monotonic() + self.start_timeout)
        if any(o.status != "ok" for o in outcomes):
            self.close()
            raise JobError("<process group start>", self.world_size, outcomes,
                           "ranks could not join the process group")

    def close(self, grace: float = _EXIT_GRACE_S) -> None:
        """Stop every rank: politely within `grace` seconds, then by signal. Safe to call twice."""
        for q in self._task_qs:
            try:
                q.put_nowait(None)
            except Exception:
                pass
        deadline = time.monotonic() + grace
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=_EXIT_GRACE_S)
        for q in [*self._task_qs, self._result_q]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._task_qs, self._result_q = [], [], None

    # --- jobs ----------------------------------------------------------------------------------------
    def run(self, target: str, kwargs: dict[str, Any] | None = None, timeout: float = 600.0) -> list[Any]:
        """Run `target(ctx, **kwargs)` in every rank; return the per-rank results (index = rank)."""
        self.start()
        job_id = next(self._job_ids)
        for q in self._task_qs:
            q.put((job_id, target, kwargs or {}))
        outcomes = self._collect(job_id, time.monotonic() + timeout, target=target)
        self.jobs_run += 1
        if all(o.status == "ok" for o in outcomes):
            return [pickle.loads(o.payload) for o in outcomes]  # type: ignore[attr-defined]
        statuses = {o.status for o in outcomes}
        same_error = statuses == {"error"} and len({o.exc_type for o in outcomes}) == 1
        if not same_error:
            # Ranks disagree about where the job ended: some may be stuck in a collective and would never
            # read the polite stop, so the pool is killed at once and rebuilt on next use.
            self.close(grace=0.0)
        raise JobError(target, self.world_size, outcomes, _why(outcomes, timeout))

    def _collect(self, job_id: int, deadline: float, target: str = "") -> list[RankOutcome]:
        replies: dict[int, RankOutcome] = {}
        first_failure: float | None = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + self.error_grace)
            if now >= limit:
                break
            try:
                jid, rank, status, exc_type, payload = self._result_q.get(timeout=min(0.25, limit - now))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in replies and not p.is_alive():
                        replies[r] = RankOutcome(r, "crashed", None, f"process exited with code {p.exitcode}")
                        first_failure = first_failure or now
                continue
            if jid != job_id:
                continue  # a late reply to an abandoned job
            o = RankOutcome(rank, status, exc_type, payload if status == "error" else "")
            o.payload = payload  # type: ignore[attr-defined]
            replies[rank] = o
            if status != "ok":
                first_failure = first_failure or now
        missing = [r for r in range(self.world_size) if r not in replies]
        stacks = self._dump_stacks(missing) if missing else {}
        for r in missing:
            replies[r] = RankOutcome(r, "timeout", None, stacks.get(r, "(no stack captured)"))
        return [replies[r] for r in range(self.world_size)]

    def _stack_file(self, rank: int) -> str:
        assert self._stack_dir is not None
        return str(Path(self._stack_dir) / f"rank{rank}.stack")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask hung ranks for their Python stacks via faulthandler and read what they wrote."""
        offsets = {}
        for r in ranks:
            f = Path(self._stack_file(r))
            offsets[r] = f.stat().st_size if f.exists() else 0
            p = self._procs[r] if r < len(self._procs) else None
            if p is not None and p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, STACK_SIGNAL)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)
        out = {}
        for r in ranks:
            f = Path(self._stack_file(r))
            if f.exists():
                with f.open() as fh:
                    fh.seek(offsets[r])
                    out[r] = "Python stack at timeout:\n" + fh.read()
        return out


def _why(outcomes: list[RankOutcome], timeout: float) -> str:
    bad = [o for o in outcomes if o.status != "ok"]
    parts = []
    for status, label in (("error", "raised"), ("crashed", "crashed"), ("timeout", f"did not finish in {timeout:.0f}s")):
        ranks = [str(o.rank) for o in bad if o.status == status]
        if ranks:
            kinds = {o.exc_type for o in bad if o.status == status and o.exc_type}
            parts.append(f"rank {','.join(ranks)} {label}" + (f" {'/'.join(sorted(kinds))}" if kinds else ""))
    return "; ".join(parts)


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


class PoolManager:
    """One pool per world size, created on first use, reused across jobs and tests, closed at exit."""

    def __init__(self, device_type: str | None = None, max_alive: int = 3) -> None:
        if device_type is None:
            device_type = "cuda" if cuda_device_count() > 0 else "cpu"
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be cpu or cuda, not {device_type!r}")
        self.device_type = device_type
        self.max_alive = max_alive
        self._pools: dict[int, RankPool] = {}
        atexit.register(self.close_all)

    def check_world_size(self, world_size: int) -> None:
        if self.device_type == "cuda":
            n = cuda_device_count()
            if world_size > n:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                extra = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
                raise ResourceError(
                    f"world size {world_size} needs {world_size} CUDA devices, this machine has {n}{extra}; "
                    f"use --world-size {n} or fewer"
                )

    def get(self, world_size: int) -> RankPool:
        self.check_world_size(world_size)
        pool = self._pools.pop(world_size, None) or RankPool(world_size, self.device_type)
        self._pools[world_size] = pool  # most recently used last
        while len([p for p in self._pools.values() if p.alive]) > self.max_alive:
            oldest = next(ws for ws, p in self._pools.items() if p.alive)
            self._pools.pop(oldest).close()
        return pool

    def run(self, world_size: int, target: str, kwargs: dict[str, Any] | None = None,
            timeout: float = 600.0) -> list[Any]:
        return self.get(world_size).run(target, kwargs, timeout)

    def close_all(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()

