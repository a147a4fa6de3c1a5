"""A free loopback port for launchers the tests start themselves (torchrun's rendezvous, Slurm's daemons),
which take a port number up front. The rank pool needs none: its store binds port 0 itself.

The port comes from below the kernel's ephemeral range. A port the kernel hands out for port 0 is free only
until the next process asks for one. In a CI run the Slurm test's rendezvous port, picked that way, was most
likely taken by srun's own listening socket: srun logged a connection it could not read
("eio_message_socket_accept ... timed out") from the port torchrun's store client used, and the client's 60 s
connect timeout failed the job."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: where to look when the kernel does not say: below Linux's default ephemeral range (32768-60999)
_LOW = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nobody listens on now, outside the range the kernel picks ports for other processes from."""
    high = _ephemeral_start()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_LOW, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{high - 1} after 200 tries")
