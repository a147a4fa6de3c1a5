"""Errors a user can act on. Each message names what was wrong and how to fix it."""

from __future__ import annotations


class DistbenchError(Exception):
    """Base class for errors caused by input or environment, not by a bug in distbench."""


class ConfigError(DistbenchError, ValueError):
    """A run configuration that cannot work (unknown name, indivisible batch, bad ds_config, ...)."""


class ResourceError(DistbenchError):
    """The machine lacks what the run needs (devices, memory, a library)."""


class CheckpointError(DistbenchError):
    """A checkpoint that cannot be loaded: missing, truncated, or from another model or world size."""
