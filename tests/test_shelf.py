"""The session's shelf (runtime/shelf.py): a run computed once for every process of a session, read back
exactly, removed by strategy when its tests are done, computed again when damaged, and refused once a user
wrote into it."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from distbench.runtime.shelf import (
    TENSORS,
    Shelf,
    ShelfEntryChanged,
    entry_key,
    load_tensors,
    save_tensors,
)


def test_tensors_round_trip_exactly_tied_weights_included(tmp_path: Path):
    w = torch.randn(8, 4)
    groups = {"params": {"wte": w, "lm_head": w, "b": torch.arange(3.0)}, "grads": {"wte": -w}}
    save_tensors(tmp_path / TENSORS, groups)
    back = load_tensors(tmp_path / TENSORS)
    assert back.keys() == groups.keys()
    for g, tensors in groups.items():
        assert all(torch.equal(back[g][n], t) for n, t in tensors.items())


def _compute_slowly(root: str, log: str) -> None:
    def compute(entry: Path) -> dict:
        with open(log, "a") as f:
            f.write("computed\n")
        time.sleep(0.5)
        save_tensors(entry / TENSORS, {"params": {"w": torch.ones(2)}})
        return {"losses": [1.0, 0.5]}

    out = Shelf(root).get("run-x", compute)
    assert out["losses"] == [1.0, 0.5] and torch.equal(out["params"]["w"], torch.ones(2))


@pytest.mark.slow  # processes racing for one entry (~6 s on 2 cores)
def test_an_entry_is_computed_once_whoever_asks_at_the_same_time(tmp_path: Path):
    log = tmp_path / "log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_compute_slowly, args=(str(tmp_path / "shelf"), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert log.read_text().splitlines() == ["computed"]


def test_a_reader_knows_how_long_it_waited_for_another_to_compute(tmp_path: Path):
    """The wait shows in the phase table (SHARED): a lane idle on a shared run is time the lanes lose."""
    import threading

    shelf, started = Shelf(tmp_path), threading.Event()

    def compute(entry: Path) -> dict:
        started.set()
        time.sleep(0.4)
        return {"losses": [1.0]}

    computing = threading.Thread(target=Shelf(tmp_path).get, args=("run-x", compute))
    computing.start()
    started.wait(10)
    assert shelf.get("run-x", compute)["losses"] == [1.0] and shelf.waited_s >= 0.3
    computing.join()


def test_drop_removes_one_strategys_entries_and_a_damaged_entry_is_computed_again(tmp_path: Path):
    shelf = Shelf(tmp_path)
    calls: list[str] = []

    def compute(entry: Path) -> dict:
        calls.append(entry.name)
        (entry / "checkpoint").mkdir()
        (entry / "checkpoint" / "shard").write_bytes(b"x" * 1000)
        return {"ok": True}

    keys = {s: entry_key("run-cuda", {"strategy": s}, tag=s) for s in ("ddp", "zero3")}
    ref = entry_key("reference-cuda", {"strategy": "single"})
    for k in (*keys.values(), ref):
        shelf.get(k, compute)
    assert shelf.drop("ddp") >= 1000
    assert not (tmp_path / keys["ddp"]).exists() and (tmp_path / keys["zero3"]).exists()
    assert (tmp_path / ref).exists()  # references carry no strategy's tag
    (tmp_path / keys["zero3"] / "result.json").write_text("{not json")
    assert shelf.get(keys["zero3"], compute) == {"ok": True} and calls.count(keys["zero3"]) == 2
    shelf.get(keys["ddp"], compute)
    assert calls.count(keys["ddp"]) == 2


def test_an_entry_a_user_wrote_into_is_refused_not_read(tmp_path: Path):
    """Entries are read-only to their users: a file added, rewritten or removed after the entry was computed
    (a resharding load converting a shared checkpoint in place) is named by check() and refused by the next
    get(), not handed to a test that happens to run later."""
    shelf = Shelf(tmp_path)

    def compute(entry: Path) -> dict:
        (entry / "checkpoint").mkdir()
        (entry / "checkpoint" / "manifest.json").write_text("{}")
        (entry / "checkpoint" / "shard").write_bytes(b"x" * 100)
        return {"ok": True}

    key = entry_key("run-cpu", {"strategy": "zero2"}, tag="zero2")
    ckpt = tmp_path / key / "checkpoint"
    changes = {
        "added checkpoint/global_step2_universal/shard": lambda: (
            (ckpt / "global_step2_universal").mkdir(),
            (ckpt / "global_step2_universal" / "shard").write_bytes(b"u"),
        ),
        "rewrote checkpoint/manifest.json": lambda: (ckpt / "manifest.json").write_text('{"files": {}}'),
        "removed checkpoint/shard": lambda: (ckpt / "shard").unlink(),
    }
    for what, change in changes.items():
        shelf.get(key, compute)
        shelf.check(key)  # as computed: nothing to say
        change()
        with pytest.raises(ShelfEntryChanged, match=what):
            shelf.check(key)
        with pytest.raises(ShelfEntryChanged, match="read-only"):
            shelf.get(key, compute)
        shelf.drop("zero2")
    shelf.check(key)  # dropped: nothing left to check
