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
import select
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError, ResourceError
from .affinity import rank_cpus
from .channel import MessageReader, widen_pipe, write_message
from .worker import STACK_SIGNAL, job_name, worker_main

_EXIT_GRACE_S = 5.0
#: How long hung ranks get to write their stacks after the stack-dump signal.
STACK_WAIT_S = 1.0


@dataclass
class RankOutcome:
    """What one rank did with a job."""

    rank: int
    status: str  # "ok", "error", "timeout" (no reply in time) or "crashed" (process died)
    exc_type: str | None = None
    text: str = ""  # traceback for "error", Python stack for "timeout", exit code for "crashed"
    payload: Any = None  # the job's return value, for "ok"
    held_bytes: int = 0  # device memory the rank's tensors held after the job, its garbage collected


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
    """`world_size` persistent rank processes sharing one process group.

    Every wait is bounded: starting by min(start_timeout, the job's timeout), a job by its timeout (and by
    `error_grace` once a rank failed), reading the ranks' stacks by STACK_WAIT_S, closing by its grace
    plus _EXIT_GRACE_S. Ranks rendezvous through a TCP store this process hosts on a port the kernel picked
    (no free port to race for), and talk to it over one pipe each way (see channel.py).
    """

    def __init__(
        self,
        world_size: int,
        device_type: str = "cpu",
        *,
        start_timeout: float = 180.0,
        error_grace: float = 10.0,
        gpus: Sequence[int] | None = None,
        cpus: Collection[int] | None = None,
    ) -> None:
        """`gpus`: the GPUs (indices among this process's) its ranks run on, rank r on the r-th; default the
        first world_size. `cpus`: the CPUs its ranks' binding slices (affinity.rank_cpus) are cut from; default
        this process's."""
        if gpus is not None and len(gpus) != world_size:
            raise ValueError(f"a pool of {world_size} rank(s) needs as many GPUs, got {list(gpus)}")
        if start_timeout <= 0 or error_grace < 0:
            raise ValueError(
                f"start_timeout must be > 0 and error_grace >= 0, not {start_timeout}, {error_grace}"
            )
        self.world_size = world_size
        self.device_type = device_type
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self.gpus = tuple(gpus) if gpus is not None else None
        self.cpus = cpus
        self.last_start_s = 0.0  # seconds the last run() spent starting the ranks (0 when they were up)
        #: device bytes the fullest rank held after the last job: what earlier jobs left (0 on CPU)
        self.held_bytes = 0
        self._joining = False  # spawned, their join not yet awaited
        self._procs: list[mp.process.BaseProcess] = []
        self._tasks: list[Connection] = []  # this process's write end of each rank's task pipe
        self._replies: list[MessageReader] = []
        self._stacks: list[MessageReader] = []
        self._store: Any = None
        self._job_ids = itertools.count()

    # --- lifecycle -----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self, timeout: float | None = None) -> None:
        """Start the ranks unless they run; they must join the group within min(start_timeout, timeout)."""
        if self._procs and not self._joining:
            if self.alive:
                return
            self._fail_dead_idle_ranks()
        self.spawn()
        self._joining = False
        limit = min(self.start_timeout, timeout if timeout is not None else self.start_timeout)
        outcomes = self._collect_or_kill(-1, time.monotonic() + limit)
        if any(o.status != "ok" for o in outcomes):
            self.close(grace=0.0)
            raise JobError(
                "<process group start>",
                self.world_size,
                outcomes,
                "ranks could not join the process group: " + failure_summary(outcomes, limit),
            )

    def spawn(self) -> None:
        """Start the rank processes and return at once; the next start() (or run()) waits for them to join.
        A rank dies with the thread that spawned it (PR_SET_PDEATHSIG follows the parent thread): spawn
        in a thread that outlives the pool, and wait for the join in any."""
        if self._procs:
            return
        # a bad setting raises here
        cpus = [rank_cpus(r, self.world_size, self.cpus) for r in range(self.world_size)]
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = rank_env(self.device_type)
        if self.gpus is not None and self.device_type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(self.gpus)
        for r in range(self.world_size):
            task_r, task_w = ctx.Pipe(duplex=False)
            reply_r, reply_w = ctx.Pipe(duplex=False)
            stack_r, stack_w = ctx.Pipe(duplex=False)
            widen_pipe(reply_r.fileno())  # results may be a model's parameters and gradients
            p = ctx.Process(
                target=worker_main,
                args=(
                    r,
                    self.world_size,
                    self.device_type,
                    os.getpid(),
                    self._store.port,
                    env,
                    task_r,
                    reply_w,
                    stack_w,
                    cpus[r],
                ),
                name=f"distbench-ws{self.world_size}-rank{r}",
                daemon=False,  # ranks may start their own subprocesses (compile workers)
            )
            p.start()
            for end in (task_r, reply_w, stack_w):  # the rank holds these now: its death closes them
                end.close()
            self._procs.append(p)
            os.set_blocking(task_w.fileno(), False)
            self._tasks.append(task_w)
            self._replies.append(MessageReader(reply_r))
            self._stacks.append(MessageReader(stack_r))
        self._joining = True

    def _fail_dead_idle_ranks(self) -> None:
        """A rank that died between jobs (OOM killer, a signal) fails the job that finds it, so the death is
        reported rather than papered over by a silent restart; the next job starts a new pool."""
        outcomes = [
            RankOutcome(r, "ok", None, "alive, idle")
            if p.is_alive()
            else RankOutcome(
                r, "crashed", None, f"process exited with code {p.exitcode} while idle between jobs"
            )
            for r, p in enumerate(self._procs)
        ]
        self.close(grace=0.0)
        raise JobError("<idle pool>", self.world_size, outcomes, "a rank died between jobs")

    def close(self, grace: float = _EXIT_GRACE_S) -> None:
        """Stop every rank: politely within `grace` seconds (closing a task pipe tells its rank to leave),
        then by SIGKILL, waiting at most _EXIT_GRACE_S for the kills. Safe to call twice."""
        for conn in self._tasks:
            conn.close()
        deadline = time.monotonic() + grace
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + _EXIT_GRACE_S
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for reader in (*self._replies, *self._stacks):
            reader.conn.close()
        self._procs, self._tasks, self._replies, self._stacks, self._store = [], [], [], [], None
        self.held_bytes, self._joining = 0, False

    # --- jobs ----------------------------------------------------------------------------------------
    def run(
        self, job: Callable[..., Any], kwargs: dict[str, Any] | None = None, timeout: float = 600.0
    ) -> list[Any]:
        """Run `job(ctx, **kwargs)` in every rank; return the per-rank results (index = rank)."""
        target = job_name(job)
        check_configs(kwargs, self.world_size)
        t0, was_alive = time.perf_counter(), self.alive
        self.start(timeout)
        self.last_start_s = 0.0 if was_alive else time.perf_counter() - t0
        job_id = next(self._job_ids)
        deadline = time.monotonic() + timeout
        for conn in self._tasks:
            write_message(conn.fileno(), (job_id, target, kwargs or {}), deadline)  # missed: it times out
        outcomes = self._collect_or_kill(job_id, deadline)
        self.held_bytes = max(o.held_bytes for o in outcomes)
        if all(o.status == "ok" for o in outcomes):
            return [o.payload for o in outcomes]
        statuses = {o.status for o in outcomes}
        same_error = statuses == {"error"} and len({o.exc_type for o in outcomes}) == 1
        if not same_error:
            # Ranks disagree about where the job ended: some may be stuck in a collective and would never
            # read the polite stop, so the pool is killed at once and rebuilt on next use.
            self.close(grace=0.0)
        raise JobError(target, self.world_size, outcomes, failure_summary(outcomes, timeout))

    def _collect_or_kill(self, job_id: int, deadline: float) -> list[RankOutcome]:
        try:
            return self._collect(job_id, deadline)
        except BaseException:  # Ctrl-C: ranks would finish the abandoned job before reading a polite stop
            self.close(grace=0.0)
            raise

    def _collect(self, job_id: int, deadline: float) -> list[RankOutcome]:
        replies: dict[int, RankOutcome] = {}
        first_failure: float | None = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + self.error_grace)
            if now >= limit:
                break
            waiting = [r for r in range(self.world_size) if r not in replies]
            select.select([self._replies[r].fd for r in waiting], [], [], min(0.25, limit - now))
            for r in waiting:
                for jid, rank, status, exc_type, payload, held in self._replies[r].pump():
                    if jid != job_id:
                        continue  # a late reply to an abandoned job
                    ok = status == "ok"
                    replies[rank] = RankOutcome(
                        rank, status, exc_type, "" if ok else payload, payload if ok else None, held
                    )
                    if status != "ok":
                        first_failure = first_failure or now
                p = self._procs[r]
                # End of file: the rank died (its own children may hold the pipe, hence is_alive too).
                if r not in replies and (self._replies[r].eof or not p.is_alive()):
                    p.join(timeout=1.0)  # its exit code
                    replies[r] = RankOutcome(r, "crashed", None, f"process exited with code {p.exitcode}")
                    first_failure = first_failure or now
        missing = [r for r in range(self.world_size) if r not in replies]
        stacks = self._dump_stacks(missing) if missing else {}
        for r in missing:
            replies[r] = RankOutcome(r, "timeout", None, stacks[r])
        return [replies[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask hung ranks for their Python stacks (faulthandler, into their stack pipes) and read until each
        answering rank went quiet; say why where a rank gave none."""
        states = {r: _proc_state(self._procs[r].pid) for r in ranks}
        for r in ranks:
            self._stacks[r].read_text()  # drop anything from an earlier signal
            pid = self._procs[r].pid
            if states[r] not in _STOPPED and pid is not None:
                try:
                    os.kill(pid, STACK_SIGNAL)
                except ProcessLookupError:
                    pass
        text = {r: "" for r in ranks}
        last: dict[int, float] = {}
        end = time.monotonic() + STACK_WAIT_S
        while (now := time.monotonic()) < end:
            waiting = [r for r in ranks if states[r] not in _STOPPED and now - last.get(r, now) < _QUIET_S]
            if not waiting:
                break
            select.select([self._stacks[r].fd for r in waiting], [], [], min(_QUIET_S, end - now))
            for r in waiting:
                if got := self._stacks[r].read_text():
                    text[r] += got
                    last[r] = time.monotonic()
        return {
            r: "Python stack at timeout:\n" + text[r] if text[r].strip() else _no_stack_reason(r, states[r])
            for r in ranks
        }


_STOPPED = ("T", "t")
_QUIET_S = 0.2  # a stack dump is one burst of writes: this long without more means it is complete


def _proc_state(pid: int | None) -> str:
    """The one-letter state /proc gives for `pid` (R, S, D, T, t, Z), or "?" when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _no_stack_reason(rank: int, state: str) -> str:
    """Why rank `rank` wrote no stack, from its /proc state."""
    if state in _STOPPED:
        return (
            f"(rank {rank} is stopped (state {state}: SIGSTOP or a debugger), so it could not answer the "
            "stack-dump signal)"
        )
    return (
        f"(rank {rank} did not answer the stack-dump signal {STACK_SIGNAL.name} in {STACK_WAIT_S:.0f}s: "
        "its handler for it was replaced, or the signal is blocked, or it is blocked in native code "
        "with a Python handler)"
    )


def check_configs(kwargs: dict[str, Any] | None, world_size: int) -> None:
    """Refuse a RunConfig sent to ranks of another world size: a configuration for 4 ranks run by a pool of 2
    would train on half of each global batch and report it as the whole."""
    for cfg in (kwargs or {}).values():
        if isinstance(cfg, RunConfig) and cfg.world_size != world_size:
            raise ConfigError(
                f"a configuration for world size {cfg.world_size} was sent to a pool of "
                f"{world_size} rank(s); run it in the pool of its own world size"
            )


def failure_summary(outcomes: list[RankOutcome], timeout: float) -> str:
    bad = [o for o in outcomes if o.status != "ok"]
    parts = []
    for status, label in (
        ("error", "raised"),
        ("crashed", "crashed"),
        ("timeout", f"did not finish in {timeout:.0f}s"),
    ):
        ranks = [str(o.rank) for o in bad if o.status == status]
        if ranks:
            kinds = {o.exc_type for o in bad if o.status == status and o.exc_type}
            parts.append(f"rank {','.join(ranks)} {label}" + (f" {'/'.join(sorted(kinds))}" if kinds else ""))
    return "; ".join(parts)


def visible_devices(gpus: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for ranks on `gpus`, indices among this process's own visible devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(max(gpus) + 1)]
    return ",".join(ids[g] for g in gpus)


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _gpus_of(key: tuple[int, tuple[int, ...] | None]) -> Sequence[int]:
    """The GPUs of a PoolManager key: its own, or the first world-size ones."""
    return key[1] if key[1] is not None else range(key[0])


class PoolManager:
    """One pool per world size, created on first use, reused across jobs and tests, closed at exit."""

    def __init__(self, device_type: str | None = None, max_alive: int = 3, **pool_options: float) -> None:
        """`pool_options` (start_timeout, error_grace) go to every RankPool."""
        if device_type is None:
            device_type = "cuda" if cuda_device_count() > 0 else "cpu"
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be cpu or cuda, not {device_type!r}")
        self.device_type = device_type
        self.max_alive = max_alive
        self.pool_options = pool_options
        self._pools: dict[tuple[int, tuple[int, ...] | None], RankPool] = {}
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

    def pool_for(self, world_size: int) -> RankPool:
        self.check_world_size(world_size)
        pool = self._take(world_size, None)
        while len([p for p in self._pools.values() if p.alive]) > self.max_alive:
            oldest = next(k for k, p in self._pools.items() if p.alive)
            self._pools.pop(oldest).close()
        return pool

    def pool_on(self, gpus: Sequence[int], cpus: Collection[int] | None = None) -> RankPool:
        """A pool with one rank on each of `gpus`, bound within `cpus` (see RankPool), for configurations that
        run side by side on disjoint GPUs (matrix.py). The caller places them, from one thread: pools that
        hold any of these GPUs otherwise are idle then, and are closed, so that no two pools share a GPU."""
        self.check_world_size(max(gpus) + 1)
        key = (len(gpus), tuple(gpus))
        for k in [k for k in self._pools if k != key and set(_gpus_of(k)) & set(gpus)]:
            self._pools.pop(k).close()
        return self._take(*key, cpus)

    def _take(
        self, world_size: int, gpus: tuple[int, ...] | None, cpus: Collection[int] | None = None
    ) -> RankPool:
        """The pool of this key, started on first use, moved to the most recently used end."""
        key = (world_size, gpus)
        pool = self._pools.pop(key, None) or RankPool(
            world_size, self.device_type, gpus=gpus, cpus=cpus, **self.pool_options
        )
        self._pools[key] = pool
        return pool

    def held_bytes(self) -> int:
        """Device bytes the pools' fullest ranks hold after their last jobs, summed over the pools."""
        return sum(p.held_bytes for p in self._pools.values())

    def close_all(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
