"""Errors a user can act on. Each message names what was wrong and how to fix it."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

#: How many characters of a value from outside (torchrun's store, a file) an error quotes.
QUOTED_CHARS = 160
#: The longest refusal of a message from torchrun's store: a line of a log, whatever a stranger wrote.
REFUSAL_CHARS = 500


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
    it runs (the store takes writes from anyone who can reach its port). Its text is one line of at most
    REFUSAL_CHARS (and its length): whatever the message quoted, a refusal is no megabyte log line."""

    def __init__(self, message: str) -> None:
        super().__init__(clipped(message, REFUSAL_CHARS))


def clipped(text: str, limit: int) -> str:
    """`text` as one line of an error: its first `limit` characters, anything a terminal acts on (a newline,
    an escape) escaped, and its length when longer: a hostile message of megabytes stays one short line."""
    head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return head if len(text) <= limit else f"{head}... ({len(text):,} characters)"


_QUOTE = reprlib.Repr()
_QUOTE.maxlevel = 2
_QUOTE.maxstring = QUOTED_CHARS + 2  # its quotes
_QUOTE.maxlong = _QUOTE.maxother = QUOTED_CHARS


def shown(value: Any) -> str:
    """A value from outside as an error quotes it: its repr, a long string's start and its length, anything
    else as reprlib cuts it (numbers to their start and end, containers two levels deep)."""
    if isinstance(value, str) and len(value) > QUOTED_CHARS:
        return f"{value[:QUOTED_CHARS]!r}... ({len(value):,} characters)"
    return _QUOTE.repr(value)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ " Did you mean X?" for the known names closest to `name` (case-insensitive), or "" when none is close."""
    by_lower = {k.lower(): k for k in known}
    if name.lower() in by_lower:
        return f" Did you mean {by_lower[name.lower()]}?"
    # Over 7/3 as long as every known name, `name` is close to none at difflib's cutoff (0.6); and indexing a
    # hostile name of megabytes (a key from torchrun's store) would take seconds.
    if len(name) > 3 * max(map(len, by_lower), default=0):
        return ""
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3)
    return f" Did you mean {', '.join(by_lower[c] for c in close)}?" if close else ""


def first_line(text: str | None, limit: int | None = None) -> str:
    """A message's first line, at most `limit` characters: where a table cell or a one-line error quotes a
    multi-line one ("" for none)."""
    return (text or "").strip().split("\n", 1)[0][:limit]


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
