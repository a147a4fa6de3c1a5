"""Library chatter is silenced where it starts, and nothing beside it: `distbench run` prints its own lines."""

from __future__ import annotations

import warnings
from types import SimpleNamespace


def test_deepspeed_chatter_goes_and_nothing_else(capsys):
    """DeepSpeed's "built successfully" line (once per rank) and torch's FutureWarnings for the collectives
    DeepSpeed calls are dropped; the build's other output and every other warning stay."""
    from distbench.strategies.deepspeed import quiet_deepspeed

    def build_shm_op() -> str:
        print("ninja: compiling shm op")
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        return "op"

    comm_torch = SimpleNamespace(build_shm_op=build_shm_op)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_deepspeed(comm_torch)
        quiet_deepspeed(comm_torch)  # a rank builds engines again and again: wrapped once
        assert comm_torch.build_shm_op() == "op"
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced"):
            warnings.warn(
                f"`torch.distributed.{name}` is deprecated. Please use ...", FutureWarning, stacklevel=1
            )
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", UserWarning, stacklevel=1)
    assert capsys.readouterr().out == "ninja: compiling shm op\n"
    assert [(w.category, str(w.message).split("`")[1]) for w in caught] == [
        (FutureWarning, "torch.distributed.all_reduce_coalesced"),
        (UserWarning, "torch.distributed.all_gather_into_tensor"),
    ]
