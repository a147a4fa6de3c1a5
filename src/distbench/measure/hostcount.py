"""Instructions and cycles the training thread retires in user space, from the CPU's performance counters.

Why: a host-bound step (the GPU idles between launches) is as long as the Python, dispatcher and launch work
that issues it, and that work's wall time is noisy: on 2x H200, GPT-2 124M at micro-batch 1 spread +-8%
between processes, and the training thread's CPU time did not reliably rise with a planted 4 ms busy loop
(CUDA calls that spin while they wait count as CPU time too). The number of instructions the thread retires in user
mode for one step is a property of the code path, not of the clock, the cache or the neighbours, so it is
the candidate quiet figure for host-side work; cycles in user mode are recorded beside it.

The counters come from perf_event_open(2) on the calling thread (no inheritance: the pool's other threads
and NCCL's proxy are not counted), user mode only, read as one group per step (one read(2), about a
microsecond). Where the kernel or a virtual machine offers no hardware counters (ENOENT), or forbids them
(perf_event_paranoid, a seccomp filter), `open_counters` says why and the figures are left out: a result
never carries a counter it could not read. Software events (the thread's task clock) go through the same
code, which is how the CPU tier checks it on machines without a PMU.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass

#: perf_event_open's syscall number per architecture (asm/unistd.h).
_SYSCALL = {"x86_64": 298, "aarch64": 241, "ppc64le": 319, "s390x": 331}
_ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7; the kernel takes any size it knows, zero-filled beyond its own

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
#: name -> (type, config): the figures a step records. Hardware: instructions and cycles (user mode only).
HARDWARE = {"instructions": (PERF_TYPE_HARDWARE, 1), "cycles": (PERF_TYPE_HARDWARE, 0)}
#: the thread's CPU clock in nanoseconds, a software event every Linux kernel has
SOFTWARE = {"task_clock_ns": (PERF_TYPE_SOFTWARE, 1)}

_FORMAT_TOTAL_TIME_ENABLED, _FORMAT_TOTAL_TIME_RUNNING, _FORMAT_GROUP = 1, 2, 8
_EXCLUDE_KERNEL, _EXCLUDE_HV = 1 << 5, 1 << 6

_WHY = {
    errno.ENOENT: "this CPU or virtual machine exposes no such hardware counter (no PMU)",
    errno.EOPNOTSUPP: "this CPU or virtual machine exposes no such hardware counter (no PMU)",
    errno.ENODEV: "this CPU or virtual machine exposes no such hardware counter (no PMU)",
    errno.EACCES: "forbidden: lower kernel.perf_event_paranoid to 2 or grant CAP_PERFMON",
    errno.EPERM: "forbidden (perf_event_paranoid, or a container's seccomp filter): lower "
    "kernel.perf_event_paranoid to 2 or grant CAP_PERFMON",
    errno.ENOSYS: "the kernel has no perf_event_open",
}


class CountersUnavailable(OSError):
    """The counters cannot be opened on this machine; str() says why and what would allow them."""


@dataclass
class ThreadCounters:
    """A group of counters of the thread that opened it; `read()` gives their running totals."""

    names: tuple[str, ...]
    fds: tuple[int, ...]
    multiplexed: bool = False  # some read was scaled: the PMU was shared and the group did not always run

    def read(self) -> tuple[int, ...]:
        """Running totals, in the order of `names`, of this thread since the group was opened."""
        n = len(self.names)
        raw = os.read(self.fds[0], 8 * (3 + n))
        nr, enabled, running, *values = struct.unpack(f"{3 + n}Q", raw)
        if nr != n:
            raise OSError(f"perf group read {nr} counters, expected {n}")
        if running < enabled:
            self.multiplexed = True
        return tuple(values)

    def close(self) -> None:
        for fd in reversed(self.fds):
            os.close(fd)
        self.fds = ()


def _open_one(libc: ctypes.CDLL, number: int, type_: int, config: int, group_fd: int) -> int:
    attr = bytearray(_ATTR_SIZE)
    struct.pack_into("IIQ", attr, 0, type_, _ATTR_SIZE, config)
    read_format = _FORMAT_GROUP | _FORMAT_TOTAL_TIME_ENABLED | _FORMAT_TOTAL_TIME_RUNNING
    struct.pack_into("QQ", attr, 32, read_format, _EXCLUDE_KERNEL | _EXCLUDE_HV)
    buf = (ctypes.c_char * _ATTR_SIZE).from_buffer(attr)
    # pid 0, cpu -1: this thread (Linux counts per thread; no `inherit`), on whatever CPU it runs
    fd = libc.syscall(number, buf, 0, -1, group_fd, 0)
    if fd < 0:
        err = ctypes.get_errno()
        raise CountersUnavailable(err, f"perf_event_open: {_WHY.get(err, os.strerror(err))}")
    return int(fd)


def open_counters(events: dict[str, tuple[int, int]] | None = None) -> ThreadCounters:
    """Open `events` (default HARDWARE) as one group counting this thread in user mode from now on;
    CountersUnavailable, saying why, where the machine does not allow it."""
    events = HARDWARE if events is None else events
    number = _SYSCALL.get(platform.machine())
    if os.name != "posix" or number is None:
        raise CountersUnavailable(
            errno.ENOSYS, f"no perf_event_open on {platform.system()} {platform.machine()}"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    fds: list[int] = []
    try:
        for type_, config in events.values():
            fds.append(_open_one(libc, number, type_, config, fds[0] if fds else -1))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return ThreadCounters(tuple(events), tuple(fds))


def try_open_counters(
    events: dict[str, tuple[int, int]] | None = None,
) -> tuple[ThreadCounters | None, str | None]:
    """(counters, None), or (None, why not): for callers that measure what they can."""
    try:
        return open_counters(events), None
    except CountersUnavailable as e:
        return None, str(e.strerror)
