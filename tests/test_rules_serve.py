"""Rules of a variant's server in an A/B comparison (gate/serve.py, the protocol its module doc states): which
request does what with which configuration, pool and timeout, what a failed request replies and leaves
behind, and the lines it writes on its pipes. A fake rank pool and a fake run stand in for training: no
ranks, no processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import distbench
from distbench import matrix
from distbench.gate import numerics, serve
from distbench.runtime import pool as pool_module
from distbench.runtime.pool import JobError, RankOutcome

CFG = {"strategy": "ddp", "world_size": 2, "model": "gpt2-tiny"}


class Pools:
    """A PoolManager's face: one named pool per world size, and what was asked of it."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.closed = 0

    def pool_for(self, world_size: int) -> str:
        self.asked.append(world_size)
        return f"pool-{world_size}"

    def close_all(self) -> None:
        self.closed += 1


class Stepped:
    """A SteppedRun's face: records its calls; `setup_fails`/`window_fails` make those pieces fail."""

    made: list[Stepped] = []
    setup_fails = False
    window_fails = False

    def __init__(self, pool: str, cfg: Any, timeout: float) -> None:
        self.pool, self.cfg, self.timeout = pool, cfg, timeout
        self.calls: list[Any] = []
        Stepped.made.append(self)

    def setup(self) -> dict[str, Any] | None:
        self.calls.append("setup")
        return {"status": "error", "error": "setup failed"} if self.setup_fails else None

    def window(self, steps: int) -> float | dict[str, Any]:
        self.calls.append(("window", steps))
        return {"status": "error", "error": "window failed"} if self.window_fails else 0.25 * steps

    def finish(self) -> dict[str, Any]:
        self.calls.append("finish")
        return {"status": "ok", "result": "whole"}


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """matrix's runs and numerics' curve replaced by recorders: what each was called with."""
    seen: dict[str, list[Any]] = {"run": [], "curve": []}

    def run_benchmark(pool: str, cfg: Any, timeout: float) -> dict[str, Any]:
        seen["run"].append((pool, cfg, timeout))
        if cfg.steps == 13:
            raise JobError("train", cfg.world_size, [RankOutcome(0, "error", "ValueError", "boom")], "rank 0")
        return {"status": "ok", "ran": cfg.strategy, "log": Path("/runs") / cfg.strategy}

    def run_curve(pool: str, cfg: Any, timeout: float, resume_at: int | None) -> dict[str, Any]:
        seen["curve"].append((pool, cfg, timeout, resume_at))
        return {"status": "ok", "curve": {"loss": [1.0]}}

    Stepped.made, Stepped.setup_fails, Stepped.window_fails = [], False, False
    monkeypatch.setattr(matrix, "run_benchmark", run_benchmark)
    monkeypatch.setattr(matrix, "SteppedRun", Stepped)
    monkeypatch.setattr(numerics, "run_curve", run_curve)
    return seen


def test_a_whole_run_takes_its_configurations_pool_and_timeout(fakes: dict[str, list[Any]]) -> None:
    """{"cfg", "timeout"} (protocol 1, no "op") runs cfg in the pool of its world size under that timeout; a
    request without a timeout gets 1800 s."""
    pools = Pools()
    server = serve.Server(pools)
    assert server.handle({"cfg": CFG, "timeout": 60})["ran"] == "ddp"
    assert (
        server.handle({"op": "run", "cfg": {**CFG, "world_size": 1, "strategy": "single"}})["ran"] == "single"
    )
    (pool, cfg, timeout), (pool1, cfg1, timeout1) = fakes["run"]
    assert (pool, cfg.world_size, cfg.model, timeout) == ("pool-2", 2, "gpt2-tiny", 60.0)
    assert (pool1, cfg1.world_size, timeout1) == ("pool-1", 1, 1800.0)
    assert pools.asked == [2, 1]


def test_a_run_that_fails_in_its_ranks_replies_with_its_failure_result(fakes: dict[str, list[Any]]) -> None:
    """A JobError is the configuration's result, not the server's error: status "error" with every rank's
    outcome (results.failure_result), for the variant's device."""
    reply = serve.Server(Pools()).handle({"cfg": {**CFG, "steps": 13}, "timeout": 5})
    assert reply["status"] == "error" and reply["config"]["device"] == "cpu"
    assert reply["config"]["steps"] == 13 and "ValueError" in json.dumps(reply)


def test_a_run_in_pieces_sets_up_times_windows_and_finishes(fakes: dict[str, list[Any]]) -> None:
    """setup builds the run in its pool under the request's timeout (reply ok), each window times the steps
    asked for (reply ok and the wall per step), finish gives the run's result and ends the run. A window or
    finish before any setup, or after the finish, is refused naming what to send first."""
    server = serve.Server(Pools())
    early = server.handle({"op": "window", "steps": 1, "timeout": 30})
    assert early["error"].startswith("RuntimeError: 'window' without a run set up: send setup first")
    assert server.handle({"op": "setup", "cfg": CFG, "timeout": 90}) == {"status": "ok"}
    (run,) = Stepped.made
    assert (run.pool, run.cfg.world_size, run.timeout) == ("pool-2", 2, 90.0)
    assert server.handle({"op": "window", "steps": "3", "timeout": 30}) == {"status": "ok", "step_s": 0.75}
    assert server.handle({"op": "window", "steps": 2, "timeout": 30}) == {"status": "ok", "step_s": 0.5}
    assert server.handle({"op": "finish", "timeout": 30}) == {"status": "ok", "result": "whole"}
    assert run.calls == ["setup", ("window", 3), ("window", 2), "finish"] and server.stepped is None
    after = server.handle({"op": "window", "steps": 1, "timeout": 30})
    assert after["status"] == "error" and after["error"].startswith(
        "RuntimeError: 'window' without a run set up: send setup first"
    )


@pytest.mark.parametrize("piece", ["setup", "window"])
def test_a_piece_that_fails_replies_its_failure_and_ends_the_run(
    fakes: dict[str, list[Any]], piece: str
) -> None:
    """A failed setup or window replies with the failure result and leaves no run set up: the next window or
    finish is refused until a new setup."""
    setattr(Stepped, f"{piece}_fails", True)
    server = serve.Server(Pools())
    reply = server.handle({"op": "setup", "cfg": CFG, "timeout": 90})
    if piece == "window":
        assert reply == {"status": "ok"}
        reply = server.handle({"op": "window", "steps": 2, "timeout": 30})
    assert reply == {"status": "error", "error": f"{piece} failed"}
    assert server.stepped is None
    finish = server.handle({"op": "finish", "timeout": 30})
    assert finish["status"] == "error" and "'finish' without a run set up" in finish["error"]


def test_any_other_failure_is_an_error_reply_naming_it_and_ends_the_run(fakes: dict[str, list[Any]]) -> None:
    """An exception while handling (an unknown op, a configuration this variant cannot take) is the reply
    {"status": "error", "error": "Type: message" and the traceback}; the server stays up, the run in pieces it
    was in the middle of ends."""
    server = serve.Server(Pools())
    assert server.handle({"op": "setup", "cfg": CFG, "timeout": 90}) == {"status": "ok"}
    reply = server.handle({"op": "rewind", "timeout": 5})
    assert reply["status"] == "error" and reply["error"].startswith("ValueError: unknown request 'rewind'\n")
    assert "Traceback (most recent call last)" in reply["error"] and server.stepped is None


def test_a_numerics_request_trains_its_curve_resumed_where_asked(fakes: dict[str, list[Any]]) -> None:
    """{"op": "numerics"} trains cfg in its world size's pool with the variant's own distbench, under the
    request's timeout, resumed at "resume_at" when given (protocol 4), straight through when not."""
    server = serve.Server(Pools())
    assert server.handle({"op": "numerics", "cfg": CFG, "timeout": 40, "resume_at": 3})["curve"] == {
        "loss": [1.0]
    }
    server.handle({"op": "numerics", "cfg": {**CFG, "world_size": 1, "strategy": "single"}})
    (pool, cfg, timeout, resume_at), (pool1, _, timeout1, resume1) = fakes["curve"]
    assert (pool, cfg.world_size, timeout, resume_at) == ("pool-2", 2, 40.0, 3)
    assert (pool1, timeout1, resume1) == ("pool-1", 1800.0, None)
    assert fakes["run"] == []


def test_the_server_announces_itself_then_answers_each_request_on_its_pipes(
    fakes: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """main(): the descriptors DISTBENCH_AB_FDS names ("read,write"), rank pools for DISTBENCH_AB_DEVICE (None
    where unset or empty: the pool chooses), a first line {"ready", "protocol", "python", "distbench"}, then
    one JSON line per request in order; {"recycle": true} closes the pools and ends a run in pieces. The
    pools are closed when the requests end."""
    made: list[Any] = []

    class Manager(Pools):
        def __init__(self, device_type: str | None = None) -> None:
            super().__init__()
            self.device = device_type
            made.append(self)

    monkeypatch.setattr(pool_module, "PoolManager", Manager)
    requests = [
        {"op": "setup", "cfg": CFG, "timeout": 9},
        {"recycle": True},
        {"op": "finish", "timeout": 9},
        {"cfg": CFG, "timeout": 9},
    ]
    for device, expect in (("", None), ("cpu", "cpu")):
        to_server, from_test = os.pipe()
        from_server, to_test = os.pipe()
        with os.fdopen(from_test, "w") as w:
            w.write("".join(json.dumps(r) + "\n" for r in requests))
        monkeypatch.setenv(serve.FDS_ENV, f"{to_server},{to_test}")
        monkeypatch.setenv("DISTBENCH_AB_DEVICE", device)
        assert serve.main() == 0
        with os.fdopen(from_server) as r:
            hello, *replies = (json.loads(line) for line in r)
        assert hello == {
            "ready": True,
            "protocol": serve.PROTOCOL,
            "python": sys.executable,
            "distbench": str(Path(distbench.__file__).parent),  # the package the variant imports
        }
        assert replies[:2] == [{"status": "ok"}, {"recycled": True}]
        assert replies[2]["status"] == "error" and "'finish' without a run set up" in replies[2]["error"]
        assert replies[3] == {"status": "ok", "ran": "ddp", "log": "/runs/ddp"} and len(replies) == 4
        assert made[-1].device == expect and made[-1].closed == 2  # the recycle, then the end
