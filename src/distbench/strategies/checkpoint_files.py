"""What makes a checkpoint directory safe to load: a manifest of digests, and loads that run no code.

Corruption: at save, once every rank has written, rank 0 records the sha256 of every file in
`distbench_manifest.json`; at load every rank checks every file against it before anything reads them, so
flipped bytes in a shard are a CheckpointError naming the file, not a resumed run whose losses differ.

Hostile files: a manifest can be rewritten along with the files, so it is no defence against them. Every
pickle distbench or a library reads from a checkpoint directory is read without running code from it:
torch.load with weights_only=True (forced for DeepSpeed's and DCP's own torch.load calls, which pass
weights_only=False, with DeepSpeed's few stored classes allow-listed), and DCP's `.metadata`, a plain pickle,
through an unpickler that resolves names only from a fixed table of plain data types (DCP's metadata records,
torch.Size, dtypes, layouts) and sets state only on the records it has just built. tests/test_allowlists.py
pins both allow-lists to that property.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointError

MANIFEST = "distbench_manifest.json"
_VERSION = 1
_CHUNK = 1 << 22


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: str | os.PathLike[str]) -> None:
    """Record the sha256 of every file under `path` (rank 0, once every rank's files are written)."""
    root = Path(path)
    manifest = {"version": _VERSION, "files": {name: _digest(root / name) for name in _files(root)}}
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, root / MANIFEST)


def verify_manifest(path: str | os.PathLike[str]) -> None:
    """CheckpointError naming the file unless every file under `path` is exactly what the manifest records."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is missing")
    mpath = root / MANIFEST
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        files = manifest["files"]
        if (
            manifest.get("version") != _VERSION
            or not isinstance(files, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        ):
            raise ValueError("unexpected layout")
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {root} has no {MANIFEST}: it was not saved completely by distbench; re-save it"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint manifest {mpath} is malformed ({type(e).__name__}: {e}); re-save the checkpoint"
        ) from None
    present = set(_files(root))
    for name in sorted(set(files) - present):
        raise CheckpointError(
            f"checkpoint file {root / name} is missing (listed in {MANIFEST}); re-save the checkpoint"
        )
    for name in sorted(present - set(files)):
        raise CheckpointError(
            f"checkpoint file {root / name} is not in {MANIFEST}: added after the save; "
            "remove it or re-save the checkpoint"
        )
    for name, want in sorted(files.items()):
        if _digest(root / name) != want:
            raise CheckpointError(
                f"checkpoint file {root / name} does not match its sha256 in {MANIFEST} "
                "(corrupted or modified after the save); re-save the checkpoint"
            )


def _deepspeed_globals() -> list[Any]:
    """The classes DeepSpeed 0.19 pickles into its optimizer shards besides tensors and containers (fp16's
    dynamic loss scaler under precision fp16)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside runs with weights_only=True, even where a library passes weights_only=False
    (DeepSpeed's engine, zero_to_fp32 and universal conversion; DCP's non-tensor items), and a file it refuses
    is a CheckpointError naming the file. The environment switch also covers a `load` bound before entry."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    old_env, real_load = os.environ.get(key), torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint file {f} holds objects a weights-only load refuses ({first}); "
                "it was not written by distbench's save: re-save the checkpoint"
            ) from None

    os.environ[key] = "1"
    torch.load = load
    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            yield
    finally:
        torch.load = real_load
        if old_env is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old_env


#: torch's layouts by the name torch pickles them under (torch.serialization._get_layout's table).
_LAYOUTS: dict[str, torch.layout] = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """The layout named `name`, nothing else: DCP metadata names layouts through a call to
    torch.serialization._get_layout, which this stands in for."""
    try:
        return _LAYOUTS[name]
    except (KeyError, TypeError):
        raise pickle.UnpicklingError(f"{name!r} is not one of torch's layouts") from None


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP `.metadata` pickle may name, as a fixed table: DCP's metadata dataclasses and its
    memory-format enum, the filesystem layer's _StorageInfo records, torch.Size, PosixPath (a checkpoint id),
    each of torch's dtypes by its name, and the layout lookup. Nothing is resolved by attribute access, so no
    name read from the file reaches anything else in torch or any other module."""
    from pathlib import PosixPath

    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("pathlib", "PosixPath"): PosixPath,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed.update({("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only the names of _metadata_globals, and sets state (BUILD) only on the records of DCP's
    dataclasses it has just created: never on a class, a function, an enum member or any other object that
    existed before the load, whose change would outlive it (a class attribute, a lookup's cache).

    Python's own unpickler, as the C one cannot refuse one opcode: 0.4 s instead of 0.14 s for the 1.7 MB
    metadata of a 1300-tensor checkpoint sharded 8 ways."""

    allowed = _metadata_globals()
    stateful = frozenset(v for v in allowed.values() if isinstance(v, type) and dataclasses.is_dataclass(v))
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata") from None

    def load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]  # under the state, on the pure-Python stack
        if type(target) not in self.stateful:
            raise pickle.UnpicklingError(
                f"DCP metadata sets state on a {type(target).__name__}: only new metadata records take state"
            )
        super().load_build()  # type: ignore[misc]  # the pure-Python unpickler's BUILD handler

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]  # a subclass of Unpickler's handler


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with `.metadata` read through _MetadataUnpickler (DCP itself uses pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (
            pickle.UnpicklingError,
            EOFError,
            OSError,
            ValueError,
            TypeError,
            AttributeError,
            LookupError,
        ) as e:
            raise CheckpointError(f"cannot read DCP metadata {path}: {type(e).__name__}: {e}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"DCP metadata {path} holds a {type(metadata).__name__}, not Metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
