"""FSDP2 on gloo at 2 ranks, AdamW(foreach=True) over 24 layers: per optimizer step, how many ops DTensor
propagates without its sharding cache, the step's host time, and the live Python objects, over 30 steps."""

import gc
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def worker(rank: int, ws: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    calls = [0]
    uncached = ShardingPropagator.propagate_op_sharding_non_cached

    def counting(self, op_schema):
        calls[0] += 1
        return uncached(self, op_schema)

    ShardingPropagator.propagate_op_sharding_non_cached = counting
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])
    mesh = init_device_mesh("cpu", (ws,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    rows, objs = [], []
    for step in range(30):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        c0, t0 = calls[0], time.perf_counter()
        opt.step()
        opt.zero_grad()
        rows.append((step, calls[0] - c0, (time.perf_counter() - t0) * 1e3))
        objs.append(len(gc.get_objects()))
    if rank == 0:
        print("torch", torch.__version__)
        for s, c, ms in rows:
            if s in (0, 1, 2, 5, 10, 20, 29):
                print(f"  step {s:2d}: non-cached propagations {c:4d}, optimizer step {ms:7.1f} ms")
        print("  live objects at steps 5, 10, 29:", objs[5], objs[10], objs[29])
        print("  mean step ms over 10-29:", round(sum(r[2] for r in rows[10:]) / 20, 1))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29500 + os.getpid() % 1000), nprocs=2)
