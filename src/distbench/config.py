"""RunConfig: everything that defines one training configuration, validated before any rank starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

PRECISIONS = ("fp32", "bf16")
#: AdamW implementations: "auto" picks fused where it supports the parameters (CUDA, DTensor included),
#: foreach otherwise; the others force one. Every result records the one that ran.
OPTIMIZERS = ("auto", "fused", "foreach", "forloop")
#: "events": no host synchronization inside a timed window (per-step times from device events, the
#: window's throughput from its wall clock around one final sync), as users train; "sync": a device
#: synchronization around every step, the old mode, kept for comparison.
TIMINGS = ("events", "sync")


@dataclass(frozen=True)
class RunConfig:
    """One configuration: strategy x world size x workload x precision, plus optimizer settings.

    Every optimizer step consumes one global batch of `global_batch` samples; each rank takes
    `global_batch / world_size` of them in micro-batches of `micro_batch`, so the samples a step sees do
    not depend on the world size (see workloads/data.py).
    """

    strategy: str = "ddp"
    world_size: int = 1
    model: str = "gpt2-tiny"
    seq_len: int = 0  # 0: the model's default
    global_batch: int = 8
    micro_batch: int = 2
    precision: str = "fp32"
    steps: int = 5
    warmup: int = 0  # steps not timed (performance runs)
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    lr_warmup_steps: int = 3
    seed: int = 1234
    compile: bool = False
    deterministic: bool = True
    gc_during_steps: bool = False  # True: Python's collector may run inside timed steps (measure/pygc.py)
    optimizer: str = "auto"  # AdamW implementation, one of OPTIMIZERS
    timing: str = "events"  # how timed windows are measured, one of TIMINGS
    windows: int = 1  # the timed steps run as this many windows, each between two synchronizations
    device_time_steps: int = 2  # extra steps sampled under the profiler for device time and regime (GPU)
    options: dict[str, Any] = field(default_factory=dict)  # strategy options, e.g. {"ds_config": {...}}

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if self.micro_batch < 1 or self.global_batch < 1:
            raise ConfigError("global_batch and micro_batch must be >= 1")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if not 1 <= self.windows <= self.steps:
            raise ConfigError(f"windows must be between 1 and steps ({self.steps}), got {self.windows}")
        if self.device_time_steps < 0:
            raise ConfigError(f"device_time_steps must be >= 0, got {self.device_time_steps}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.timing not in TIMINGS:
            raise ConfigError(f"unknown timing {self.timing!r}; choose one of {', '.join(TIMINGS)}")
        per_step = self.world_size * self.micro_batch
        if self.global_batch % per_step:
            lo = (self.global_batch // per_step) * per_step
            hint = f"{lo} or {lo + per_step}" if lo else f"{per_step}"
            raise ConfigError(
                f"global batch {self.global_batch} does not divide into world_size {self.world_size} x "
                f"micro_batch {self.micro_batch} = {per_step} samples per micro-step; use a global batch of "
                f"{hint}, or change --micro-batch"
            )

    @property
    def accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step (gradient accumulation)."""
        return self.global_batch // (self.world_size * self.micro_batch)

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world_size

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; known keys: {sorted(known)}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)
