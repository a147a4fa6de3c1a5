"""RunConfig: everything that defines one training configuration, validated before any rank starts.

Each field's type and bounds are stated once, in its annotation, and checked by pydantic (strict: a YAML
`steps: "5"` or `steps: 2.5` is refused, not coerced) whichever way a configuration arrives: the CLI, a
matrix YAML, the pytest options, or code.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from .errors import ConfigError, did_you_mean, shown

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1)]
Beta = Annotated[float, Field(ge=0, lt=1)]
#: A dropout rate: the probability of zeroing a unit (1 would zero everything).
DropoutRate = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]

#: fp16 trains with dynamic loss scaling (loss_scale_power, loss_scale_window); bf16 and fp32 need none.
#: "bf16" is each strategy's own bf16 policy (FSDP's bf16 compute copies of fp32 parameters, DeepSpeed's bf16
#: weights with fp32 optimizer copies, torch.autocast for single and DDP): three regimes with different ops in
#: bf16. "bf16-amp" is one regime for every strategy: fp32 parameters, gradients and reduction, bf16 compute
#: through torch.autocast; the like-for-like choice for comparing strategies.
Precision = Literal["fp32", "bf16", "fp16", "bf16-amp"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
#: The precisions that compute in bf16 (the dtype of their matmuls' tensor-core peak)
BF16_COMPUTE: tuple[str, ...] = ("bf16", "bf16-amp")
#: AdamW implementations: "auto" picks fused where it supports the parameters (CUDA, DTensor included),
#: foreach otherwise; the others force one. Every result records the one that ran.
Optimizer = Literal["auto", "fused", "foreach", "forloop"]
OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)
#: The update rule. AdamW is what users train with; SGD with momentum is there for parity, because Adam's
#: scale invariance hides a gradient scaled by a constant (a missing 1/world_size) from the losses.
Algorithm = Literal["adamw", "sgd"]
Momentum = Annotated[float, Field(ge=0, lt=1)]
#: log2 of fp16's first loss scale: 2**64 is far past any gradient's overflow, and fp32 holds it exactly.
ScalePower = Annotated[int, Field(ge=0, le=64)]
#: "events": no host synchronization inside a timed window (per-step times from device events, the
#: window's throughput from its wall clock around one final sync), as users train; "sync": a device
#: synchronization around every step, the old mode, kept for comparison.
Timing = Literal["events", "sync"]
TIMINGS: tuple[str, ...] = typing.get_args(Timing)
#: A LoRA target: a module name or dotted name suffix, matched as peft matches a list of names
#: ("c_proj" adapts every module called c_proj; "attn.c_proj" only attention's).
LoraTarget = Name


class OnRank:
    """Annotated metadata of a job parameter naming a file or directory on the rank's machine: a job read from
    a launch's store may name one only inside that rank's own --output (runtime/jobspec.py)."""


#: A path a job writes or reads on the rank's machine (a checkpoint, a trace directory).
LocalPath = Annotated[str, Field(min_length=1), OnRank()]


@dataclass(frozen=True)
class RunConfig:
    """One configuration: strategy x world size x workload x precision, plus optimizer settings.

    Every optimizer step consumes one global batch of `global_batch` samples; each rank takes
    `global_batch / world_size` of them in micro-batches of `micro_batch`, so the samples a step sees do
    not depend on the world size (see workloads/data.py).
    """

    strategy: Name = "ddp"  # a registry name (`distbench strategies`)
    world_size: PositiveInt = 1  # ranks
    model: Name = "gpt2-tiny"  # a built-in model, or a factory as package.module:function
    seq_len: NonNegativeInt = 0  # 0: the model's default
    global_batch: PositiveInt = 8  # samples per optimizer step, over all ranks
    micro_batch: PositiveInt = 2  # samples per forward/backward on a rank; the rest is accumulation
    precision: Precision = "fp32"  # bf16 or fp16 compute over fp32 master weights; fp16 scales the loss
    steps: PositiveInt = 5  # optimizer steps (timed, in performance runs)
    warmup: NonNegativeInt = 0  # steps not timed (performance runs)
    lr: NonNegativeFloat = 1e-3  # peak learning rate
    weight_decay: NonNegativeFloat = 0.01  # AdamW's decoupled weight decay (SGD: L2)
    betas: tuple[Beta, Beta] = (0.9, 0.95)  # AdamW's
    eps: PositiveFloat = 1e-8  # AdamW's
    lr_warmup_steps: NonNegativeInt = 3  # linear warm-up of the learning rate from a quarter of it
    seed: NonNegativeInt = 1234  # weights, data and every global generator derive from it
    compile: bool = False  # torch.compile each transformer block
    deterministic: bool = True  # deterministic kernels (parity runs); performance runs turn it off
    # True: Python's collector may run inside timed steps (measure/pygc.py)
    gc_during_steps: bool = False
    optimizer: Optimizer = "auto"  # AdamW implementation
    algorithm: Algorithm = "adamw"  # the update rule; "sgd" uses lr, momentum and weight_decay
    momentum: Momentum = 0.9  # SGD only
    timing: Timing = "events"  # how timed windows are measured
    clip_grad_norm: NonNegativeFloat = 0.0  # max global gradient norm before each step (0: no clipping)
    activation_checkpointing: bool = False  # recompute each transformer block's activations in backward
    # the model's dropout rate, each sample's masks drawn from its own stream (workloads/dropout.py); 0: off
    dropout: DropoutRate = 0.0
    # fp16's dynamic loss scale: it starts at 2**loss_scale_power, halves on a step whose gradients overflow (the
    # step is skipped), doubles after loss_scale_window overflow-free steps in a row (torch's GradScaler defaults)
    loss_scale_power: ScalePower = 16
    loss_scale_window: PositiveInt = 2000  # overflow-free steps before fp16's loss scale doubles
    lora_rank: NonNegativeInt = 0  # LoRA through peft: base weights frozen, rank-r adapters trained (0: off)
    lora_alpha: PositiveInt = 16  # adapter output scaled by lora_alpha / lora_rank (an int, as peft takes it)
    lora_targets: tuple[
        LoraTarget, ...
    ] = ()  # modules to adapt; (): the model family's (see workloads/models.py)
    windows: PositiveInt = 1  # the timed steps run as this many windows, each between two synchronizations
    device_time_steps: NonNegativeInt = 2  # extra steps sampled under the profiler for device time and regime
    # Measure until the figure repeats (measure/adaptive.py): after the `windows` windows, more windows of the
    # same length until the 95% interval of the median window is within +/-until_ci of it, or max_windows;
    # a slower start (warm-up not yet over) is moved out of the timed windows. 0: exactly `windows` windows.
    until_ci: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    max_windows: PositiveInt = 12
    options: dict[str, Any] = field(default_factory=dict)  # strategy options, e.g. {"ds_config": {...}}

    def __post_init__(self) -> None:
        check_fields(self)
        if self.lora_targets and not self.lora_rank:
            raise ConfigError(
                f"lora_targets {list(self.lora_targets)} given without lora_rank; set lora_rank "
                "(e.g. 8) to train LoRA adapters, or drop lora_targets"
            )
        if self.until_ci and self.max_windows < self.windows:
            raise ConfigError(
                f"max_windows ({self.max_windows}) is below windows ({self.windows}); raise --max-windows"
            )
        if self.windows > self.steps:
            raise ConfigError(
                f"windows must be at most steps ({self.steps}), got {self.windows}; lower --windows"
            )
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
    def window_steps(self) -> list[int]:
        """Steps per timed window: `steps` split as evenly as possible over `windows`, longer ones first."""
        q, r = divmod(self.steps, self.windows)
        return [q + 1] * r + [q] * (self.windows - r)

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world_size

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def resized(self, world_size: int) -> RunConfig:
        """The same training on `world_size` ranks, as a resume at another size runs it: the same global batch
        (the same samples each step), the micro-batch shrunk where that many ranks of it would overshoot."""
        micro = min(self.micro_batch, max(1, self.global_batch // world_size))
        return self.replace(world_size=world_size, micro_batch=micro)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["lora_targets"] = list(self.lora_targets)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        check_keys(d)
        return cls(**from_json(d))


def from_json(d: dict[str, Any]) -> dict[str, Any]:
    """RunConfig fields as JSON and YAML hold them (betas, lora_targets: lists) in the types RunConfig holds
    (tuples)."""
    return {**d, **{k: tuple(d[k]) for k in ("betas", "lora_targets") if isinstance(d.get(k), list)}}


def check_keys(d: dict[str, Any], extra: typing.Collection[str] = ()) -> None:
    """ConfigError naming unknown keys (with the nearest known one): RunConfig's fields plus `extra`."""
    known = [f.name for f in dataclasses.fields(RunConfig)] + list(extra)
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key {shown(unknown[0])}.{did_you_mean(unknown[0], known)} "
            f"Known keys: {', '.join(sorted(known))}"
        )


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    """A dataclass's resolved annotations, resolved once per class."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls, include_extras=True)
    return _FIELD_TYPES[cls]


def check_fields(obj: Any) -> None:
    """Every field of the dataclass `obj` validated against its annotation (ConfigError on the first bad one)."""
    for f in dataclasses.fields(obj):
        check_value(_field_types(type(obj))[f.name], getattr(obj, f.name), f.name)


def check_value(annotation: Any, value: Any, what: str) -> Any:
    """`value` validated against `annotation` (one of the types above), or one ConfigError line naming `what`
    and what it should be."""
    try:
        return _adapter(annotation).validate_python(value, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"[{p}]" for p in err["loc"])
        raise ConfigError(f"{what}{where} = {shown(value)} is invalid: {err['msg'].lower()}") from None


def check_field(name: str, value: Any) -> Any:
    """One RunConfig field validated on its own (a key of a matrix YAML or of code's overrides)."""
    return check_value(_field_types(RunConfig)[name], value, name)


def parse_value(annotation: Any, text: str, what: str) -> Any:
    """A command-line or pytest option string validated against `annotation` (lax: "2" is 2, "two" is not)."""
    try:
        return _adapter(annotation).validate_python(text.strip())
    except ValidationError as e:
        raise ConfigError(f"{what} {text!r} is invalid: {e.errors()[0]['msg'].lower()}") from None


def parse_list(annotation: Any, text: str, what: str) -> list[Any]:
    """A comma-separated option: every entry validated, a blank entry (`-s ''`, `1,,2`) refused."""
    items = text.split(",")
    if any(not x.strip() for x in items):
        raise ConfigError(f"{what} {text!r} has an empty entry; give comma-separated values")
    return [parse_value(annotation, x, what) for x in items]


def config_label(cfg: Mapping[str, Any]) -> str:
    """Short unambiguous name of a configuration, from a result's config section (everything in
    `results.config_key`)."""
    label = (
        f"{cfg.get('strategy')} ws{cfg.get('world_size')} {cfg.get('model')} {cfg.get('precision')} "
        f"s{cfg.get('seq_len')} gb{cfg.get('global_batch')} mb{cfg.get('micro_batch')}"
    )
    return label + (" compiled" if cfg.get("compile") else "")


def label_of(cfg: RunConfig) -> str:
    """A configuration as the report names it (+AC: activation checkpointing)."""
    ac = " +AC" if cfg.activation_checkpointing else ""
    return f"{cfg.strategy} ws{cfg.world_size} {cfg.model} {cfg.precision} mb{cfg.micro_batch}{ac}"
