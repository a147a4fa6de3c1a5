"""Results of rank jobs kept on disk for the whole test session: every lane process, and the session's own.

A reference run or a checkpointed run of one configuration is computed once per session, by whichever process
asks first; the others wait for it (an exclusive file lock per entry) and read it. An entry is a directory:
`tensors.safetensors` (dicts of tensors, written by rank 0 itself, so a model's full parameters never travel
through the ranks' pipes), `result.json` (everything else), and whatever the job writes beside them (its
checkpoint). safetensors and JSON run no code when read. A process that dies while computing releases its
lock, and the next one computes the entry again.

An entry is read-only to its users: every test of the session reads the same one, so a test that wrote into
it (a resharding load that converts a checkpoint in place) would change what later tests read, and only
when they happen to run after it. Each entry is sealed when computed (`sealed.json`: every file's size and
modification time), and a read, or `check` once a test is done, refuses one that changed since.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TENSORS = "tensors.safetensors"
RESULT = "result.json"
SEAL = "sealed.json"
_SEP = "/"


def save_tensors(path: str | Path, groups: dict[str, dict[str, Any]]) -> None:
    """Write dicts of tensors (`{"params": {...}, "grads": {...}}`) to one safetensors file, atomically. Tensors
    that share storage (tied weights) are written as copies."""
    from safetensors.torch import save_file

    flat, seen = {}, set()
    for group, tensors in groups.items():
        for name, t in tensors.items():
            key = f"{group}{_SEP}{name}"
            t = t.detach().cpu().contiguous()
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            flat[key] = t
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    save_file(flat, str(tmp))
    os.replace(tmp, path)


def load_tensors(path: str | Path) -> dict[str, dict[str, Any]]:
    """The dicts of tensors save_tensors wrote."""
    from safetensors.torch import load_file

    out: dict[str, dict[str, Any]] = {}
    for key, t in load_file(str(path)).items():
        group, _, name = key.partition(_SEP)
        out.setdefault(group, {})[name] = t
    return out


def entry_key(kind: str, identity: dict[str, Any], tag: str = "") -> str:
    """A stable directory name for a result of `kind` computed from `identity` (a configuration's fields);
    `tag` (a strategy) names a set of entries that Shelf.drop removes together."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return f"{kind}{_TAG.format(tag) if tag else '-'}{digest}"


_TAG = "--{}--"  # no glob characters: DeepSpeed globs its checkpoint directory


class ShelfEntryChanged(RuntimeError):
    """A shelf entry's files are not what they were when it was computed: a user wrote into it."""


def _files(entry: Path) -> dict[str, list[int]]:
    """Every file of the entry but its seal: [size, modification time in ns] by relative path."""
    out = {}
    for f in sorted(entry.rglob("*")):
        if f.is_file() and f.name != SEAL:
            st = f.stat()
            out[str(f.relative_to(entry))] = [st.st_size, st.st_mtime_ns]
    return out


def _seal(entry: Path) -> None:
    tmp = entry / f"{SEAL}.tmp"
    tmp.write_text(json.dumps(_files(entry)))
    os.replace(tmp, entry / SEAL)


def _unchanged(entry: Path, sealed: dict[str, list[int]]) -> None:
    """ShelfEntryChanged naming what differs from `sealed`, and why that is refused."""
    now = _files(entry)
    diffs = [f"added {n}" for n in now.keys() - sealed.keys()]
    diffs += [f"removed {n}" for n in sealed.keys() - now.keys()]
    diffs += [f"rewrote {n}" for n in now.keys() & sealed.keys() if now[n] != sealed[n]]
    if diffs:
        raise ShelfEntryChanged(
            f"shelf entry {entry} changed since it was computed ({', '.join(sorted(diffs)[:5])}): the "
            "session's runs and checkpoints are shared by every test and read-only to them; a test that "
            "writes into one (a resharding load that converts a checkpoint in place) must copy it first"
        )


def _read(entry: Path) -> dict[str, Any] | None:
    """The entry's result and tensors; None when it is missing or damaged (it is then computed again);
    ShelfEntryChanged when a user changed it."""
    from safetensors import SafetensorError

    try:
        out: dict[str, Any] = json.loads((entry / RESULT).read_text())
        sealed = json.loads((entry / SEAL).read_text())
    except (OSError, ValueError):
        return None
    _unchanged(entry, sealed)
    try:
        if (entry / TENSORS).exists():
            out.update(load_tensors(entry / TENSORS))
    except (OSError, ValueError, SafetensorError):
        return None
    return out


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Shelf:
    """Session-wide results under `root`, each computed once by whichever process asks first."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        #: the last get's seconds waiting for its entry (another process computing it) and reading it
        self.waited_s = 0.0

    def get(self, key: str, compute: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """The entry `key`: `compute(entry_dir)` runs once per session (it may write TENSORS and files into the
        directory and returns the JSON-able rest); every later call reads it. Tensors are read again each
        time, so no process keeps every run's parameters in memory."""
        entry = self.root / key
        t0 = time.perf_counter()
        with _locked(self.root / f"{key}.lock"):
            out = _read(entry)
            self.waited_s = time.perf_counter() - t0
            if out is None:
                shutil.rmtree(entry, ignore_errors=True)  # what a process that died computing it left
                entry.mkdir()
                result = compute(entry)
                tmp = entry / f"{RESULT}.tmp"
                tmp.write_text(json.dumps(result))
                os.replace(tmp, entry / RESULT)
                _seal(entry)
                out = _read(entry)
                if out is None:
                    raise OSError(f"shelf entry {entry} cannot be read back after it was written")
        return out

    def check(self, key: str) -> None:
        """ShelfEntryChanged when the entry `key` differs from what was computed (a test done with it wrote
        into it); nothing when it is as sealed, or no longer on the shelf."""
        entry = self.root / key
        with _locked(self.root / f"{key}.lock"):
            try:
                sealed = json.loads((entry / SEAL).read_text())
            except FileNotFoundError:
                return
            _unchanged(entry, sealed)

    def drop(self, tag: str) -> int:
        """Remove the entries tagged `tag` (each under its lock: none is removed while it is computed); the
        bytes freed. Whoever asks for one again computes it again."""
        freed = 0
        for entry in list(self.root.iterdir()):
            if _TAG.format(tag) not in entry.name or not entry.is_dir():
                continue
            with _locked(self.root / f"{entry.name}.lock"):
                freed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                shutil.rmtree(entry, ignore_errors=True)
        return freed

    def size(self) -> int:
        """Bytes the shelf holds now."""
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
