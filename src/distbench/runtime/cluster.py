"""Multi-node runs under torchrun: every launched process runs `distbench launch`; rank 0 decides.

torchrun (under Slurm: srun around it) starts the processes and their c10d rendezvous; distbench adds no
launcher. Rank 0 is the controller: it runs the matrix exactly as `distbench run` does, through a
pool-like `Cluster` whose jobs reach the other ranks through torchrun's key-value store. A job at world
size n runs on the first n launched ranks (torchrun numbers ranks node by node, so n up to the GPUs of one
node stays on one node) in a process group formed for that job alone, as the default group, so every job
function runs unchanged; the other ranks wait for the next job. Every rank's outcome (its reply, or its
traceback) comes back to the controller through the store.

The store takes writes from anyone who reaches its port, so what it carries is data only (jobspec.py): a
registered job's name with JSON arguments every rank checks against its own command line, and JSON
outcomes. A message distbench did not send is refused before any of it runs, and stops the launch: a
follower that refuses one says so in one line and posts why (`refused`), on which every rank exits; rank 0
posts each job under a new key and checks that it is still its own once the replies are in. A job swapped
in between rank 0's post and a follower's read may pass every check and still not be rank 0's: so the
ranks of a job's world first all-gather the SHA-256 of the bytes each read (rank 0: of those it posted)
over the job's own process group, and none runs the job unless all are equal.

No process waits without a bound (launchwatch.py): a job's collectives time out with the job (`--timeout`); the
controller gives up on a rank that has not answered shortly after, asks every follower for its Python stack and
to exit; a rank whose own part of a job, or whose wait for the next job, outlasts its bound says so in one line
and exits; followers also exit when the store (hosted by torchrun's agent) goes away.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, JobSpecError, ResourceError
from .context import RankContext, collective_backend, process_group_backend
from .fingerprint import nodes_spanned
from .jobspec import Admission, Job, JobRegistry, Stop, decode_outcome, encode_outcome
from .launchwatch import (
    ABORT,
    REFUSED,
    RELEASED,
    STACK_WAIT_S,
    Watch,
    hand_out_bound,
    job_bounds,
    reply_grace,
    stacks_left,
)
from .pool import JobError, RankOutcome, check_configs, failure_summary
from .worker import job_name

_POLL_S = 0.1  # rank 0 waiting for replies
_JOB_POLL_S = 0.5  # followers waiting for the next job: every rank of the launch polls the store


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the world torchrun launched (node-major ranks, equal GPUs per node)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ = os.environ) -> Launch:
        missing = [
            k
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            if k not in environ
        ]
        if missing:
            raise ConfigError(
                f"distbench launch runs in every process of a torchrun job ({', '.join(missing)} "
                "unset): torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d "
                "--rdzv-endpoint HOST:PORT -m distbench.cli launch -- RUN-ARGS"
            )
        return cls(
            int(environ["RANK"]),
            int(environ["WORLD_SIZE"]),
            int(environ["LOCAL_RANK"]),
            int(environ["LOCAL_WORLD_SIZE"]),
        )

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def job_nodes(self, world_size: int) -> int:
        """Nodes a job of `world_size` ranks spans; ResourceError when it is no subset this launch can form."""
        per_node = self.local_world_size
        if world_size > self.world_size:
            raise ResourceError(
                f"world size {world_size} exceeds the {self.world_size} launched ranks "
                f"({self.nodes} node(s) x {per_node}); launch more or use --world-size "
                f"{self.world_size} or fewer"
            )
        if world_size > per_node and world_size % per_node:
            raise ResourceError(
                f"world size {world_size} is not whole nodes of {per_node} ranks; use a "
                f"multiple of {per_node} (or at most {per_node})"
            )
        return nodes_spanned(world_size, per_node)


def connect_store(launch: Launch, timeout_s: float) -> dist.Store:
    """torchrun's key-value store (the agent's, shared with its workers), under a prefix for this attempt;
    ConfigError, in one line, when it cannot be reached within `timeout_s`."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size=None if agent else launch.world_size,
            is_master=not agent and launch.rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:  # DistStoreError and DistNetworkError are RuntimeErrors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"rank {launch.rank} gave up after {timeout_s:.0f}s waiting for torchrun's store at {where} ({first})"
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distbench/attempt_{attempt}", store)


def local_device(launch: Launch, device_type: str) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(launch.local_rank)
        return torch.device("cuda", launch.local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.local_world_size))
    return torch.device("cpu")


def describe_job(job: Job) -> str:
    """One line naming a job and, where it trains a configuration, the configuration."""
    cfg = job.kwargs.get("cfg")
    if cfg is None or not hasattr(cfg, "strategy"):
        return f"{job.name} on {job.world_size} ranks"
    return f"{job.name} ({cfg.strategy} ws{cfg.world_size} {cfg.model}) on {job.world_size} ranks"


@contextlib.contextmanager
def job_environment(launch: Launch, world_size: int) -> Iterator[None]:
    """The launcher's variables as the job's world has them, while it runs: libraries read the world from them
    (DeepSpeed's zero.Init refuses a 1-rank group under WORLD_SIZE=2, so ZeRO-3 at world size 1 of a 2-rank
    launch failed). RANK and LOCAL_RANK hold: a job runs on the first ranks."""
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(min(world_size, launch.local_world_size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_job(
    launch: Launch, store: dist.Store, device: torch.device, job_id: int, job: Job, watch: Watch
) -> dict[str, Any]:
    """Join the job's world (the first n ranks) as the default group, run the job once every rank of it read
    the same bytes, leave; this rank's outcome. JobSpecError, and nothing run, when one read other bytes.
    `watch` bounds it (launchwatch.job_bounds)."""
    n = job.world_size
    named = f"job {job_id}: {describe_job(job)}"
    # A rank killed by a signal (a segfault in NCCL, say) leaves no Python traceback: say first what it runs,
    # and let faulthandler write the Python stack it died in (the collective it had entered) to the log.
    print(f"distbench launch rank {launch.rank}: {named}", flush=True)
    faulthandler.enable(all_threads=True)
    group_timeout, own_bound = job_bounds(job.timeout, device.type)
    watch.expect(named, own_bound)
    try:
        with job_environment(launch, n):
            return _joined(launch, store, device, job_id, job, group_timeout)
    finally:
        watch.clear()


def _joined(
    launch: Launch, store: dist.Store, device: torch.device, job_id: int, job: Job, group_timeout: float
) -> dict[str, Any]:
    """run_job's part inside the job's world: form it, check the bytes, run, destroy it."""
    n = job.world_size
    try:
        # No device_id: a group bound to its device makes DeviceMesh split sub-groups off its communicator
        # (ncclCommSplit), and in this process, whose default group is made anew for every job, the split for
        # fsdp_hybrid's 2D mesh across two nodes died by SIGSEGV in split_group (2x H200, torch 2.11).
        # Unbound, the mesh makes its sub-groups with new_group, and NCCL connects each on first use.
        dist.init_process_group(
            process_group_backend(device.type),
            store=dist.PrefixStore(f"pg/{job_id}", store),
            rank=launch.rank,
            world_size=n,
            timeout=timedelta(seconds=group_timeout),
        )
        _same_bytes(f"job/{job_id}", job.digest, device)
        ctx = RankContext(
            launch.rank,
            n,
            launch.local_rank,
            device,
            collective_backend(device.type),
            nodes=launch.job_nodes(n),
        )
        return {"status": "ok", "reply": job.fn(ctx, **job.kwargs)}
    except JobSpecError:
        raise  # the job in the store is not rank 0's: a refusal that stops the launch, not a failed job
    except BaseException as e:  # everything reaches the controller, KeyboardInterrupt included
        return {"status": "error", "exc_type": type(e).__name__, "text": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _same_bytes(key: str, digest: bytes, device: torch.device) -> None:
    """All-gather every rank's digest of `key` over the job's process group (not the store, which a stranger
    can write); JobSpecError on every rank when one differs from rank 0's."""
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    other = [str(r) for r, d in enumerate(everyone) if not torch.equal(d, everyone[0])]
    if other:
        raise _changed(key, f"rank(s) {','.join(other)} read other bytes, so no rank ran it")


def _changed(key: str, how: str) -> JobSpecError:
    return JobSpecError(
        f"{key} in torchrun's store was changed after rank 0 posted it ({how}): another process writes to "
        "the store (anyone who reaches its port can)"
    )


def _wait_key(store: dist.Store, key: str, deadline: float | None, poll_s: float = _POLL_S) -> bool:
    """Poll until `key` exists (True) or the deadline passes (False); raises when the store is gone, and
    JobSpecError when a follower refused a message."""
    while not store.check([key]):
        if store.check([REFUSED]):
            raise JobSpecError(store.get(REFUSED).decode(errors="replace"))
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _post(store: dist.Store, key: str, data: bytes) -> None:
    """Post `data` under `key`, which nobody may have written before: a key that is already there means
    someone else writes to the store."""
    if store.compare_set(key, "", data) != data:  # type: ignore[arg-type]  # the binding takes bytes
        raise JobSpecError(
            f"{key} was in torchrun's store before rank 0 posted it: another process writes to the store "
            "(anyone who reaches its port can)"
        )


class Cluster:
    """The controller's view of the launched world, shaped like PoolManager (pool_for/close_all)."""

    def __init__(
        self, launch: Launch, store: dist.Store, device: torch.device, jobs: JobRegistry, admission: Admission
    ) -> None:
        self.launch, self.store, self.device = launch, store, device
        self.jobs, self.admission = jobs, admission
        self.device_type = device.type
        self._job_ids = itertools.count()
        self._broken: str | None = None
        #: Why the store is not distbench's alone (a refused or changed message): every later job raises it.
        self.refused: str | None = None
        self.watch = Watch(launch.rank, store, controller=True, followers=range(1, launch.world_size))

    def check_world_size(self, world_size: int) -> None:
        self.launch.job_nodes(world_size)

    def pool_for(self, world_size: int) -> ClusterPool:
        self.check_world_size(world_size)
        return ClusterPool(self, world_size)

    def run_job(
        self,
        world_size: int,
        job: Callable[..., Any],
        kwargs: dict[str, Any] | None = None,
        timeout: float = 600.0,
    ) -> list[Any]:
        """Run `job(ctx, **kwargs)` on the first `world_size` ranks; per-rank replies (index = rank)."""
        target = job_name(job)
        check_configs(kwargs, world_size)
        self.check_world_size(world_size)
        if self.refused:
            raise JobSpecError(self.refused)
        if self._broken:
            raise JobError(target, world_size, [], f"not run: {self._broken}")
        data = self.jobs.encode(job, kwargs or {}, world_size, timeout)
        # Rank 0 runs the job as the followers will, decoded and checked as they check it.
        spec = self.jobs.decode(data, self.admission)
        assert isinstance(spec, Job)
        job_id = next(self._job_ids)
        try:
            outs = self._run(job_id, data, spec)
        except JobSpecError as e:
            self.refused = str(e)
            raise
        missing = [r for r in range(world_size) if r not in outs]
        if missing:
            who = ",".join(map(str, missing))
            self._broken = f"rank(s) {who} did not finish {target} in {timeout:.0f}s"
            self.watch.say(
                f"job {job_id}: {describe_job(spec)}",
                f"gave up after {timeout + reply_grace(timeout):.0f}s; the launch runs nothing more",
                f"waiting for the outcome of rank(s) {who}",
            )
            stacks = self._abort(missing)
            for r in missing:
                outs[r] = {"status": "timeout", "text": stacks.get(r, "(no stack captured)")}
        outcomes = [
            RankOutcome(r, o["status"], o.get("exc_type"), o.get("text", "")) for r, o in sorted(outs.items())
        ]
        if all(o.status == "ok" for o in outcomes):
            return [outs[r]["reply"] for r in range(world_size)]
        raise JobError(target, world_size, outcomes, failure_summary(outcomes, timeout))

    def _run(self, job_id: int, data: bytes, spec: Job) -> dict[int, dict[str, Any]]:
        """Post the job, run rank 0's part, collect the outcomes that arrive in time (index = rank); check that
        the posted job is still the one rank 0 wrote."""
        key = f"job/{job_id}"
        # Ranks blocked in a collective when a peer failed report their own timeout error at `timeout`: wait a
        # little longer than that before calling them lost.
        deadline = time.monotonic() + spec.timeout + reply_grace(spec.timeout)
        try:
            _post(self.store, key, data)
        except JobSpecError as e:  # torchrun may stop the followers before one reads it: say what they would
            raise JobSpecError(f"{e}; {self._verdict(self.store.get(key))}") from None
        outs: dict[int, dict[str, Any]] = {
            0: run_job(self.launch, self.store, self.device, job_id, spec, self.watch)
        }
        for r in range(1, spec.world_size):
            if _wait_key(self.store, f"out/{job_id}/{r}", deadline):
                outs[r] = decode_outcome(self.store.get(f"out/{job_id}/{r}"), r)
        if self.store.get(key) != data:
            raise _changed(key, "while the job ran")
        return outs

    def _verdict(self, data: bytes) -> str:
        """What a follower makes of a message rank 0 did not post: the job it names, or why it refuses it."""
        try:
            found = self.jobs.decode(data, self.admission)
        except JobSpecError as e:
            return f"a follower refuses what it holds: {e}"
        return f"it holds {'a stop' if isinstance(found, Stop) else 'job ' + found.name}"

    def _abort(self, ranks: list[int]) -> dict[int, str]:
        """Tell every follower to write its Python stack and to exit once released; the stacks of `ranks` that
        arrive in time."""
        self.store.set(ABORT, "1")
        got = stacks_left(self.store, ranks, STACK_WAIT_S)
        return {r: f"Python stack at timeout:\n{text}" for r, text in got.items()}

    def close_all(self) -> None:
        """Nothing to close between matrices: each job forms and destroys its own process group."""

    def release(self, status: int) -> None:
        """Let the followers go with the launch's exit status: every node's agent then sees the same outcome
        (torchrun's agents wait at an exit barrier for one another after a success, never after a failure)."""
        self.watch.stop()
        stop = json.dumps({"stop": True, "status": status}).encode()
        self.store.set(f"job/{next(self._job_ids)}", stop)  # type: ignore[arg-type]  # the binding takes bytes
        self.store.set(RELEASED, "1")  # aborted followers, stuck in a job, exit on this


@dataclass
class ClusterPool:
    """One world size of a Cluster, shaped like RankPool for run_matrix and run_benchmark."""

    cluster: Cluster
    world_size: int
    #: RankPool's start time of the last run, for the phase table: torchrun started these processes already.
    last_start_s = 0.0

    @property
    def device_type(self) -> str:
        return self.cluster.device_type

    def run(
        self, job: Callable[..., Any], kwargs: dict[str, Any] | None = None, timeout: float = 600.0
    ) -> list[Any]:
        return self.cluster.run_job(self.world_size, job, kwargs, timeout)

    def close(self) -> None:
        """Nothing to close: each job forms and destroys its own process group."""


def follow(
    launch: Launch, store: dist.Store, device: torch.device, jobs: JobRegistry, admission: Admission
) -> int:
    """Follower loop: run each job the controller posts (when this rank is in its world) until the stop;
    the controller's exit status, or 1 when a message was refused (nothing of it runs)."""
    watch = Watch(launch.rank, store, controller=False)
    try:
        job_id, last = 0, "no job yet"
        while True:
            key = f"job/{job_id}"
            watch.expect(
                last, hand_out_bound(admission.timeout), f"waiting for the next job ({key}) from rank 0"
            )
            try:
                _wait_key(store, key, None, _JOB_POLL_S)
            except JobSpecError:
                return 1  # another rank refused a message, and said so
            watch.clear()
            try:
                job = jobs.decode(store.get(key), admission)
                if isinstance(job, Stop):
                    return job.status
                last = f"after job {job_id}: {describe_job(job)}"
                if launch.rank < job.world_size:
                    outcome = encode_outcome(run_job(launch, store, device, job_id, job, watch), job.name)
                    store.set(f"out/{job_id}/{launch.rank}", outcome)  # type: ignore[arg-type]
            except JobSpecError as e:
                watch.stop()  # before the refusal is posted: this rank returns its status rather than exit here
                return _refuse(store, f"rank {launch.rank} refused {key} from torchrun's store: {e}")
            job_id += 1
    finally:
        watch.stop()


def _refuse(store: dist.Store, reason: str) -> int:
    """Say in one line why this rank stops, and post it, so that every rank stops: exit status 1."""
    print(
        f"distbench launch: {reason}; nothing of it ran, and the launch stops (the store takes writes from "
        "anyone who reaches its port)",
        file=sys.stderr,
        flush=True,
    )
    if not store.check([REFUSED]):  # a refusal already posted (by another rank) is the one to keep
        store.set(REFUSED, reason)
    return 1
