"""The pipes between the pool and its ranks: tensors cross as their bytes and arrive equal, whatever their
dtype, shape or layout; framed messages survive being read a piece at a time."""

from __future__ import annotations

import os
import select

import pytest
import torch

from distbench.runtime.channel import MessageReader, encode, read_message, widen_pipe, write_message


def roundtrip(obj):
    """obj through a real pipe and back, as a message."""
    r, w = os.pipe()
    widen_pipe(r)
    try:
        assert write_message(w, obj)
        os.close(w)
        w = -1
        return read_message(r)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


TENSORS = {
    "bf16": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "empty": torch.empty(0, 7),
    "bool": torch.tensor([True, False, True]),
    "int64": torch.arange(-3, 3),
    "transposed": torch.arange(6.0).reshape(2, 3).t(),  # not contiguous
    "conjugate": torch.tensor([1 + 2j, 3 - 4j]).conj(),  # a lazy conjugate view
    "fp16": torch.tensor([1.5, -2.0], dtype=torch.float16),
}


@pytest.mark.parametrize("name", TENSORS)
def test_tensors_cross_as_equal_tensors(name: str) -> None:
    sent = TENSORS[name]
    got = roundtrip({"t": sent, "other": [1, "x"]})
    assert got["other"] == [1, "x"]
    assert got["t"].dtype == sent.dtype and got["t"].shape == sent.shape
    assert torch.equal(got["t"], sent.resolve_conj()), (got["t"], sent)


def test_tensors_cross_out_of_band() -> None:
    """The fast path is taken: the tensor's bytes travel beside the stream, not through torch's pickling,
    and arrive over the received bytes themselves."""
    stream, *buffers = encode(torch.ones(4)).parts
    assert b"_load_from_bytes" not in bytes(stream) and b"_tensor_from_buffer" in bytes(stream)
    assert [b.nbytes for b in buffers] == [16]


def test_tensors_arrive_aligned() -> None:
    """Rebuilt over the received bytes, yet aligned as torch's own allocations are, whatever precedes them."""
    got = roundtrip({"odd": "x" * 13, "a": torch.ones(3, dtype=torch.float64), "b": torch.ones(5)})
    assert got["a"].data_ptr() % 16 == 0 and got["b"].data_ptr() % 16 == 0


def test_tensors_that_need_their_own_reduction_keep_it() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    assert isinstance(roundtrip(p), torch.nn.Parameter)
    grad = torch.ones(2, requires_grad=True)
    assert roundtrip(grad).requires_grad


def test_an_encoded_result_inside_a_message_arrives_decoded() -> None:
    """A rank's reply carries its result already encoded; the pool receives the result itself."""
    reply = (7, 0, "ok", None, encode({"w": torch.arange(5.0)}))
    got = roundtrip(reply)
    assert got[:4] == (7, 0, "ok", None) and torch.equal(got[4]["w"], torch.arange(5.0))


def test_a_large_message_read_a_piece_at_a_time() -> None:
    """A reply bigger than the pipe arrives whole through pump() calls that each take what is there."""
    r, w = os.pipe()
    widen_pipe(r)
    big = {"w": torch.arange(3 * 2**20, dtype=torch.float32)}  # 12 MiB: many pipefuls
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(r)
        write_message(w, ("reply", big))
        os._exit(0)
    os.close(w)

    class Conn:
        def fileno(self) -> int:
            return r

    reader = MessageReader(Conn())  # type: ignore[arg-type]
    got: list = []
    while not got and not reader.eof:
        select.select([r], [], [], 5)
        got += reader.pump()
    os.waitpid(pid, 0)
    os.close(r)
    assert len(got) == 1 and got[0][0] == "reply" and torch.equal(got[0][1]["w"], big["w"])
