"""A strategy's registry entry, importable without torch so that the CLI can check names before heavy imports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError


@dataclass(frozen=True)
class StrategySpec:
    """A registry entry. `target` is "module:Class", imported only when the strategy is used."""

    name: str
    description: str
    target: str
    cpu: bool = True
    min_world_size: int = 1
    max_world_size: int | None = None
    family: str = ""
    defaults: tuple[tuple[str, Any], ...] = ()
    gpu_only_why: str = ""
    user_options: tuple[str, ...] = ()  # RunConfig.options keys this strategy takes; the rest define it
    fp16_devices: tuple[str, ...] = ("cpu", "cuda")  # the device types its fp16 (loss scaling) runs on
    fp16_why: str = ""  # why not on the others

    def options_for(self, cfg: RunConfig) -> dict[str, Any]:
        """The strategy's constructor options: its registry defaults plus the run's user options."""
        wrong = sorted(set(cfg.options) - set(self.user_options))
        if wrong:
            takes = f"it takes only {', '.join(self.user_options)}" if self.user_options else "it takes none"
            raise ConfigError(f"strategy {self.name} has no option {wrong[0]!r} ({takes}); remove it from options")
        return {**dict(self.defaults), **cfg.options}

    def unsupported_reason(self, device_type: str, world_size: int, device_count: int | None = None,
                           precision: str = "fp32") -> str | None:
        """Why this strategy cannot run here (at this precision), or None if it can."""
        if device_type == "cpu" and not self.cpu:
            return f"{self.name} needs CUDA GPUs ({self.gpu_only_why or 'it does not run on CPU/gloo'})"
        if precision == "fp16" and device_type not in self.fp16_devices:
            where = f"on {' and '.join(self.fp16_devices)} only" if self.fp16_devices else "nowhere"
            return f"{self.name} runs fp16 {where} ({self.fp16_why})"
        if world_size < self.min_world_size:
            return f"{self.name} needs world size >= {self.min_world_size}"
        if self.max_world_size is not None and world_size > self.max_world_size:
            return f"{self.name} runs on at most {self.max_world_size} rank(s)"
        if device_type == "cuda" and device_count is not None and world_size > device_count:
            return f"world size {world_size} needs {world_size} CUDA devices, found {device_count}"
        return None
