"""Python's garbage collector during timed steps: keep it out by default, and measure it either way.

FSDP2 and DeepSpeed create many short-lived Python objects per step, so the collector's generation-2 passes
(which walk every tracked object of a multi-GB model's process) land in random steps. On 4x H200 their
steps varied 5-11% while DDP's (whose gradient sync lives in C++) stayed within 1%. Like torchtitan and
pytest-benchmark's --benchmark-disable-gc, the timed window runs with the collector off, after one full
collection and a freeze (so nothing old is re-scanned); `RunConfig.gc_during_steps` turns it back on to
show what it costs. Either way GcWatch records every collection in the window and its time, per step.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcWatch:
    """Collections (count, seconds, per generation) between start() and stop(), split by step()."""

    def __init__(self, keep_collector: bool) -> None:
        self.keep_collector = keep_collector
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self.step_seconds: list[float] = []
        self._step = 0.0
        self._t0 = 0.0
        self._on = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.counts[info["generation"]] += 1
        self.seconds += dt
        self._step += dt

    def start(self) -> GcWatch:
        gc.collect()
        if not self.keep_collector:
            gc.freeze()
            gc.disable()
        gc.callbacks.append(self._callback)
        self._on = True
        return self

    def step(self) -> None:
        """Close the current step's tally."""
        self.step_seconds.append(self._step)
        self._step = 0.0

    def stop(self) -> dict[str, Any]:
        if self._on:
            gc.callbacks.remove(self._callback)
            if not self.keep_collector:
                gc.enable()
                gc.unfreeze()
            self._on = False
        return {"collector_on": self.keep_collector, "collections": list(self.counts),
                "seconds": self.seconds, "step_seconds": list(self.step_seconds)}
