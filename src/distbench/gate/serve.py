"""One variant's side of an A/B comparison: a process that keeps its own rank pools and runs benchmark
configurations on request.

The A/B runner starts one of these per variant, with the variant's interpreter, code and environment, and
alternates requests between them. Requests and replies are JSON lines on two pipes whose descriptors the
runner passes in DISTBENCH_AB_FDS ("read,write"): stdout and stderr stay free for the ranks' own logs.
A request is {"cfg": RunConfig dict, "timeout": seconds}; the reply is the result (status "error" with every
rank's traceback when the configuration failed; the pool is rebuilt for the next request). Since protocol 2
(announced in the first line) a run also comes in pieces, so that the runner can interleave two variants'
timed windows (gate/ab.py): {"op": "setup", "cfg", "timeout"} builds and warms up (reply {"status": "ok"}),
{"op": "window", "steps", "timeout"} times steps (reply {"status": "ok", "step_s": wall per step}),
{"op": "finish", "timeout"} gives the run's result; a piece that fails replies with the failure result and
ends the run. Since protocol 3, {"op": "numerics", "cfg", "timeout"} trains cfg with this variant's own
distbench and replies {"status": "ok", "curve": {"loss": [...], "grad_norm": [...]}} (gate/numerics.py); since
protocol 4 with "resume_at": k, it saves after step k and trains the rest resumed from that checkpoint.
{"recycle": true}
closes the rank pools, so the next request runs in fresh rank processes: a process keeps a bias of its own
(host-bound steps spread 6-8% between processes on 2x H200), and fresh ones turn that bias into noise
the paired statistics see, instead of a difference between the variants.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

FDS_ENV = "DISTBENCH_AB_FDS"
#: 1: whole runs; 2: runs in pieces (setup, window, finish) too; 3: numerics runs too; 4: numerics with a resume
PROTOCOL = 4


class Server:
    """The variant's rank pools and the run in pieces it is in the middle of, if any."""

    def __init__(self, pools: Any) -> None:
        self.pools = pools
        self.stepped: Any = None  # matrix.SteppedRun between "setup" and "finish"

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's reply; any failure is a result too (the runner ends that configuration), so the
        server stays up for the other configurations."""
        import traceback

        try:
            return self._handle(request)
        except Exception as e:  # noqa: BLE001 - e.g. a variant whose code cannot take this configuration
            self.stepped = None
            return {"status": "error", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        from ..config import RunConfig
        from ..matrix import SteppedRun, run_benchmark
        from ..results import failure_result
        from ..runtime.pool import JobError

        op, timeout = request.get("op", "run"), float(request.get("timeout", 1800))
        if op == "numerics":
            from .numerics import run_curve

            cfg = RunConfig.from_dict(request["cfg"])
            resume_at = request.get("resume_at")
            return run_curve(self.pools.pool_for(cfg.world_size), cfg, timeout, resume_at)
        if op in ("run", "setup"):
            cfg = RunConfig.from_dict(request["cfg"])
            pool = self.pools.pool_for(cfg.world_size)
            if op == "setup":
                self.stepped = SteppedRun(pool, cfg, timeout)
                failed = self.stepped.setup()
                if failed is not None:
                    self.stepped = None
                return failed or {"status": "ok"}
            try:
                return run_benchmark(pool, cfg, timeout=timeout)
            except JobError as e:
                return failure_result(cfg, self.pools.device_type, e)
        if self.stepped is None:
            raise RuntimeError(f"{op!r} without a run set up: send setup first")
        if op == "window":
            got = self.stepped.window(int(request["steps"]))
            if isinstance(got, dict):
                self.stepped = None
                return got
            return {"status": "ok", "step_s": got}
        if op == "finish":
            stepped, self.stepped = self.stepped, None
            return stepped.finish()
        raise ValueError(f"unknown request {op!r}")


def main() -> int:
    from ..runtime.pool import PoolManager

    read_fd, write_fd = (int(x) for x in os.environ[FDS_ENV].split(","))
    pools = PoolManager(os.environ.get("DISTBENCH_AB_DEVICE") or None)
    server = Server(pools)
    with os.fdopen(read_fd, "r") as requests, os.fdopen(write_fd, "w") as replies:
        replies.write(
            json.dumps(
                {
                    "ready": True,
                    "protocol": PROTOCOL,
                    "python": sys.executable,
                    "distbench": os.path.dirname(os.path.dirname(__file__)),
                }
            )
            + "\n"
        )
        replies.flush()
        try:
            for line in requests:
                request = json.loads(line)
                if request.get("recycle"):
                    server.stepped = None
                    pools.close_all()
                    result = {"recycled": True}
                else:
                    result = server.handle(request)
                replies.write(json.dumps(result, default=str) + "\n")
                replies.flush()
        finally:
            pools.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
