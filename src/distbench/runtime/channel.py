"""Length-prefixed messages over pipes between the pool and its ranks, bounded on the pool's side.

A rank that dies or freezes half-way through a message must not block the pool in a read: the pool reads
only what select() says is there, keeps a partial message in a buffer, and takes end-of-file for the death
of the writer. Each pipe has one writer (one rank, or the pool), so a writer killed mid-message cannot
corrupt or lock anyone else's channel, as it could on a multiprocessing.Queue shared by all ranks. Messages
are pickled: both ends are processes of the same run, and nothing here is read from disk.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20


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
                view = view[os.write(fd, view[:_CHUNK]) :]  # chunked: the rank's byte counter shows progress
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
            out.append(pickle.loads(self._buf[_HEADER.size : _HEADER.size + n]))
            del self._buf[: _HEADER.size + n]
        return out

    def read_text(self) -> str:
        """Whatever the pipe holds now, unframed: faulthandler writes plain text."""
        self._fill()
        out, self._buf = self._buf.decode(errors="replace"), bytearray()
        return out
