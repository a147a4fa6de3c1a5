"""Length-prefixed messages over pipes between the pool and its ranks, bounded on the pool's side.

A rank that dies or freezes half-way through a message must not block the pool in a read: the pool reads
only what select() says is there, keeps a partial message in a buffer, and takes end-of-file for the death
of the writer. Each pipe has one writer (one rank, or the pool), so a writer killed mid-message cannot
corrupt or lock anyone else's channel, as it could on a multiprocessing.Queue shared by all ranks. Messages
are pickled: both ends are processes of the same run, and nothing here is read from disk.

Tensors travel as their raw bytes, out of band (see `encode`): torch's own pickling writes each storage through
torch.save into a buffer and reads it back through torch.load. Parity jobs send parameters and gradients
back; a 512 MiB result from a CPU-tier rank took 5.0 s that way and 0.6 s this way (median of 3).
"""

from __future__ import annotations

import fcntl
import io
import os
import pickle
import select
import struct
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20


#: Pipe capacity asked for (Linux's default is 64 KiB; unprivileged processes may raise it to
#: /proc/sys/fs/pipe-max-size, 1 MiB by default): a large reply crosses in 16x fewer wake-ups.
_PIPE_BYTES = 1 << 20


def widen_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe buffer; where the system refuses, the default works, only slower."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except OSError:
        pass


def _tensor_from_buffer(data: memoryview, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


class Encoded:
    """An object already pickled for the pipe (`encode`): its stream and its tensors' raw buffers. A rank
    encodes its result inside the job's own error handling (a result that cannot be pickled is the job's
    error), and the parts then go into the reply as they are: copied neither again on the way out nor on
    the way in, where the result is rebuilt over the received bytes."""

    def __init__(self, parts: list[memoryview]) -> None:
        self.parts = parts


def _decoded(*parts: memoryview) -> Any:
    return pickle.loads(parts[0], buffers=parts[1:])


class _Pickler(pickle.Pickler):
    """Plain host tensors by their bytes, out of band; everything else as pickle does it. Aliasing between
    tensors is not kept (every tensor arrives with storage of its own), which results never rely on."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is Encoded:
            return _decoded, tuple(pickle.PickleBuffer(p) for p in obj.parts)
        torch = sys.modules.get("torch")  # a process that never imported torch has no tensors to send
        if torch is None or type(obj) is not torch.Tensor or obj.requires_grad:
            return NotImplemented
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized:
            return NotImplemented
        flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        dtype = str(obj.dtype).removeprefix("torch.")
        return _tensor_from_buffer, (pickle.PickleBuffer(flat.numpy()), dtype, tuple(obj.shape))


def encode(obj: Any) -> Encoded:
    """Pickle `obj` for the other end of a pipe: the stream, then each tensor's raw bytes, uncopied."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return Encoded([out.getbuffer(), *(b.raw() for b in buffers)])


#: Each part of a frame starts at a multiple of this within the body, so a tensor rebuilt over the received
#: bytes is as aligned as one torch allocates for itself (vectorized kernels and device copies expect it).
_ALIGN = 64


def _padding(at: int) -> int:
    return -at % _ALIGN


def _frame(obj: Any) -> list[memoryview]:
    """A message's frame: its length, its parts' count and lengths, then the parts, each aligned."""
    parts = encode(obj).parts
    table = struct.pack(f"!Q{len(parts)}Q", len(parts), *(p.nbytes for p in parts))
    out, at = [memoryview(table)], len(table)
    for part in parts:
        if pad := _padding(at):
            out.append(memoryview(bytes(pad)))
            at += pad
        out.append(part)
        at += part.nbytes
    return [memoryview(_HEADER.pack(at)), *out]


def _unframe(body: bytearray) -> Any:
    """The object a frame's body holds, rebuilt over the body's own bytes."""
    (n,) = _HEADER.unpack_from(body)
    lengths = struct.unpack_from(f"!{n}Q", body, _HEADER.size)
    view, at = memoryview(body), _HEADER.size * (n + 1)
    parts = []
    for length in lengths:
        at += _padding(at)
        parts.append(view[at : at + length])
        at += length
    return _decoded(*parts)


def write_message(fd: int, obj: Any, deadline: float | None = None) -> bool:
    """Write one message; blocking when `deadline` is None (ranks), else bounded (the pool, on a
    non-blocking fd). False when the reader is gone or the deadline passed first."""
    for part in _frame(obj):
        view = part.cast("B")
        while view:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [fd], [], left)[1]:
                    return False
            try:
                view = view[os.write(fd, view[:_CHUNK]) :]  # chunked: the rank's byte counter shows progress
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return False
    return True


def _read_exact(fd: int, n: int) -> bytearray | None:
    """n bytes from a blocking fd, read straight into their final buffer; None at end of file first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if not k:
            return None
        got += k
    return buf


def read_message(fd: int) -> Any | None:
    """Block until one whole message arrives (ranks); None when the writer closed its end or died."""
    head = _read_exact(fd, _HEADER.size)
    body = None if head is None else _read_exact(fd, _HEADER.unpack(head)[0])
    return None if body is None else _unframe(body)


class MessageReader:
    """The pool's end of one rank's pipe: `pump()` takes what is there without blocking.

    A message's body is read into a buffer of its announced size: appending a 600 MiB reply to a growing
    buffer re-copied it at every resize and held its transfer to ~200 MB/s on a CPU-tier core."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.eof = False
        self._head = bytearray()
        self._body: bytearray | None = None
        self._got = 0

    def _read(self, into: memoryview) -> int:
        """Bytes read into `into` (0 when the pipe is empty now); sets eof when the writer is gone."""
        try:
            k = os.readv(self.fd, [into])
        except BlockingIOError:
            return 0
        if not k:
            self.eof = True
        return k

    def pump(self) -> list[Any]:
        """Read what the pipe holds now; return the messages it completed (a partial one stays buffered)."""
        out = []
        while not self.eof:
            if self._body is None:
                head = bytearray(_HEADER.size - len(self._head))
                k = self._read(memoryview(head))
                self._head += head[:k]
                if len(self._head) < _HEADER.size:
                    break
                self._body, self._got, self._head = bytearray(_HEADER.unpack(self._head)[0]), 0, bytearray()
            if self._got < len(self._body):
                k = self._read(memoryview(self._body)[self._got :])
                self._got += k
                if self._got < len(self._body):
                    break
            out.append(_unframe(self._body))
            self._body = None
        return out

    def read_text(self) -> str:
        """Whatever the pipe holds now, unframed: faulthandler writes plain text."""
        out = bytearray()
        while not self.eof:
            chunk = bytearray(_CHUNK)
            k = self._read(memoryview(chunk))
            if not k:
                break
            out += chunk[:k]
        return out.decode(errors="replace")
