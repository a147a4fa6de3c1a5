"""fsdp_hybrid's device mesh, read from the trainer every rank builds, against the groups HSDP must have: each
shard group the consecutive ranks of one node (the all-gathers stay on the fast link), each replicate group one
rank of every node. Every rank of 4 and 8 is built in this process as a rank of torch's fake process group
(tests/fake_ranks.py): the mesh and the shards are what gloo ranks would build, in a fraction of the time (the
gloo runs of these meshes are the scale tier's parity tests).
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

import mutants
from distbench.config import RunConfig
from fake_ranks import trainer_at

#: (world size, replicate groups) -> the shard groups and the replicate groups, written out.
MESHES = {
    (4, 2): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (8, 2): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (8, 4): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
}


def assert_hybrid_mesh(ws: int, replicate: int) -> None:
    """Every rank's trainer puts it in its shard and replicate groups, and every parameter is replicated over
    the first mesh dimension and sharded on dim 0 over the second."""
    shard_groups, replicate_groups = MESHES[(ws, replicate)]
    cfg = RunConfig(
        strategy="fsdp_hybrid",
        world_size=ws,
        global_batch=ws,
        micro_batch=1,
        options={"replicate": replicate},
    )
    for rank in range(ws):
        with trainer_at(cfg, rank) as trainer:
            mesh = trainer.mesh
            assert (mesh.mesh_dim_names, tuple(mesh.shape)) == (
                ("replicate", "shard"),
                (replicate, ws // replicate),
            ), f"rank {rank}: mesh {mesh}"
            mine = [g for g in shard_groups if rank in g], [g for g in replicate_groups if rank in g]
            assert ([mesh["shard"].mesh.tolist()], [mesh["replicate"].mesh.tolist()]) == mine, (
                f"rank {rank} of {ws}: shard group {mesh['shard'].mesh.tolist()}, replicate group "
                f"{mesh['replicate'].mesh.tolist()}; HSDP needs {mine[0]} and {mine[1]}"
            )
            for name, p in trainer.model.named_parameters():
                assert p.device_mesh == mesh and p.placements == (Replicate(), Shard(0)), (name, p.placements)


@pytest.mark.parametrize("ws,replicate", list(MESHES), ids=[f"{r}x{ws // r}-ws{ws}" for ws, r in MESHES])
def test_hybrid_mesh_is_the_configured_shape(ws, replicate):
    assert_hybrid_mesh(ws, replicate)


@pytest.mark.parametrize("ws", [4, 8])
def test_the_mesh_check_catches_swapped_dimensions_at_8(ws):
    """(replicate, shard) built in the wrong order (mutants hybrid_dims_swapped) is the same 2 x 2 mesh at 4
    ranks, and 4 x 2 where 2 x 4 was asked for at 8."""
    with mutants.mutated("hybrid_dims_swapped"):
        if ws == 4:
            assert_hybrid_mesh(4, 2)
            return
        with pytest.raises(AssertionError, match="mesh"):
            assert_hybrid_mesh(8, 2)


def test_a_replicate_option_that_does_not_divide_the_world_is_refused():
    from distbench.errors import ConfigError
    from distbench.strategies import get_spec

    cfg = RunConfig(
        strategy="fsdp_hybrid", world_size=8, global_batch=8, micro_batch=1, options={"replicate": 3}
    )
    with pytest.raises(ConfigError, match="replicate=3 does not divide world size 8"):
        get_spec("fsdp_hybrid").check_config(cfg)
