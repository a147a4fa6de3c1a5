"""Sharing a GPU changes no result: a run computed in a lane beside other lanes is bitwise the same run computed
alone. The witness runs in a lane and keeps its losses and final parameters on the session's shelf; the
exclusive test, alone at the end, runs the same configuration again and compares."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from distbench.jobs.train import train
from distbench.runtime.shelf import TENSORS, entry_key


def _witness_key(cfg: Any) -> str:
    return entry_key("witness", cfg.to_dict())


def _run(suite: Any, cfg: Any, path: Path) -> dict[str, Any]:
    out = suite.run_job(1, train, cfg=cfg, return_params=True, keep_tensors_at=str(path))[0]
    return {"losses": out["losses"]}


@pytest.mark.gpu
def test_a_run_beside_other_lanes(suite: Any) -> None:
    """In a lane: the tier's ddp run, kept with the lane it ran in."""
    cfg = suite.config("ddp", 1)

    def compute(entry: Path) -> dict[str, Any]:
        return {**_run(suite, cfg, entry / TENSORS), "lane": os.environ.get("DISTBENCH_LANE")}

    kept = suite.shelf.get(_witness_key(cfg), compute)
    assert kept["losses"][-1] < kept["losses"][0]


@pytest.mark.gpu
@pytest.mark.exclusive
def test_sharing_the_gpu_changes_no_result(suite: Any, tmp_path: Path) -> None:
    cfg = suite.config("ddp", 1)
    shared = suite.shelf.get(_witness_key(cfg), lambda entry: pytest.skip("the witness did not run"))
    if not shared.get("lane"):
        pytest.skip("this session ran no lanes: the witness did not share the GPU")
    alone = _run(suite, cfg, tmp_path / TENSORS)
    assert alone["losses"] == shared["losses"], (alone["losses"], shared["losses"])
    from distbench.runtime.shelf import load_tensors

    params = load_tensors(tmp_path / TENSORS)["params"]
    differ = [n for n, t in shared["params"].items() if not torch.equal(t, params[n])]
    assert not differ, f"{len(differ)} parameters differ after the same run alone, e.g. {differ[:3]}"
