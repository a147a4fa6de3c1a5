"""Size a host-side plant: the share of the step's period it must spin for the step to slow by a target.

    PYTHONPATH=REV1/src python scripts/plant_size.py OUT [--strategy fsdp_full] [--target 0.03] ...

Host work that overlaps device work already queued slows nothing, so a plant's share of the step's period is
not its slowdown (in fsdp_full on one H200, a 3% share slowed the step by about 0.7%). This measures the
slowdown of several shares in one process, one rank: after the warm-up, rounds of timed windows (the nights'
windows: 2 steps, the training thread pinned to one core), one window per share in each round, the shares'
order rotated from round to round so each takes each place equally often; the plant's share is set in the
rank between windows (scripts/plants/host-forward.patch and host-step-3pct.patch read DISTBENCH_PLANT_SHARE at
every step). A share's slowdown is the trimmed mean of its windows' log ratios to the same round's window at
share 0, with its 95% interval (gate/stats, the estimator `ab` decides pairs with); the share for the target
is interpolated between the two shares that bracket it. Writes OUT/plant-size.json, OUT/plant-share (the
share alone, for the script's later nights) and OUT/plant-period-s (the step's period without the plant, from
windows before the rounds: host-forward spins its share of it), prints a table last. Exit 0 when a share was
found, 1 when no share tried reached the target, 2 when the distbench on PYTHONPATH has no plant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

SHARE_ENV, PERIOD_ENV = "DISTBENCH_PLANT_SHARE", "DISTBENCH_PLANT_PERIOD_S"
#: The functions the plants that read SHARE_ENV at every step add to strategies/base.py (scripts/plants/);
#: host-forward's also reads PERIOD_ENV (host-step-3pct learns the period itself).
PLANTS = ("_planted_block_spin", "_planted_step_spin")


def set_plant(ctx: Any, share: float, period_s: float) -> None:
    """Job: the plant's share of the period in this rank from the next step on."""
    os.environ[SHARE_ENV], os.environ[PERIOD_ENV] = repr(share), repr(period_s)


def slowdown(logs: list[float]) -> tuple[float, float, float]:
    """A share's slowdown with its 95% interval: the project's paired estimator (gate/stats, as `ab` decides
    its pairs: a trimmed mean of the log ratios, so that a window that caught a hiccup does not move it)."""
    import numpy as np

    from distbench.gate.stats import trimmed_log_ratio_effect

    e = trimmed_log_ratio_effect(np.asarray(logs), 0.05)
    return e.estimate, e.low, e.high


def share_for(shares: list[float], slowdowns: list[float], target: float) -> float | None:
    """The share whose slowdown is `target`, linearly between the two tried shares that bracket it (the
    slowdowns made non-decreasing first: more spin cannot make a step faster); None if none reaches it."""
    import numpy as np

    s = np.maximum.accumulate(np.asarray(slowdowns, dtype=float))
    if s[-1] < target:
        return None
    return float(np.interp(target, s, shares))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--strategy", "-s", default="fsdp_full")
    p.add_argument("--model", "-m", default="gpt2-124m")
    p.add_argument("--precision", default="bf16-amp")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument(
        "--period-windows", type=int, default=10, help="windows without the plant that set its period"
    )
    p.add_argument("--shares", default="0,0.03,0.06,0.09,0.12", help="comma-separated, 0 first")
    p.add_argument("--target", type=float, default=0.03)
    p.add_argument("--device", choices=["cpu", "cuda"])
    # a night's workload flags (scripts/relative_nightly_gpu.sh's CONFIG) pass through: one rank, and the
    # night's windows are this script's rounds
    p.add_argument("--world-size", "-n", type=int, choices=[1], default=1)
    p.add_argument("--steps", "--windows", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    shares = [float(x) for x in a.shares.split(",")]
    if shares[0] != 0 or sorted(shares) != shares or len(set(shares)) != len(shares):
        p.error(f"--shares must start at 0 and increase, got {a.shares}")

    from distbench.strategies import base

    if not any(hasattr(base, name) for name in PLANTS):
        print(
            f"error: the distbench at {base.__file__} has no plant (apply scripts/plants/host-forward.patch "
            "or host-step-3pct.patch)"
        )
        return 2
    from distbench.config import RunConfig
    from distbench.jobs.bench import bench_finish, bench_setup, bench_window
    from distbench.runtime.pool import PoolManager, cuda_device_count

    os.environ.setdefault("DISTBENCH_BIND_CPUS", "pinned")  # as a night's runs
    job = importlib.import_module(Path(__file__).stem).set_plant  # a name the rank can import
    device = a.device or ("cuda" if cuda_device_count() else "cpu")
    cfg = RunConfig(
        strategy=a.strategy,
        world_size=1,
        model=a.model,
        precision=a.precision,
        micro_batch=a.micro_batch,
        global_batch=a.micro_batch,
        steps=a.window_steps,
        windows=1,
        warmup=a.warmup,
        deterministic=False,
    )
    pools = PoolManager(device)
    pool = pools.pool_for(1)
    walls: list[list[float]] = []  # per round, per share: seconds per step
    try:
        pool.run(job, {"share": 0.0, "period_s": 0.0}, 600)
        pool.run(bench_setup, {"cfg": cfg, "nvml": False}, 600)
        # the step's period without the plant, on this host, after the warm-up: the median window's
        period = sorted(
            w["wall_s"] / w["steps"]
            for _ in range(a.period_windows)
            for w in pool.run(bench_window, {"steps": a.window_steps}, 600)
        )[a.period_windows // 2]
        for r in range(a.rounds + 1):  # round 0 settles the plant's period estimate: not kept
            order = [(i + r) % len(shares) for i in range(len(shares))]
            row = [0.0] * len(shares)
            for i in order:
                pool.run(job, {"share": shares[i], "period_s": period}, 60)
                (w,) = pool.run(bench_window, {"steps": a.window_steps}, 600)
                row[i] = w["wall_s"] / w["steps"]
            if r:
                walls.append(row)
        pool.run(bench_finish, {}, 600)
    finally:
        pools.close_all()

    stats = [slowdown([math.log(w[i] / w[0]) for w in walls]) for i in range(len(shares))]
    chosen = share_for(shares, [s[0] for s in stats], a.target)
    step_ms = 1000 * sorted(w[0] for w in walls)[len(walls) // 2]
    a.out.mkdir(parents=True, exist_ok=True)
    record = {
        "strategy": a.strategy,
        "model": a.model,
        "precision": a.precision,
        "micro_batch": a.micro_batch,
        "device": device,
        "rounds": a.rounds,
        "window_steps": a.window_steps,
        "step_ms_at_share_0": step_ms,
        "period_s": period,
        "target": a.target,
        "shares": shares,
        "slowdown": [s[0] for s in stats],
        "interval_95": [[s[1], s[2]] for s in stats],
        "share": chosen,
    }
    (a.out / "plant-size.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"{a.strategy} ws1 {a.model} {a.precision} mb{a.micro_batch} on {device}: {a.rounds} rounds of "
        f"{len(shares)} windows of {a.window_steps} steps; step {step_ms:.2f} ms at share 0"
    )
    print("| share | slowdown | 95% interval |")
    print("|---|---|---|")
    for share, (m, lo, hi) in zip(shares[1:], stats[1:], strict=True):
        print(f"| {share:.3f} | {m:+.2%} | [{lo:+.2%}, {hi:+.2%}] |")
    if chosen is None:
        print(f"no share tried slowed the step by {a.target:.1%}: try larger --shares")
        return 1
    (a.out / "plant-share").write_text(f"{chosen:.4f}\n")
    (a.out / "plant-period-s").write_text(f"{period:.6f}\n")
    print(f"share for a {a.target:.1%} slowdown: {chosen:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
