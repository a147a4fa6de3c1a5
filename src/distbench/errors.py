"""Errors a user can act on. Each message names what was wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class DistbenchError(Exception):
    """Base class for errors caused by input or environment, not by a bug in distbench."""


class ConfigError(DistbenchError, ValueError):
    """A run configuration that cannot work (unknown name, indivisible batch, bad ds_config, ...)."""


class ResourceError(DistbenchError):
    """The machine lacks what the run needs (devices, memory, a library)."""


class CheckpointError(DistbenchError):
    """A checkpoint that cannot be loaded: missing, truncated, or from another model or world size."""


class JobSpecError(DistbenchError):
    """A message in a launch's store that distbench did not send, or not in this form: refused before any of
    it runs (the store takes writes from anyone who can reach its port)."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ " Did you mean X?" for the known names closest to `name` (case-insensitive), or "" when none is close."""
    by_lower = {k.lower(): k for k in known}
    if name.lower() in by_lower:
        return f" Did you mean {by_lower[name.lower()]}?"
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3)
    return f" Did you mean {', '.join(by_lower[c] for c in close)}?" if close else ""


def error_line(text: str) -> str:
    """The one line of a failure's text that says what went wrong, for a report that has one line for it:
    the exception line that ends the first Python traceback in it (a rank's, inside a JobError's text; with
    chained exceptions, the first raised), else its first line. A failure's first line alone is often only
    where it happened ("job bench_setup failed at world size 1: rank 0 raised ConfigError"), its cause
    further down."""
    lines = text.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            raised = next((x for x in lines[i + 1 :] if x and not x[0].isspace()), None)
            if raised:
                return raised
    return lines[0] if lines else ""
