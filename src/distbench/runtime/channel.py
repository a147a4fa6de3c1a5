"""Length-prefixed messages over pipes between the pool and its ranks, bounded on the pool's side.

A rank that dies or freezes half-way through a message must not block the pool in a read: the pool reads
only what select() says is there, keeps a partial message in a buffer, and takes end-of-file for the death
of the writer. Each pipe has one writer (one rank, or the pool), so a writer killed mid-message cannot
corrupt or lock anyone else's channel, as it could on a multiprocessing.Queue shared by all ranks. Messages
are pickled: both ends are processes of the same run.

Large tensors do not go through the pipes: a job's result of full parameters and gradients is a gigabyte at
GPT-2 124M, and pickling it through a pipe cost the GPU tier a quarter of its job time. `dumps` writes each
tensor's raw bytes to a file in the pool's spill directory (memory-backed /dev/shm where it has room) and
pickles only its name, dtype and shape; `loads` reads the bytes back and removes the file. The pool removes
the directory when it closes, so files of an abandoned reply do not outlive it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import select
import shutil
import struct
import sys
import tempfile
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20
#: Tensors of at least this many bytes travel through spill files (small ones: pickling is cheaper).
SPILL_MIN_BYTES = 64 << 10
#: /dev/shm is used for spill files only with at least this much free space, else the system temp dir.
_SHM_MIN_FREE = 8 << 30


def spill_root() -> str:
    """Where spill directories go: /dev/shm when it has room (no disk writes), else the temp dir."""
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= _SHM_MIN_FREE:
            return shm
    except OSError:
        pass
    return tempfile.gettempdir()


class _SpillPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, spill_dir: str) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.spill_dir = spill_dir
        self.torch = sys.modules.get("torch")  # no torch imported: no tensors to spill

    def persistent_id(self, obj: Any) -> Any:
        torch = self.torch
        if torch is None or type(obj) is not torch.Tensor or obj.nbytes < SPILL_MIN_BYTES:
            return None
        t = obj.detach().to("cpu").contiguous()
        path = os.path.join(self.spill_dir, uuid.uuid4().hex)
        try:
            with open(path, "wb") as f:
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        except OSError:  # no room: this tensor goes through the pipe
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return None
        return ("tensor", path, str(t.dtype).removeprefix("torch."), tuple(t.shape))


class _SpillUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        import torch

        kind, path, dtype, shape = pid
        if kind != "tensor" or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise pickle.UnpicklingError(f"unknown spilled object {pid!r}")
        try:
            raw = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return raw.view(getattr(torch, dtype)).reshape(shape)


def dumps(obj: Any, spill_dir: str | None) -> bytes:
    """Pickle `obj`, large tensors to files in `spill_dir` (None: everything inline)."""
    if spill_dir is None:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = io.BytesIO()
    _SpillPickler(buf, spill_dir).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """The inverse of `dumps`: spilled tensors are read back and their files removed."""
    return _SpillUnpickler(io.BytesIO(data)).load()


def write_message(fd: int, obj: Any, deadline: float | None = None) -> bool:
    """Write one message; blocking when `deadline` is None (ranks), else bounded (the pool, on a
    non-blocking fd). False when the reader is gone or the deadline passed first."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    for part in (_HEADER.pack(len(data)), data):
        view = memoryview(part)
        while view:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [fd], [], left)[1]:
                    return False
            try:
                view = view[os.write(fd, view[:_CHUNK]):]  # chunked: the rank's byte counter shows progress
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return False
    return True


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(_CHUNK, n - len(buf)))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_message(fd: int) -> Any | None:
    """Block until one whole message arrives (ranks); None when the writer closed its end or died."""
    head = _read_exact(fd, _HEADER.size)
    body = None if head is None else _read_exact(fd, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


class MessageReader:
    """The pool's end of one rank's pipe: `pump()` takes what is there without blocking."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.eof = False
        self._buf = bytearray()

    def _fill(self) -> None:
        while not self.eof:
            try:
                chunk = os.read(self.fd, _CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
            self._buf += chunk

    def pump(self) -> list[Any]:
        """Read what the pipe holds now; return the messages it completed (a partial one stays buffered)."""
        self._fill()
        out = []
        while len(self._buf) >= _HEADER.size:
            n = _HEADER.unpack_from(self._buf)[0]
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(pickle.loads(self._buf[_HEADER.size:_HEADER.size + n]))
            del self._buf[:_HEADER.size + n]
        return out

    def read_text(self) -> str:
        """Whatever the pipe holds now, unframed: faulthandler writes plain text."""
        self._fill()
        out, self._buf = self._buf.decode(errors="replace"), bytearray()
        return out
