"""Rules of what makes a checkpoint directory loadable (distbench.strategies.checkpoint_files), one test each,
each with its expectation written out by hand: the manifest records every file's sha256 and nothing else,
verification names the one thing wrong in words a user can act on, and the DCP metadata reader reads what
DCP's own reader reads, through a table of exactly the names DCP writes."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path, PosixPath

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from distbench.errors import CheckpointError
from distbench.strategies import checkpoint_files
from distbench.strategies.checkpoint_files import (
    MANIFEST,
    SafeFileSystemReader,
    verify_manifest,
    write_manifest,
)
from hostile_pickles import Build, Glob, assemble

META = "torch.distributed.checkpoint.metadata"
SHARD, NESTED = b"\x00\x01shard bytes" * 100, b"optimizer state"


def saved(root: Path) -> Path:
    """A checkpoint of two files, one in a subdirectory, and its manifest."""
    (root / "ckpt" / "opt").mkdir(parents=True)
    (root / "ckpt" / "model.pt").write_bytes(SHARD)
    (root / "ckpt" / "opt" / "rank0.pt").write_bytes(NESTED)
    write_manifest(root / "ckpt")
    return root / "ckpt"


def test_the_manifest_records_the_sha256_of_every_file_below_the_directory_and_not_itself(tmp_path):
    """Sorted, one-space-indented JSON (the same files always write the same bytes), in place of a temporary
    file that does not stay behind; written again, it still lists the files, not itself."""
    ckpt = saved(tmp_path)
    model, opt = hashlib.sha256(SHARD).hexdigest(), hashlib.sha256(NESTED).hexdigest()
    assert (ckpt / MANIFEST).read_text() == (
        f'{{\n "files": {{\n  "model.pt": "{model}",\n  "opt/rank0.pt": "{opt}"\n }},\n "version": 1\n}}'
    )
    write_manifest(ckpt)
    assert json.loads((ckpt / MANIFEST).read_text())["files"] == {"model.pt": model, "opt/rank0.pt": opt}
    assert sorted(p.name for p in ckpt.iterdir()) == [MANIFEST, "model.pt", "opt"]


def test_a_checkpoint_whose_files_are_as_saved_verifies(tmp_path):
    assert verify_manifest(saved(tmp_path)) is None
    assert verify_manifest(str(tmp_path / "ckpt")) is None


def test_a_missing_directory_or_manifest_is_refused_saying_so(tmp_path):
    with pytest.raises(CheckpointError) as refused:
        verify_manifest(tmp_path / "nowhere")
    assert str(refused.value) == f"checkpoint directory {tmp_path / 'nowhere'} is missing"
    ckpt = saved(tmp_path)
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as refused:
        verify_manifest(ckpt)
    assert str(refused.value) == (
        f"checkpoint {ckpt} has no {MANIFEST}: it was not saved completely by distbench; re-save it"
    )


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        ({"version": 2, "files": {}}, "ValueError: unexpected layout"),
        ({"files": {}}, "ValueError: unexpected layout"),
        ({"version": 1, "files": ["model.pt"]}, "ValueError: unexpected layout"),
        ({"version": 1, "files": {"model.pt": 1}}, "ValueError: unexpected layout"),
        ({"version": 1}, "KeyError: 'files'"),
        ([1], "TypeError: list indices must be integers or slices, not str"),
    ],
    ids=["another-version", "no-version", "files-a-list", "a-digest-not-text", "no-files", "not-an-object"],
)
def test_a_manifest_of_another_layout_is_malformed_and_says_why(manifest, why, tmp_path):
    ckpt = saved(tmp_path)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as refused:
        verify_manifest(ckpt)
    assert (
        str(refused.value)
        == f"checkpoint manifest {ckpt / MANIFEST} is malformed ({why}); re-save the checkpoint"
    )


def test_a_manifest_that_is_not_utf8_json_is_malformed(tmp_path):
    ckpt = saved(tmp_path)
    (ckpt / MANIFEST).write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=r"is malformed \(UnicodeDecodeError: "):
        verify_manifest(ckpt)


def test_a_manifest_is_read_as_utf_8_whatever_the_locale(tmp_path, ascii_locale):
    """A manifest another tool wrote with a file name as UTF-8 (not escaped, as distbench's own writer does)
    verifies where the locale's own encoding is ASCII."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "caf\u00e9.pt").write_bytes(SHARD)
    files = {"caf\u00e9.pt": hashlib.sha256(SHARD).hexdigest()}
    (ckpt / MANIFEST).write_bytes(json.dumps({"version": 1, "files": files}, ensure_ascii=False).encode())
    assert verify_manifest(ckpt) is None


def test_a_file_listed_but_gone_is_refused_naming_it(tmp_path):
    ckpt = saved(tmp_path)
    (ckpt / "opt" / "rank0.pt").unlink()
    with pytest.raises(CheckpointError) as refused:
        verify_manifest(ckpt)
    assert str(refused.value) == (
        f"checkpoint file {ckpt / 'opt' / 'rank0.pt'} is missing (listed in {MANIFEST}); re-save the checkpoint"
    )


def test_a_file_added_after_the_save_is_refused_naming_it(tmp_path):
    ckpt = saved(tmp_path)
    (ckpt / "opt" / "extra.pt").write_bytes(b"planted")
    with pytest.raises(CheckpointError) as refused:
        verify_manifest(ckpt)
    assert str(refused.value) == (
        f"checkpoint file {ckpt / 'opt' / 'extra.pt'} is not in {MANIFEST}: added after the save; remove it or "
        "re-save the checkpoint"
    )


def test_a_file_of_other_bytes_is_refused_naming_it(tmp_path):
    """One byte flipped in the nested file, the other untouched: the nested one is named."""
    ckpt = saved(tmp_path)
    (ckpt / "opt" / "rank0.pt").write_bytes(b"Optimizer state")
    with pytest.raises(CheckpointError) as refused:
        verify_manifest(ckpt)
    assert str(refused.value) == (
        f"checkpoint file {ckpt / 'opt' / 'rank0.pt'} does not match its sha256 in {MANIFEST} (corrupted or "
        "modified after the save); re-save the checkpoint"
    )


def test_the_dcp_metadata_table_is_exactly_dcps_records_torch_size_a_path_the_layout_lookup_and_dtypes():
    """Each name a DCP `.metadata` pickle may resolve, and what it resolves to; every other entry a torch dtype
    under its own name in torch (all of them, those DCP writes among them). The unpickler uses this table."""
    table = checkpoint_files._metadata_globals()
    assert {k: v for k, v in table.items() if not isinstance(v, torch.dtype)} == {
        ("pathlib", "PosixPath"): PosixPath,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): checkpoint_files._layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        (META, "Metadata"): Metadata,
        (META, "MetadataIndex"): MetadataIndex,
        (META, "StorageMeta"): StorageMeta,
        (META, "TensorProperties"): TensorProperties,
        (META, "TensorStorageMetadata"): TensorStorageMetadata,
        (META, "BytesStorageMetadata"): BytesStorageMetadata,
        (META, "ChunkStorageMetadata"): ChunkStorageMetadata,
        (META, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    }
    dtypes = {k: v for k, v in table.items() if isinstance(v, torch.dtype)}
    assert all(module == "torch" and getattr(torch, name) is v for (module, name), v in dtypes.items())
    common = (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.uint8,
        torch.bool,
    )
    assert set(common) <= set(dtypes.values())
    assert dtypes[("torch", "float")] is torch.float32, "torch's aliases of a dtype resolve too"
    assert checkpoint_files._MetadataUnpickler.allowed == table


def _metadata(storage_meta: StorageMeta | None) -> Metadata:
    return Metadata(
        state_dict_metadata={"step": BytesStorageMetadata()},
        storage_data={MetadataIndex("step"): _StorageInfo(PosixPath("__0_0.distcp"), 0, 8)},
        storage_meta=storage_meta,
    )


@pytest.mark.parametrize("rank", [None, 1])
@pytest.mark.parametrize(
    "storage_meta", [StorageMeta(checkpoint_id=PosixPath("/ckpt")), None], ids=["meta", "none"]
)
def test_the_safe_reader_reads_what_dcps_own_reader_reads(rank, storage_meta, tmp_path):
    """The same file (`.metadata`, or a rank's own `__1.metadata` when DCP asks for a rank), the same records,
    and the same storage_meta: the saved one, or a new one, either way stamped with this reader's load_id."""
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    (tmp_path / name).write_bytes(pickle.dumps(_metadata(storage_meta)))
    kwargs = {} if rank is None else {"rank": rank}
    safe, plain = SafeFileSystemReader(str(tmp_path)), FileSystemReader(str(tmp_path))
    got, want = safe.read_metadata(**kwargs), plain.read_metadata(**kwargs)
    assert got.state_dict_metadata == want.state_dict_metadata and got.storage_data == want.storage_data
    assert got.storage_meta is not None and got.storage_meta.load_id == safe.load_id is not None
    expected = StorageMeta(checkpoint_id=PosixPath("/ckpt") if storage_meta else None, load_id=safe.load_id)
    assert got.storage_meta == expected


def _refusal(data: bytes, root: Path) -> str:
    root.mkdir()
    (root / ".metadata").write_bytes(data)
    with pytest.raises(CheckpointError) as refused:
        SafeFileSystemReader(str(root)).read_metadata()
    return str(refused.value)


def test_a_metadata_refusal_names_the_file_and_what_in_it_was_refused(tmp_path):
    at = tmp_path / "{}" / ".metadata"
    assert _refusal(assemble(Glob("os", "system"), 2), tmp_path / "global") == (
        f"cannot read DCP metadata {str(at).format('global')}: UnpicklingError: global os.system is not allowed "
        "in DCP metadata"
    )
    state = assemble(Build(Glob("torch.serialization", "_get_layout"), {"cache": {}}), 2)
    assert _refusal(state, tmp_path / "state") == (
        f"cannot read DCP metadata {str(at).format('state')}: UnpicklingError: DCP metadata sets state on a "
        "function: only new metadata records take state"
    )
    assert _refusal(pickle.dumps({"step": 1}, protocol=2), tmp_path / "dict") == (
        f"DCP metadata {str(at).format('dict')} holds a dict, not Metadata"
    )


def test_a_layout_is_looked_up_by_its_name_only():
    assert checkpoint_files._layout("torch.strided") is torch.strided
    assert checkpoint_files._layout("torch.sparse_coo") is torch.sparse_coo
    for name in ("torch.float32", "strided", 1):
        with pytest.raises(pickle.UnpicklingError) as refused:
            checkpoint_files._layout(name)  # type: ignore[arg-type]
        assert str(refused.value) == f"{name!r} is not one of torch's layouts"
