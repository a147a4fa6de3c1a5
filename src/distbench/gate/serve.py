"""One variant's side of an A/B comparison: a process that keeps its own rank pools and runs benchmark
configurations on request.

The A/B runner starts one of these per variant, with the variant's interpreter, code and environment, and
alternates requests between them. Requests and replies are JSON lines on two pipes whose descriptors the
runner passes in DISTBENCH_AB_FDS ("read,write"): stdout and stderr stay free for the ranks' own logs.
A request is {"cfg": RunConfig dict, "timeout": seconds}; the reply is the result (status "error" with every
rank's traceback when the configuration failed; the pool is rebuilt for the next request). {"recycle": true}
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


def handle(pools: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One benchmark run's result; any failure is a result too (the runner ends that configuration), so the
    server stays up for the other configurations."""
    import traceback

    from ..config import RunConfig
    from ..matrix import run_benchmark
    from ..results import failure_result
    from ..runtime.pool import JobError

    try:
        cfg = RunConfig.from_dict(request["cfg"])
        return run_benchmark(pools.pool_for(cfg.world_size), cfg, timeout=float(request["timeout"]))
    except JobError as e:
        return failure_result(cfg, pools.device_type, e)
    except Exception as e:  # noqa: BLE001 - e.g. a variant whose code cannot take this configuration
        return {"status": "error", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def main() -> int:
    from ..runtime.pool import PoolManager

    read_fd, write_fd = (int(x) for x in os.environ[FDS_ENV].split(","))
    pools = PoolManager(os.environ.get("DISTBENCH_AB_DEVICE") or None)
    with os.fdopen(read_fd, "r") as requests, os.fdopen(write_fd, "w") as replies:
        replies.write(
            json.dumps(
                {
                    "ready": True,
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
                    pools.close_all()
                    result = {"recycled": True}
                else:
                    result = handle(pools, request)
                replies.write(json.dumps(result, default=str) + "\n")
                replies.flush()
        finally:
            pools.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
