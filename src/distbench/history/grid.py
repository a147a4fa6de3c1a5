"""The nightly asv grid's workload (benchmarks/bench_training.py runs it), here so that `distbench history`
can name the configuration of an asv series, which asv's results do not keep, in the bisect it proposes."""

from __future__ import annotations

import os
from typing import Any


def asv_workload(gpus: int) -> dict[str, Any]:
    """With GPUs, DISTBENCH_ASV_MODEL (default gpt2-large) in bf16-amp (one precision regime for every
    strategy, docs/measurement.md) at micro-batch 8, its global batch for the
    largest world size the grid runs (1, 2, 4, 8 up to `gpus`); without, gpt2-tiny in fp32 on gloo, small
    enough for `asv run --quick`. Five timed windows: each one is a sample of asv's statistics."""
    if gpus:
        return {
            "model": os.environ.get("DISTBENCH_ASV_MODEL", "gpt2-large"),
            "precision": "bf16-amp",
            "micro_batch": 8,
            "global_batch": 8 * max(n for n in (1, 2, 4, 8) if n <= gpus),
            "steps": 20,
            "warmup": 5,
            "windows": 5,
        }
    return {
        "model": "gpt2-tiny",
        "precision": "fp32",
        "micro_batch": 2,
        "global_batch": 8,
        "steps": 5,
        "warmup": 2,
        "windows": 5,
    }
