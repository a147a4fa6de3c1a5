"""What tests use to run jobs: the tier's defaults, the pools, and cached references.

One Suite per device type (cpu tier: gloo + tiny models; gpu tier: NCCL + GPU-size models), shared by
every test of a pytest session so rank pools and reference runs are built once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import RunConfig
from .runtime.phases import PhaseLog, job_phases
from .runtime.pool import PoolManager

#: Per-tier defaults: small enough for 2 CPU cores, real enough on GPUs. The global batch makes every
#: world size of the tier accumulate at least 2 micro-batches, so the parity runs exercise accumulation too.
TIER_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {
        "models": ["gpt2-tiny"],
        "world_sizes": [1, 2],
        "global_batch": 8,
        "micro_batch": 2,
        "seq_len": 0,
    },
    "cuda": {
        "models": ["gpt2-124m"],
        "world_sizes": [1, 2, 4],
        "global_batch": 16,
        "micro_batch": 2,
        "seq_len": 256,
    },
}

#: Benchmark workloads per tier: bf16 as users run it on GPUs (seed 004's sequence and micro-batch).
BENCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"precision": "fp32", "micro_batch": 2, "seq_len": 0, "steps": 3, "warmup": 1},
    "cuda": {"precision": "bf16", "micro_batch": 8, "seq_len": 1024, "steps": 10, "warmup": 3},
}


@dataclass
class Suite:
    device_type: str
    steps: int = 5
    timeout: float = 600.0
    models: list[str] = field(default_factory=list)
    pools: PoolManager | None = None
    workdir: Path | None = None  # where session-wide checkpoints go
    phases: PhaseLog = field(default_factory=PhaseLog)  # where the session's time went, per test
    current_test: str = ""  # set by the `suite` fixture: whose jobs the phases are charged to
    _references: dict[str, dict[str, Any]] = field(default_factory=dict)
    _runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.models = self.models or list(TIER_DEFAULTS[self.device_type]["models"])

    @property
    def pool_manager(self) -> PoolManager:
        if self.pools is None:
            self.pools = PoolManager(self.device_type)
        return self.pools

    def config(
        self, strategy: str = "single", world_size: int = 1, model: str | None = None, **overrides: Any
    ) -> RunConfig:
        d = TIER_DEFAULTS[self.device_type]
        base = {
            "strategy": strategy,
            "world_size": world_size,
            "model": model or self.models[0],
            "global_batch": d["global_batch"],
            "micro_batch": d["micro_batch"],
            "seq_len": d["seq_len"],
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
        t0 = time.perf_counter()
        outs = pool.run(job, kwargs, timeout or self.timeout)
        phases = job_phases(outs, time.perf_counter() - t0, pool.last_start_s)
        if phases:
            self.phases.add(self.current_test, phases)
        return outs

    def train(self, cfg: RunConfig, **kwargs: Any) -> list[dict[str, Any]]:
        """Run the train job at cfg.world_size; per-rank outputs (see jobs.train.train)."""
        # Imported here: torch and the strategies, and the plugin loads this module in every session.
        from .jobs.train import train

        return self.run_job(cfg.world_size, train, cfg=cfg, **kwargs)

    def reference(self, cfg: RunConfig) -> dict[str, Any]:
        """The independent single-process reference for cfg's workload (losses, final params, last
        gradients), computed once per session."""
        ref_cfg = cfg.replace(strategy="single", world_size=1, options={})
        key = repr(sorted(ref_cfg.to_dict().items()))
        if key not in self._references:
            from .jobs.checks import reference_job  # torch: see train

            self._references[key] = self.run_job(1, reference_job, cfg=ref_cfg, with_tensors=True)[0]
        return self._references[key]

    def checkpointed_run(self, cfg: RunConfig) -> dict[str, Any]:
        """One uninterrupted run of cfg, computed once per session and shared by the invariants: losses,
        final full parameters and last-step gradients (rank 0), and a checkpoint saved after step
        `save_at` (half-way) in the strategy's native format at `checkpoint`."""
        key = repr(sorted(cfg.to_dict().items()))
        if key not in self._runs:
            assert self.workdir is not None, "Suite.workdir must be set for checkpointed runs"
            ckpt = self.workdir / f"ckpt-{len(self._runs)}-{cfg.strategy}-ws{cfg.world_size}"
            save_at = max(1, cfg.steps // 2)
            outs = self.train(
                cfg, save_at=save_at, checkpoint_dir=str(ckpt), return_params=True, return_grads=True
            )
            self._runs[key] = {
                **outs[0],
                "per_rank_losses": [o["losses"] for o in outs],
                "checkpoint": str(ckpt),
                "save_at": save_at,
            }
        return self._runs[key]

    def close(self) -> None:
        if self.pools is not None:
            self.pools.close_all()
