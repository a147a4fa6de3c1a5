"""A strategy's registry entry, importable without torch so that the CLI can check names before heavy imports.

Every fact another module needs about a strategy lives on its StrategySpec: where it runs and why not, its
typed user options, which default grids include it, its memory layout (invariants/memory.py), its checkpoint
format (whether it reshards, which exporter reads it: invariants/export.py) and the pre-flight check of its
configuration (DeepSpeed's: strategies/ds_config.py). `check_spec` says what an entry lacks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import RunConfig, check_value
from ..errors import ConfigError

#: The training-state components the memory model counts.
COMPONENTS = frozenset({"params", "grads", "optimizer"})

#: The default grids a strategy can belong to: `distbench run` (and asv) without flags on CPU or on GPUs,
#: asv's laptop-size CPU grid, and `distbench ab`'s default strategies.
Grid = Literal["cpu", "cuda", "asv-cpu", "ab"]
GRIDS: tuple[Grid, ...] = ("cpu", "cuda", "asv-cpu", "ab")


@dataclass(frozen=True)
class MemoryLayout:
    """Where a strategy keeps its training state (the analytic model of invariants/memory.py).

    `sharded`: components divided by the shard group (the world, or HSDP's shard dimension when
    `shard_group` is "hybrid"); `on_host`: components offloaded to host memory; `bytes_per_param`: "torch"
    (fp32 parameters that are also the master copy, 4/4/8 bytes for parameters/gradients/AdamW) or
    "deepspeed" (under bf16: bf16 parameters and gradients, fp32 master + AdamW, 2/2/12 bytes).
    """

    sharded: frozenset[str] = frozenset()
    on_host: frozenset[str] = frozenset()
    shard_group: Literal["world", "hybrid"] = "world"
    bytes_per_param: Literal["torch", "deepspeed"] = "torch"


#: The layouts the registry uses.
REPLICATED = MemoryLayout()
FULLY_SHARDED = MemoryLayout(sharded=COMPONENTS)


@dataclass(frozen=True)
class CheckpointFormat:
    """How a strategy saves: whether a checkpoint loads at another world size, and which exporter (a key of
    invariants/export.py's EXPORTERS) turns it into a plain state dict (None: it is one already)."""

    name: str
    reshards: bool
    exporter: str | None


TORCH_SAVE = CheckpointFormat("torch.save of the full state on rank 0", reshards=False, exporter=None)
DCP = CheckpointFormat("torch.distributed.checkpoint (DCP)", reshards=True, exporter="dcp")
DEEPSPEED = CheckpointFormat(
    "DeepSpeed, resharded through its universal checkpoint", reshards=True, exporter="zero_to_fp32"
)
#: Stage 0 keeps no ZeRO partitions for DeepSpeed's universal conversion to merge: the engine's own files, loaded
#: at the world size that saved them, and its model file holds the weights.
DEEPSPEED_STAGE0 = CheckpointFormat(
    "DeepSpeed engine checkpoint without ZeRO (stage 0)", reshards=False, exporter="ds_module"
)


@dataclass(frozen=True)
class Option:
    """A RunConfig.options key the strategy takes from users, with the type its value must have."""

    name: str
    annotation: Any


@dataclass(frozen=True)
class StrategySpec:
    """A registry entry. `target` is "module:Class", imported only when the strategy is used; `config_check`
    ("module:function" taking the RunConfig, or "") refuses a bad configuration before any rank starts."""

    name: str
    description: str
    target: str
    memory: MemoryLayout | None = None
    checkpoint: CheckpointFormat | None = None
    cpu: bool = True
    gpu_only_why: str = ""
    max_world_size: int | None = None
    defaults: tuple[tuple[str, Any], ...] = ()  # constructor options that define the strategy
    user_options: tuple[Option, ...] = ()  # RunConfig.options keys this strategy takes
    grids: frozenset[Grid] = field(default_factory=frozenset)
    config_check: str = ""
    fp16_devices: tuple[str, ...] = ("cpu", "cuda")  # the device types its fp16 (loss scaling) runs on
    fp16_why: str = ""  # why not on the others

    @property
    def trainer_module(self) -> str:
        """The module of its trainer ("ddp", "fsdp", "fsdp1", "deepspeed", "single"): the library whose code
        a test of library internals (collectives to patch, a library's own numerics) must reach."""
        return self.target.split(":")[0].rsplit(".", 1)[-1]

    def takes(self, option: str) -> bool:
        return any(o.name == option for o in self.user_options)

    def own_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The user options of `options` this strategy takes (a --ds-config reaches zero*, not ddp)."""
        return {k: v for k, v in options.items() if self.takes(k)}

    def options_for(self, cfg: RunConfig) -> dict[str, Any]:
        """The strategy's constructor options: its registry defaults plus the run's user options, type-checked."""
        names = [o.name for o in self.user_options]
        wrong = sorted(set(cfg.options) - set(names))
        if wrong:
            takes = f"it takes only {', '.join(names)}" if names else "it takes none"
            raise ConfigError(
                f"strategy {self.name} has no option {wrong[0]!r} ({takes}); remove it from options"
            )
        for o in self.user_options:
            if o.name in cfg.options:
                check_value(o.annotation, cfg.options[o.name], f"strategy {self.name} option {o.name!r}")
        return {**dict(self.defaults), **cfg.options}

    def check_config(self, cfg: RunConfig) -> None:
        """Run the strategy's pre-flight check of `cfg` (ConfigError), if it has one."""
        if self.config_check:
            module_name, fn = self.config_check.split(":")
            getattr(importlib.import_module(module_name), fn)(cfg)

    def unsupported_reason(
        self, device_type: str, world_size: int, device_count: int | None = None, precision: str = "fp32"
    ) -> str | None:
        """Why this strategy cannot run here (at this precision), or None if it can."""
        if device_type == "cpu" and not self.cpu:
            return f"{self.name} needs CUDA GPUs ({self.gpu_only_why})"
        if precision == "fp16" and device_type not in self.fp16_devices:
            where = f"on {' and '.join(self.fp16_devices)} only" if self.fp16_devices else "nowhere"
            return f"{self.name} runs fp16 {where} ({self.fp16_why})"
        if self.max_world_size is not None and world_size > self.max_world_size:
            return f"{self.name} runs on at most {self.max_world_size} rank(s)"
        if device_type == "cuda" and device_count is not None and world_size > device_count:
            return f"world size {world_size} needs {world_size} CUDA devices, found {device_count}"
        return None


def check_spec(spec: StrategySpec, exporters: set[str] | frozenset[str]) -> list[str]:
    """What a registry entry lacks or gets wrong (empty when complete); `exporters` are the known exporter names.

    Cheap (nothing is imported but `target`'s and `config_check`'s modules), so tests can run it on every entry.
    """
    bad: list[str] = []
    if not spec.description:
        bad.append("no description")
    if spec.memory is None:
        bad.append("no memory layout (MemoryLayout: what is sharded, what is on the host)")
    elif not (spec.memory.sharded | spec.memory.on_host) <= COMPONENTS:
        bad.append(f"memory layout names components outside {sorted(COMPONENTS)}")
    if spec.checkpoint is None:
        bad.append("no checkpoint format")
    elif spec.checkpoint.exporter is not None and spec.checkpoint.exporter not in exporters:
        bad.append(f"unknown exporter {spec.checkpoint.exporter!r} (known: {', '.join(sorted(exporters))})")
    if not spec.cpu and not spec.gpu_only_why:
        bad.append("GPU only without saying why (gpu_only_why)")
    if not spec.cpu and {"cpu", "asv-cpu"} & spec.grids:
        bad.append("in a CPU default grid but does not run on CPU")
    unknown_grids = set(spec.grids) - set(GRIDS)
    if unknown_grids:
        bad.append(f"unknown grid(s) {sorted(unknown_grids)} (known: {', '.join(GRIDS)})")
    names = [o.name for o in spec.user_options]
    if len(set(names)) != len(names) or set(names) & {k for k, _ in spec.defaults}:
        bad.append("a user option repeats another or one of the defaults")
    for what, target in (("target", spec.target), ("config_check", spec.config_check)):
        if not target:
            continue
        module_name, _, attr = target.partition(":")
        try:
            found = callable(getattr(importlib.import_module(module_name), attr, None))
        except ImportError as e:
            found, why = False, f": {e}"
        else:
            why = ""
        if not found:
            bad.append(f"{what} {target!r} does not name a callable{why}")
    return bad
