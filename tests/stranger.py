"""A stranger on the network, run as a script: it finds a torchrun launch's store and writes one key there,
at once or (`after-post`) as soon as the launch has written that key itself, so that it replaces it.

torchrun's c10d rendezvous publishes where the workers' store listens (MASTER_ADDR, MASTER_PORT) in its own
store at the rendezvous endpoint, under the run id; neither store asks who writes (tests/test_cluster.py).

    python stranger.py HOST RDZV_PORT RUN_ID KEY PAYLOAD_FILE [now|after-post]
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def _connect(host: str, port: int, deadline: float) -> dist.TCPStore:
    while True:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=1))
        except RuntimeError:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main(
    host: str,
    rdzv_port: str,
    run_id: str,
    key: str,
    payload_file: str,
    when: str = "now",
    within_s: float = 120.0,
) -> None:
    deadline = time.monotonic() + within_s
    rendezvous = _connect(host, int(rdzv_port), deadline)
    published = [f"torch.rendezvous.{run_id}.{rnd}/MASTER_PORT" for rnd in range(3)]
    while not any(rendezvous.check([k]) for k in published):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no launch published its store under {run_id}")
        time.sleep(0.05)
    found = next(k for k in published if rendezvous.check([k]))
    addr = rendezvous.get(found.replace("MASTER_PORT", "MASTER_ADDR")).decode()
    store = _connect(addr, int(rendezvous.get(found).decode()), deadline)
    payload = Path(payload_file).read_bytes()
    while when == "after-post" and not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the launch never wrote {key}")
        time.sleep(0.0005)
    store.set(key, payload)
    print(f"stranger wrote {key} at {addr}:{rendezvous.get(found).decode()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
