"""Which optimizer implementation a run gets: fused where it can run over the strategy's parameters.

`--optimizer auto` resolves to fused on GPUs; torch's fused SGD has no DTensor (FSDP2) support (torch 2.11
raised NotImplementedError for aten._fused_sgd_ in FSDP2's SGD parity on an H200), so there auto falls back
to foreach and an explicit `--optimizer fused` is refused with the reason before any step runs.
"""

from __future__ import annotations

import pytest

from rank_jobs import optimizer_over_dtensors


@pytest.mark.parametrize(
    ("algorithm", "optimizer", "expected"),
    [
        ("adamw", "auto", "fused"),
        ("sgd", "auto", "foreach"),
        ("sgd", "foreach", "foreach"),
        ("sgd", "fused", "ConfigError: --optimizer fused cannot run here: torch's fused SGD has no DTensor"),
    ],
)
def test_auto_picks_fused_only_where_it_runs_over_dtensors(suite, algorithm, optimizer, expected):
    got = suite.run_job(1, optimizer_over_dtensors, algorithm=algorithm, optimizer=optimizer)[0]
    assert got.startswith(expected), got
