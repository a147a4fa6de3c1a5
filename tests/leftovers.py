"""What a run can leave behind on the machine, found without trusting the code under test: processes that
carry a tag in their environment (every descendant inherits it, orphans included), paths named distbench*
under a private TMPDIR, and new /dev/shm entries that no live process holds."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Collection
from pathlib import Path

TAG_ENV = "DISTBENCH_LEFTOVER_TAG"
SHM = Path("/dev/shm")
#: multiprocessing's named semaphores: any Python process on a shared machine makes them and its resource
#: tracker reclaims them, so they cannot be told apart; the pool makes none (tests check its ranks hold none).
MP_SEM = "sem.mp-"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_processes(tag: str, keep: Collection[int] = ()) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries `tag` (zombies have none)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in keep or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found[int(d.name)] = (
                    (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
        except OSError:
            continue
    return found


def shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def held_shm(pids: Collection[int] | None = None) -> set[str]:
    """/dev/shm entries that live processes (`pids`, default all) map or have open."""
    held = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or (pids is not None and int(d.name) not in pids):
            continue
        try:
            held.update(
                ln.rsplit("/dev/shm/", 1)[1].strip()
                for ln in (d / "maps").read_text().splitlines()
                if "/dev/shm/" in ln
            )
            for fd in (d / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/") :])
        except OSError:
            continue
    return held


def leftovers(
    tag: str, tmpdir: Path, shm_before: set[str], keep: Collection[int] = ()
) -> dict[str, list[str]]:
    """Everything left behind, by kind; empty lists when clean."""
    return {
        "processes": [f"{pid}: {cmd}" for pid, cmd in tagged_processes(tag, keep).items()],
        "temp dirs": sorted(str(p) for p in tmpdir.rglob("distbench*")),
        "shared memory": sorted(
            e for e in (shm_entries() - shm_before) - held_shm() if not e.startswith(MP_SEM)
        ),
    }


def wait_clean(
    tag: str, tmpdir: Path, shm_before: set[str], keep: Collection[int] = (), within: float = 10.0
) -> dict[str, list[str]]:
    """Poll until nothing is left behind or `within` seconds passed; what is left at the end."""
    end = time.monotonic() + within
    while True:
        left = leftovers(tag, tmpdir, shm_before, keep)
        if not any(left.values()) or time.monotonic() > end:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.1)


def stop(*procs: subprocess.Popen, grace: float) -> None:
    """End processes the polite way, SIGTERM to all, so each stops what it started (torchrun its workers, which
    sit in sessions of their own: killing the agent alone leaves them running); SIGKILL only one still there
    after `grace` seconds."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
