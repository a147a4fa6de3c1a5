"""FSDP2 (fully_shard) on gloo at 2 ranks: the sharded gradients' norms against a single-process reference's,
and all_reduce / reduce_scatter_tensor with ReduceOp.AVG on gloo (each rank sends rank + 1: the mean is 1.5)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def collectives(rank: int, ws: int) -> dict:
    out: dict = {}
    t = torch.full((2 * ws,), float(rank + 1))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["all_reduce"] = t.tolist()
    except RuntimeError as e:
        out["all_reduce"] = f"RuntimeError: {str(e).splitlines()[0][:100]}"
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.full((2 * ws,), float(rank + 1)), op=dist.ReduceOp.AVG)
    out["reduce_scatter_tensor"] = o.tolist()
    return out


def worker(rank: int, ws: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = collectives(rank, ws)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
        torch.manual_seed(1)
        x = torch.randn(ws * 3, 4)
        model(x[rank * 3 : (rank + 1) * 3]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()  # the mean over all samples: the average of the ranks' means
        out["fsdp2 grad norm / reference"] = [
            round((p.grad.full_tensor().norm() / q.grad.norm()).item(), 4)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        ]
    except Exception as e:  # noqa: BLE001 - reported, as 2.6.0's FSDP2 cannot run on CPU
        out["fsdp2"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    if rank == 0:
        print("torch", torch.__version__, "from", torch.__file__)
        for k, v in out.items():
            print(f"  {k}: {v}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29500 + os.getpid() % 1000), nprocs=2)
