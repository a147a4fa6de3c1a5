"""Where do the harness-fidelity rounds' spread come from? The same harness-against-bare-loop rounds
(jobs/fidelity.py), one round at a time, three ways on one device:

* process: the pair built in this process, rounds back to back (on one H200: 0.1-0.2% log-ratio spread at
  GPT-2 medium, micro-batch 16);
* pool: the pair kept in a rank of a RankPool, one job per round, as the GPU tier's claim runs it (about 5%
  in the tier's exclusive phase);
* pool+watch: the same with the session's NVML watch (lane_watch.GpuWatch) polling beside it, GPUs only.

    python scripts/fidelity_noise.py [--device cuda] [--model gpt2-355m] [--micro-batch 16] [--rounds 12]

Prints each way's median bare-loop seconds and the standard deviation of ln(harness / bare) over the rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable

from distbench.config import RunConfig
from distbench.jobs.fidelity import Fidelity, fidelity_finish, fidelity_rounds, fidelity_setup
from distbench.measure.roundparts import explain
from distbench.runtime.context import RankContext
from distbench.runtime.pool import RankPool
from distbench.testsuite.lane_watch import GpuWatch

Round = dict[str, float]


def spread(rounds: list[Round]) -> str:
    logs = [math.log(r["harness_s"] / r["bare_s"]) for r in rounds]
    bare = statistics.median(r["bare_s"] for r in rounds)
    return (
        f"bare {bare * 1e3:8.1f} ms   ln(harness/bare) mean {statistics.fmean(logs):+.3%} "
        f"sd {statistics.stdev(logs):.3%}\n    {explain(rounds, ('bare', 'harness'))}"
    )


def in_process(cfg: RunConfig, device_type: str, n: int) -> list[Round]:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29655", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = device_type == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        pair = Fidelity.build(
            RankContext(0, 1, 0, device, "nccl" if cuda else "gloo"), cfg, steps=1, warmup=3
        )
        try:
            return [pair.rounds(1)[0] for _ in range(n)]
        finally:
            pair.close()
    finally:
        dist.destroy_process_group()


def in_pool(cfg: RunConfig, device_type: str, n: int, watch: bool) -> list[Round]:
    gpus = GpuWatch().start() if watch else None
    pool = RankPool(1, device_type)
    try:
        pool.run(fidelity_setup, {"cfg": cfg, "steps": 1, "warmup": 3}, 600)
        try:
            return [pool.run(fidelity_rounds, {"rounds": 1}, 600)[0]["rounds"][0] for _ in range(n)]
        finally:
            pool.run(fidelity_finish, {}, 600)
    finally:
        pool.close()
        if gpus is not None:
            gpus.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="gpt2-355m")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--strategy", default="single")
    ap.add_argument("--ways", default="pool,process,pool+watch", help="comma-separated, of those above")
    ap.add_argument("--each", action="store_true", help="also print every round's ln(harness / bare)")
    a = ap.parse_args()
    cfg = RunConfig(
        strategy=a.strategy,
        model=a.model,
        precision="bf16" if a.device == "cuda" else "fp32",
        micro_batch=a.micro_batch,
        global_batch=2 * a.micro_batch,
        seq_len=1024 if a.device == "cuda" else 0,
        steps=1,
        deterministic=False,
    )
    ways: dict[str, Callable[[], list[Round]]] = {
        "pool": lambda: in_pool(cfg, a.device, a.rounds, watch=False),
        "process": lambda: in_process(cfg, a.device, a.rounds),
    }
    if a.device == "cuda":
        ways["pool+watch"] = lambda: in_pool(cfg, a.device, a.rounds, watch=True)
    for name in a.ways.split(","):
        if name not in ways:
            continue
        rounds = ways[name]()
        print(f"{name:<11} {a.strategy} {a.model} mb{a.micro_batch}: {spread(rounds)}", flush=True)
        if a.each:
            print(
                "    each round: "
                + " ".join(f"{math.log(r['harness_s'] / r['bare_s']):+.2%}" for r in rounds)
            )


if __name__ == "__main__":
    main()
