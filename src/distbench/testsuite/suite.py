"""What tests use to run jobs: the tier's defaults, the pools, and the session's shared runs.

One Suite per device type (cpu tier: gloo + tiny models; gpu tier: NCCL + GPU-size models) per process,
shared by every test it runs, so rank pools are built once per process; reference runs and checkpointed
runs are computed once per session and kept on a Shelf (runtime/shelf.py) that every lane reads.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..runtime.phases import SHARED, PhaseLog, job_phases
from ..runtime.pool import PoolManager
from ..runtime.shelf import TENSORS, Shelf, entry_key, load_tensors

#: Per-tier defaults: small enough for 2 CPU cores, real enough on GPUs. The global batch (tier_global_batch)
#: makes every world size accumulate 2 micro-batches, so the parity runs exercise accumulation too.
TIER_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {
        "models": ["gpt2-tiny"],
        "world_sizes": [1, 2],
        "micro_batch": 2,
        "seq_len": 0,
    },
    "cuda": {
        "models": ["gpt2-124m"],
        "world_sizes": [1, 2, 4],
        "micro_batch": 2,
        "seq_len": 256,
    },
}


def tier_global_batch(device_type: str, world_size: int) -> int:
    """Two micro-batches per rank at `world_size`: every world size accumulates, and no step is longer than
    that needs. Small models' steps wait on the host, so a step's micro-batches are its cost: one global batch
    for every world size of a 4-GPU session gave a world-size-1 step 8 micro-batches (on 4 H200s the
    world-size-1 tests' training steps took 800 s of test time; 486 s with 2). Each configuration is compared
    with a reference of its own global batch; a test that moves a run to another world size keeps its batch
    (RunConfig.resized)."""
    return 2 * TIER_DEFAULTS[device_type]["micro_batch"] * world_size


#: Benchmark workloads per tier: bf16 as users run it on GPUs (seed 004's sequence and micro-batch).
BENCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"precision": "fp32", "micro_batch": 2, "seq_len": 0, "steps": 3, "warmup": 1},
    "cuda": {"precision": "bf16", "micro_batch": 8, "seq_len": 1024, "steps": 10, "warmup": 3},
}


def fitting_seq_len(seq_len: int, model: str) -> int:
    """The tier's sequence length, cut to the model's positions where it has fewer: the GPU tier's 256 past
    gpt2-tiny's 64 fails every job in an embedding lookup on the device. 0 (the model's own) stays."""
    if not seq_len:
        return seq_len
    from ..workloads import get_model

    positions = get_model(model).max_positions
    return min(seq_len, positions) if positions else seq_len


@dataclass
class Suite:
    device_type: str
    steps: int = 5
    timeout: float = 600.0
    models: list[str] = field(default_factory=list)
    global_batch: int = 0  # 0: tier_global_batch of each configuration's world size
    pools: PoolManager | None = None  # given (a launch's Cluster): its owner closes it; else made here
    shelf: Shelf | None = None  # the session's shared runs and checkpoints (every lane's)
    phases: PhaseLog = field(default_factory=PhaseLog)  # where the session's time went, per test
    current_test: str = ""  # set by the `suite` fixture: whose jobs the phases are charged to
    _own_shelf: bool = False
    _own_pools: bool = False
    #: world size -> the tests whose jobs this process's pool ran, in order (who to suspect of a leak)
    history: dict[int, list[str]] = field(default_factory=dict)
    #: the shelf entries handed out since the last check_shelved (the current test's)
    _lent: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.models = self.models or list(TIER_DEFAULTS[self.device_type]["models"])

    @property
    def pool_manager(self) -> PoolManager:
        if self.pools is None:
            self.pools = PoolManager(self.device_type)
            self._own_pools = True
        return self.pools

    def config(
        self, strategy: str = "single", world_size: int = 1, model: str | None = None, **overrides: Any
    ) -> RunConfig:
        d = TIER_DEFAULTS[self.device_type]
        model = model or self.models[0]
        base = {
            "strategy": strategy,
            "world_size": world_size,
            "model": model,
            "global_batch": self.global_batch or tier_global_batch(self.device_type, world_size),
            "micro_batch": d["micro_batch"],
            "seq_len": fitting_seq_len(d["seq_len"], model),
            "steps": self.steps,
        }
        return RunConfig(**{**base, **overrides})

    def bench_config(
        self, strategy: str, world_size: int, model: str | None = None, **overrides: Any
    ) -> RunConfig:
        """A performance configuration: non-deterministic kernels allowed, global batch = micro x 4 GPUs."""
        b = BENCH_DEFAULTS[self.device_type]
        base = {**b, "global_batch": b["micro_batch"] * 4, "deterministic": False}
        return self.config(strategy, world_size, model, **{**base, **overrides})

    def run_job(
        self, world_size: int, job: Callable[..., Any], timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run `job(ctx, **kwargs)` in every rank of the pool of `world_size`; per-rank outputs, their phases
        charged to the current test."""
        pool = self.pool_manager.pool_for(world_size)
        ran = self.history.setdefault(world_size, [])
        if not ran or ran[-1] != self.current_test:
            ran.append(self.current_test)
        t0 = time.perf_counter()
        outs = pool.run(job, kwargs, timeout or self.timeout)
        phases = job_phases(outs, time.perf_counter() - t0, pool.last_start_s)
        if phases:
            self.phases.add(self.current_test, phases)
        return outs

    def held_bytes(self) -> int:
        """Device memory this process's ranks hold after their last jobs (what those jobs left), all pools."""
        if self.pools is None:
            return 0
        return self.pools.held_bytes()

    def train(self, cfg: RunConfig, **kwargs: Any) -> list[dict[str, Any]]:
        """Run the train job at cfg.world_size; per-rank outputs (see jobs.train.train). Full parameters and
        gradients (return_params, return_grads) come back through a safetensors file rank 0 writes, not its
        pipe: a GPU-tier model's are a gigabyte, which pickling and unpickling cost seconds a test."""
        # Imported here: torch and the strategies, and the plugin loads this module in every session.
        from ..jobs.train import train

        if not (kwargs.get("return_params") or kwargs.get("return_grads")) or "keep_tensors_at" in kwargs:
            return self.run_job(cfg.world_size, train, cfg=cfg, **kwargs)
        with tempfile.TemporaryDirectory(prefix="distbench-tensors-", dir=self._scratch()) as d:
            path = Path(d) / TENSORS
            outs = self.run_job(cfg.world_size, train, cfg=cfg, keep_tensors_at=str(path), **kwargs)
            if path.exists():
                outs[0].update(load_tensors(path))
        return outs

    def _scratch(self) -> str | None:
        """Where tensors in transit go: beside the shelf (memory-backed when the session's is)."""
        return str(self.shelf.root) if self.shelf is not None else None

    def _shelved(self, kind: str, cfg: RunConfig, compute: Any) -> dict[str, Any]:
        if self.shelf is None:  # no session to share with: a shelf of this Suite's own, removed by close()
            self.shelf = Shelf(tempfile.mkdtemp(prefix="distbench-suite-"))
            self._own_shelf = True
        # a strategy's entries go when its tests are done; references and initial weights serve every strategy
        tag = "" if kind in ("reference", "initial") else cfg.strategy
        key = entry_key(f"{kind}-{self.device_type}", cfg.to_dict(), tag)
        out = self.shelf.get(key, compute)
        self._lent.add(key)
        self.phases.add(self.current_test, {SHARED: self.shelf.waited_s})
        return out

    def check_shelved(self) -> None:
        """ShelfEntryChanged naming the entry when one handed out since the last check (to the test now
        ending) was written into: the test that did it fails, not a later one that happens to read it."""
        lent, self._lent = self._lent, set()
        for key in sorted(lent):
            assert self.shelf is not None  # set by the _shelved that lent it
            self.shelf.check(key)

    def reference(self, cfg: RunConfig) -> dict[str, Any]:
        """The independent single-process reference for cfg's workload (losses, final params, last
        gradients), computed once per session."""
        ref_cfg = cfg.replace(strategy="single", world_size=1, options={})
        from ..jobs.checks import reference_job  # torch: see train

        def compute(entry: Path) -> dict[str, Any]:
            out = self.run_job(1, reference_job, cfg=ref_cfg, keep_tensors_at=str(entry / TENSORS))[0]
            return {k: v for k, v in out.items() if k != "phases"}

        return self._shelved("reference", ref_cfg, compute)

    def initial_weights(self, cfg: RunConfig) -> dict[str, Any]:
        """cfg's model's weights before training, as its ranks build them, once per session."""
        init_cfg = cfg.replace(strategy="single", world_size=1, options={})
        from ..jobs.checks import initial_weights_job  # torch: see train

        def compute(entry: Path) -> dict[str, Any]:
            self.run_job(1, initial_weights_job, cfg=init_cfg, keep_tensors_at=str(entry / TENSORS))
            return {}

        return self._shelved("initial", init_cfg, compute)["initial"]

    def checkpointed_run(self, cfg: RunConfig) -> dict[str, Any]:
        """One uninterrupted run of cfg, computed once per session and shared by the invariants: losses,
        final full parameters and last-step gradients (rank 0), and a checkpoint saved after step
        `save_at` (half-way) in the strategy's native format at `checkpoint`."""
        save_at = max(1, cfg.steps // 2)

        def compute(entry: Path) -> dict[str, Any]:
            ckpt = entry / "checkpoint"
            outs = self.train(
                cfg,
                save_at=save_at,
                checkpoint_dir=str(ckpt),
                return_params=True,
                return_grads=True,
                keep_tensors_at=str(entry / TENSORS),
            )
            return {
                **{k: v for k, v in outs[0].items() if k != "phases"},
                "per_rank_losses": [o["losses"] for o in outs],
                "checkpoint": str(ckpt),
                "save_at": save_at,
            }

        return self._shelved("run", cfg, compute)

    def close(self) -> None:
        """Close what this Suite made: its pools and its own shelf."""
        if self._own_pools and self.pools is not None:
            self.pools.close_all()
        if self._own_shelf and self.shelf is not None:
            shutil.rmtree(self.shelf.root, ignore_errors=True)
