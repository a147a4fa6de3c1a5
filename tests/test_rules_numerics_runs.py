"""The numerics comparison's rules around the verdict (gate/numerics.py): what a variant's server runs and replies
for one numerics request (run_curve, curve_job), what `distbench ab` asks each variant and when (ask_servers,
compare_variants, compare_servers), its flags, and what the report receives (the outcome's JSON, the tolerance
rule, the verdict's words). Every run here is a stand-in (no ranks), each expectation written out by hand."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from distbench.config import RunConfig
from distbench.gate import numerics as nm
from distbench.runtime.pool import JobError

RECIPE_NAMES = "default, accumulation, clipping, bf16-amp, fp16, activation-checkpointing, resume"


def _config(**kw: Any) -> RunConfig:
    return RunConfig(**{"strategy": "ddp", "world_size": 2, "micro_batch": 2, "global_batch": 4, **kw})


def curve(loss: list[float], norm: list[float]) -> nm.Curve:
    return nm.Curve(tuple(loss), tuple(norm))


# --- one numerics run, in a variant's server ----------------------------------------------------------------


class FakePool:
    """A pool whose jobs reply `replies` in turn (one list of per-rank replies per run), recording each run; a
    reply that is an exception is raised."""

    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)
        self.runs: list[tuple[Any, dict[str, Any], float, bool]] = []

    def run(self, job: Any, kwargs: dict[str, Any], timeout: float) -> Any:
        ckpt = kwargs.get("checkpoint_dir") or kwargs.get("resume_from")
        self.runs.append((job, kwargs, timeout, ckpt is not None and Path(ckpt).is_dir()))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def ranks(loss: list[float], norm: list[float], n: int = 2) -> list[dict[str, list[float]]]:
    return [{"loss": list(loss), "grad_norm": list(norm)} for _ in range(n)]


def test_a_numerics_run_replies_its_curve_and_the_versions_it_ran_with() -> None:
    """One run of the curve job with the configuration, under the request's timeout; the ranks' common curve,
    and the versions of what computed."""
    cfg = _config(steps=2)
    pool = FakePool(ranks([6.0, 5.0], [2.0, 1.0]))
    reply = nm.run_curve(pool, cfg, 30.0)
    assert reply == {
        "status": "ok",
        "curve": {"loss": [6.0, 5.0], "grad_norm": [2.0, 1.0]},
        "versions": nm.versions(),
    }
    assert pool.runs == [(nm.curve_job, {"cfg": cfg}, 30.0, False)]


def test_a_resumed_run_trains_to_the_save_then_the_rest_from_its_checkpoint() -> None:
    """With a resume after step 2 of 4: the first run trains 2 steps and saves after step 2 into a temporary
    directory named distbench-numerics-* (the session's leftover check knows the prefix); the second trains the
    configuration from that checkpoint; the curve is the first run's steps, then the resumed run's, and the
    directory is gone afterwards."""
    cfg = _config(steps=4)
    pool = FakePool(ranks([6.0, 5.0], [2.0, 1.5]), ranks([4.0, 3.0], [1.0, 0.5]))
    reply = nm.run_curve(pool, cfg, 30.0, resume_at=2)
    assert reply["status"] == "ok", reply
    assert reply["curve"] == {"loss": [6.0, 5.0, 4.0, 3.0], "grad_norm": [2.0, 1.5, 1.0, 0.5]}
    assert reply["versions"] == nm.versions()
    (job1, saved, t1, existed1), (job2, resumed, t2, existed2) = pool.runs
    assert job1 is job2 is nm.curve_job and t1 == t2 == 30.0 and existed1 and existed2
    ckpt = saved["checkpoint_dir"]
    assert saved == {"cfg": cfg.replace(steps=2), "save_at": 2, "checkpoint_dir": ckpt}
    assert resumed == {"cfg": cfg, "resume_from": ckpt}
    assert Path(ckpt).name.startswith("distbench-numerics-") and not Path(ckpt).exists()


def test_a_resumed_run_that_trains_other_than_the_steps_left_is_an_error() -> None:
    cfg = _config(steps=4)
    pool = FakePool(ranks([6.0, 5.0], [2.0, 1.5]), ranks([4.0], [1.0]))
    assert nm.run_curve(pool, cfg, 30.0, resume_at=2) == {
        "status": "error",
        "error": "ddp ws2: resumed after step 2, trained 1 more steps where 2 were asked",
    }


def test_ranks_that_disagree_or_a_failed_job_make_an_error_reply_naming_the_run() -> None:
    """Which run failed is named: the configuration, and for a resume which half; a failed job's own error is
    the reply's."""
    cfg = _config(steps=2)
    split = [{"loss": [6.0, 5.0], "grad_norm": [2.0, 1.0]}, {"loss": [6.0, 5.5], "grad_norm": [2.0, 1.0]}]
    assert nm.run_curve(FakePool(split), cfg, 30.0) == {
        "status": "error",
        "error": f"ddp ws2: rank 1 reports other values than rank 0: {split[1]} vs {split[0]}",
    }
    assert nm.run_curve(FakePool(ranks([6.0], [])), cfg, 30.0) == {
        "status": "error",
        "error": "ddp ws2: 1 losses and 0 gradient norms",
    }
    cfg4 = _config(steps=4)
    bad = ranks([6.0], [])
    assert nm.run_curve(FakePool(bad), cfg4, 30.0, resume_at=2)["error"] == (
        "ddp ws2 before the save: 1 losses and 0 gradient norms"
    )
    good = ranks([6.0, 5.0], [2.0, 1.5])
    assert nm.run_curve(FakePool(good, bad), cfg4, 30.0, resume_at=2)["error"] == (
        "ddp ws2 resumed: 1 losses and 0 gradient norms"
    )
    failed = JobError("curve_job", 2, [], "rank 1 exited")
    assert nm.run_curve(FakePool(failed), cfg, 30.0) == {"status": "error", "error": str(failed)}


def test_the_ranks_curve_is_rank_zeros_when_every_rank_agrees() -> None:
    """Three ranks, rank 2 disagreeing: named as rank 2 (ranks are counted from 0)."""
    same = {"loss": [6.0], "grad_norm": [2.0]}
    assert nm.curve_of([same, same, same], "x") == curve([6.0], [2.0])
    other = {"loss": [6.5], "grad_norm": [2.0]}
    with pytest.raises(ValueError) as e:
        nm.curve_of([same, same, other], "ddp ws3")
    assert str(e.value) == f"ddp ws3: rank 2 reports other values than rank 0: {other} vs {same}"


@pytest.fixture
def fake_train(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any, dict[str, Any], int]]:
    """jobs.train's train replaced: records (ctx, cfg, its keyword arguments, torch's thread count inside)."""
    calls: list[tuple[Any, Any, dict[str, Any], int]] = []

    def train(ctx: Any, cfg: Any, **kw: Any) -> dict[str, Any]:
        calls.append((ctx, cfg, kw, torch.get_num_threads()))
        return {"losses": [6.0, 5.0], "grad_norms": [2.0, 1.0], "other": 1}

    monkeypatch.setitem(sys.modules, "distbench.jobs.train", types.SimpleNamespace(train=train))
    return calls


def test_the_curve_job_trains_the_configuration_on_one_cpu_thread(fake_train) -> None:
    """In a rank on CPU the job trains with one intra-op thread (a reduction's order must not follow the
    machine's cores), and gives the thread count back; it passes the checkpoint arguments through and replies
    the losses and gradient norms by the comparison's metric names. On a GPU the thread count is left alone."""
    cfg = _config(steps=2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ctx = types.SimpleNamespace(device_type="cpu")
        out = nm.curve_job(ctx, cfg, save_at=1, checkpoint_dir="/ckpt")
        assert out == {"loss": [6.0, 5.0], "grad_norm": [2.0, 1.0]}
        assert fake_train[-1] == (ctx, cfg, {"save_at": 1, "checkpoint_dir": "/ckpt"}, 1)
        assert torch.get_num_threads() == 2
        gpu = types.SimpleNamespace(device_type="cuda")
        nm.curve_job(gpu, cfg)
        assert fake_train[-1] == (gpu, cfg, {}, 2)
    finally:
        torch.set_num_threads(before)


def test_a_run_reports_the_versions_of_torch_transformers_and_deepspeed_installed() -> None:
    def installed(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    assert nm.versions() == {
        "torch": torch.__version__,
        "transformers": installed("transformers"),
        "deepspeed": installed("deepspeed"),
    }


# --- what a numerics run trains -----------------------------------------------------------------------------


def test_a_numerics_run_trains_the_steps_asked_deterministically_untimed_and_recording_the_norm() -> None:
    """Whatever the configuration's timing (warm-up steps, windows, device-time steps), a numerics run trains
    exactly `steps` steps once, in deterministic mode unless asked otherwise, with a clipping bound that no
    norm reaches unless the configuration clips itself."""
    cfg = _config(steps=20, warmup=3, windows=5, device_time_steps=2, deterministic=False)
    n = nm.numerics_config(cfg, 6)
    assert (n.steps, n.warmup, n.windows, n.device_time_steps, n.deterministic, n.clip_grad_norm) == (
        6,
        0,
        1,
        0,
        True,
        1e30,
    )
    assert nm.numerics_config(cfg, 6, deterministic=False).deterministic is False
    assert nm.numerics_config(cfg.replace(clip_grad_norm=0.5), 6).clip_grad_norm == 0.5
    assert nm.numerics_config(cfg).steps == 8


def test_the_accumulation_recipe_keeps_a_configuration_that_accumulates_already() -> None:
    """Two micro-batches per rank and step already accumulate: the recipe trains the configuration as given;
    one gets ACCUM (4) per rank by a global batch four times as large."""
    two = _config(global_batch=8)
    assert two.accum_steps == 2 and nm.recipe_config("accumulation", two, 0.0) == two
    one = _config()
    assert one.accum_steps == 1 and nm.recipe_config("accumulation", one, 0.0).global_batch == 16


def test_an_unknown_recipe_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as e:
        nm.recipe_config("warmup", _config(), 0.0)
    assert str(e.value) == f"unknown recipe 'warmup'; one of {RECIPE_NAMES}"


def test_the_resume_recipe_saves_after_half_the_steps_rounded_down() -> None:
    assert nm.resume_step("resume", _config(steps=5)) == 2 and isinstance(
        nm.resume_step("resume", _config(steps=5)), int
    )
    assert nm.resume_step("default", _config(steps=5)) is None


def test_a_resume_half_way_needs_two_steps_and_other_recipes_one() -> None:
    """A resume after step 0 would resume an untrained model; at 2 steps it saves after step 1. The other
    recipes run at 1 step. Otherwise the strategy's own reason, at the configuration's world size, decides."""
    assert nm.skip_reason("resume", _config(steps=1), "cpu") == (
        "a resume half-way needs 2 steps or more, not 1: raise --numerics-steps"
    )
    assert nm.skip_reason("resume", _config(steps=2), "cpu") is None
    assert nm.skip_reason("default", _config(steps=1), "cpu") is None
    assert nm.skip_reason("default", RunConfig(strategy="single", world_size=2), "cpu") == (
        "single runs on at most 1 rank(s)"
    )


def test_a_curve_without_a_name_is_called_curve_in_its_error() -> None:
    with pytest.raises(ValueError) as e:
        nm.Curve.from_dict({"loss": [1.0]})
    assert str(e.value) == "curve: needs lists of numbers loss, grad_norm (KeyError: 'grad_norm')"


# --- what ab asks the variants ------------------------------------------------------------------------------


class Asked:
    """An Ask over two stand-in variants: loss falls by 0.01 a step, the norm by 0.1 from 4.0 (times the
    micro-batches accumulated, so the accumulation recipe's norms differ from the default's); head moves
    where `broken` says; `fail` replies an error for that side. Records (side, cfg, resume_at, on the main
    thread)."""

    def __init__(self, broken: Any = None, fail: dict[str, dict[str, Any]] | None = None) -> None:
        self.asked: list[tuple[str, RunConfig, int | None, bool]] = []
        self.broken = broken
        self.fail = fail or {}

    def __call__(self, side: str, cfg: RunConfig, resume_at: int | None) -> dict[str, Any]:
        self.asked.append((side, cfg, resume_at, threading.current_thread() is threading.main_thread()))
        if side in self.fail:
            return self.fail[side]
        loss = [6.0 - 0.01 * s for s in range(cfg.steps)]
        norm = [(4.0 - 0.1 * s) * cfg.accum_steps for s in range(cfg.steps)]
        if side == "head" and self.broken and self.broken(cfg):
            loss = [v * 1.01 for v in loss]
        return {"status": "ok", "curve": {"loss": loss, "grad_norm": norm}, "versions": {"torch": side}}


@pytest.mark.parametrize("at_once", [False, True])
def test_each_recipe_asks_base_and_head_once_then_base_repeats_times_without_determinism(
    at_once: bool,
) -> None:
    """Per recipe: base's and head's deterministic runs (at the recipe's resume step), then `repeats` runs of
    base with non-deterministic kernels at the same resume step; the versions each side reported are kept by
    side."""
    ask = Asked()
    (o,) = nm.compare_variants(
        [("ddp ws2", _config())], ask, recipes=("resume",), steps=4, repeats=2, at_once=at_once
    )
    assert o.kind == nm.IDENTICAL, o.detail
    rcfg = nm.numerics_config(_config(), 4)
    first_two = sorted((side, cfg, r) for side, cfg, r, _ in ask.asked[:2])
    assert first_two == [("base", rcfg, 2), ("head", rcfg, 2)]
    noisy = rcfg.replace(deterministic=False)
    assert [(side, cfg, r) for side, cfg, r, _ in ask.asked[2:]] == [("base", noisy, 2)] * 2
    assert o.versions == {"base": {"torch": "base"}, "head": {"torch": "head"}}


def test_base_and_head_run_one_after_the_other_unless_asked_at_once() -> None:
    """By default each run is asked from the caller's thread, one at a time; at_once asks every run of the
    recipe (both deterministic runs and base's noisy one) from a thread of its own, so that a side with several
    servers runs them at once."""
    one = Asked()
    nm.compare_variants([("ddp ws2", _config())], one, recipes=("default",), steps=2, repeats=1)
    assert [main for *_, main in one.asked] == [True, True, True]
    both = Asked()
    nm.compare_variants(
        [("ddp ws2", _config())], both, recipes=("default",), steps=2, repeats=1, at_once=True
    )
    assert [main for *_, main in both.asked] == [False, False, False]


def test_the_clipping_threshold_comes_from_the_default_recipes_base_run_without_another() -> None:
    """A quarter of the smallest norm of base's default run: with the default recipe compared first, no extra
    run is asked (and the accumulation recipe's runs, whose norms differ, do not set it); compared alone, one
    more deterministic run of base at the configuration, without resume, sets it."""
    ask = Asked()
    out = nm.compare_variants(
        [("ddp ws2", _config())], ask, recipes=("default", "accumulation", "clipping"), steps=4, repeats=0
    )
    assert len(ask.asked) == 6  # base and head per recipe, nothing more
    clipped = ask.asked[-1][1]
    assert clipped.clip_grad_norm == pytest.approx(0.25 * 3.7)
    assert out[-1].detail.endswith("binding at 4 of 4 steps")
    alone = Asked()
    (o,) = nm.compare_variants([("ddp ws2", _config())], alone, recipes=("clipping",), steps=4, repeats=0)
    assert o.kind == nm.IDENTICAL, o.detail
    assert [(s, c, r) for s, c, r, _ in alone.asked[:1]] == [("base", nm.numerics_config(_config(), 4), None)]
    assert len(alone.asked) == 3 and alone.asked[-1][1].clip_grad_norm == pytest.approx(0.25 * 3.7)


def test_a_recipe_other_than_clipping_asks_no_threshold_run() -> None:
    ask = Asked()
    nm.compare_variants([("ddp ws2", _config())], ask, recipes=("default",), steps=2, repeats=0)
    assert [s for s, *_ in ask.asked] == ["base", "head"]


def test_a_clipping_bound_binds_at_the_steps_whose_norm_is_above_it() -> None:
    """The user's own clipping bound at 3.8: norms 4.0 and 3.9 are above it, 3.8 is not (equal), 3.7 is not."""
    (o,) = nm.compare_variants(
        [("ddp ws2", _config(clip_grad_norm=3.8))], Asked(), recipes=("clipping",), steps=4, repeats=0
    )
    assert o.note == "clipped at 3.8, binding at 2 of 4 steps"


def test_a_resume_with_too_few_steps_is_skipped_not_run() -> None:
    ask = Asked()
    (o,) = nm.compare_variants([("ddp ws2", _config())], ask, recipes=("resume",), steps=1, repeats=0)
    assert (
        o.kind == nm.SKIPPED and o.skipped.startswith("a resume half-way needs 2 steps") and ask.asked == []
    )


def test_a_failed_run_leaves_its_recipe_not_compared_with_the_sides_error() -> None:
    """The reply's error, or its status where it has none; each outcome is handed to on_outcome as it is
    decided, in order."""
    seen: list[nm.NumericsOutcome] = []
    ask = Asked(fail={"head": {"status": "error", "error": "boom"}})
    out = nm.compare_variants(
        [("ddp ws2", _config())], ask, recipes=("default", "fp16"), steps=2, repeats=0, on_outcome=seen.append
    )
    assert seen == out and [o.kind for o in out] == [nm.NOT_COMPARED, nm.NOT_COMPARED]
    assert out[0].error == "head's numerics run failed: boom" and out[0].detail == out[0].error
    timed_out = Asked(fail={"base": {"status": "timeout"}})
    (o,) = nm.compare_variants([("ddp ws2", _config())], timed_out, recipes=("default",), steps=2, repeats=0)
    assert o.error == "base's numerics run failed: timeout"
    damaged = Asked(fail={"head": {"status": "ok", "curve": {"loss": [6.0, 5.0], "grad_norm": [2.0]}}})
    (o,) = nm.compare_variants([("ddp ws2", _config())], damaged, recipes=("default",), steps=2, repeats=0)
    assert o.error == "head's numerics run: 2 losses and 1 gradient norms"
    assert o.versions == {"base": {"torch": "base"}, "head": {}}  # a reply without versions records none


# --- the variant servers ------------------------------------------------------------------------------------


class Server:
    """A stand-in variant server (gate/variants.py's VariantProcess) speaking `protocol`."""

    def __init__(self, name: str, protocol: int, reply: Any = "ok") -> None:
        self.protocol, self.log, self.reply = protocol, f"/logs/{name}.log", reply
        self.requests: list[tuple[dict[str, Any], float, bool]] = []
        self.recycled = 0

    def request(self, request: dict[str, Any], timeout: float) -> Any:
        self.requests.append((request, timeout, threading.current_thread() is threading.main_thread()))
        if self.reply != "ok":
            return self.reply
        cfg = RunConfig.from_dict(request["cfg"])
        return {
            "status": "ok",
            "curve": {"loss": [6.0 - s for s in range(cfg.steps)], "grad_norm": [2.0] * cfg.steps},
            "versions": {"torch": self.log},
        }

    def recycle(self) -> None:
        self.recycled += 1


def test_a_numerics_request_carries_the_configuration_and_a_resume_step_only_for_a_resume() -> None:
    base, head = Server("base", 4), Server("head", 4)
    ask = nm.ask_servers({"base": base, "head": head}, 42.0)
    cfg = _config(steps=2)
    assert ask("head", cfg, None)["status"] == "ok"
    assert ask("base", cfg, 1)["status"] == "ok"
    assert head.requests == [({"op": "numerics", "cfg": cfg.to_dict()}, 42.0, True)]
    assert base.requests == [({"op": "numerics", "cfg": cfg.to_dict(), "resume_at": 1}, 42.0, True)]


def test_a_server_too_old_for_the_request_is_refused_before_asking_and_says_which_protocol() -> None:
    """Protocol 3 serves numerics runs, 4 resumed ones too; an older server is not asked."""
    three, two = Server("head", 3), Server("base", 2)
    ask = nm.ask_servers({"base": two, "head": three}, 42.0)
    assert ask("head", _config(), None)["status"] == "ok"
    assert ask("base", _config(), None) == {
        "status": "error",
        "error": "the base variant's distbench predates numerics runs (its server speaks protocol 2, "
        "they need 3): leave them out with --recipes, or compare speed alone with --numerics off",
    }
    assert ask("head", _config(), 1)["error"].startswith(
        "the head variant's distbench predates numerics resumed runs (its server speaks protocol 3, they need 4)"
    )
    assert two.requests == [] and len(three.requests) == 1


def test_a_server_that_died_or_hung_is_an_error_naming_its_log() -> None:
    ask = nm.ask_servers({"head": Server("head", 4, reply=None)}, 42.0)
    assert ask("head", _config(), None) == {
        "status": "error",
        "error": "the head variant died or hung (log: /logs/head.log)",
    }


class Console:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, line: str) -> None:
        self.lines.append(line)


def _args(**kw: Any) -> argparse.Namespace:
    defaults = {
        "numerics": "on",
        "recipes": ("default",),
        "numerics_steps": 2,
        "numerics_repeats": None,
        "timeout": 9.0,
    }
    return argparse.Namespace(**{**defaults, **kw})


def _servers(reply: Any = "ok") -> dict[str, Server]:
    return {"base": Server("base", 4, reply), "head": Server("head", 4, reply)}


@pytest.mark.parametrize("mode", ["off", "suite", None])
def test_no_numerics_runs_under_numerics_off_or_suite_or_without_the_flag(mode: str | None) -> None:
    servers = _servers()
    args = _args(numerics=mode) if mode else argparse.Namespace(timeout=9.0)
    assert nm.compare_servers(args, [_config()], servers, Console(), str, "cpu") == []
    assert all(s.requests == [] and s.recycled == 0 for s in servers.values())


def test_ab_compares_each_configuration_by_its_label_prints_each_verdict_and_recycles_the_servers() -> None:
    """Under --numerics on: the recipes asked, --numerics-steps steps each, labelled as the report labels the
    configuration, each verdict printed as it is decided (a run that could not be compared, with why); then
    each server recycled once, so the speed runs start in fresh ranks."""
    servers, console = _servers(), Console()
    args = _args(recipes=("default", "fp16"), numerics_steps=3)
    out = nm.compare_servers(args, [_config()], servers, console, lambda c: f"<{c.strategy}>", "cpu")
    assert [(o.label, o.recipe, o.kind) for o in out] == [
        ("<ddp>", "default", nm.IDENTICAL),
        ("<ddp>", "fp16", nm.IDENTICAL),
    ]
    assert all(RunConfig.from_dict(r["cfg"]).steps == 3 for s in servers.values() for r, _, _ in s.requests)
    assert all(t == 9.0 for s in servers.values() for _, t, _ in s.requests)
    assert console.lines == ["  numerics default <ddp>: identical", "  numerics fp16 <ddp>: identical"]
    assert [s.recycled for s in servers.values()] == [1, 1]
    dead, console = _servers(reply=None), Console()
    nm.compare_servers(_args(), [_config()], dead, console, lambda c: "x", "cpu")
    assert console.lines == [
        "  numerics default x: not compared: base's numerics run failed: the base variant died or hung (log: /logs/base.log)"
    ]


def test_numerics_default_mode_compares_the_default_step_alone() -> None:
    out = nm.compare_servers(
        _args(numerics="default", recipes=("fp16",)), [_config()], _servers(), Console(), str, "cpu"
    )
    assert [o.recipe for o in out] == ["default"]


@pytest.mark.parametrize(
    "device, given, noisy", [("cpu", None, 0), ("cuda", None, 3), ("cpu", 2, 2), ("cuda", 1, 1)]
)
def test_the_spreads_runs_are_the_devices_default_unless_given(
    device: str, given: int | None, noisy: int
) -> None:
    """--numerics-repeats, or REPEATS_BY_DEVICE: none on CPU (its kernels have no atomics), 3 on GPUs."""
    servers = _servers()
    nm.compare_servers(_args(numerics_repeats=given), [_config()], servers, Console(), str, device)
    assert len(servers["base"].requests) == 1 + noisy and len(servers["head"].requests) == 1


@pytest.mark.parametrize(
    "device, cores, n_ranks, at_once",
    [
        ("cpu", 4, 2, True),
        ("cpu", 3, 2, False),
        ("cpu", 2, 1, True),
        ("cpu", None, 1, False),
        ("cuda", 64, 1, False),
    ],
)
def test_on_cpu_both_sides_run_at_once_where_the_machine_has_a_core_per_rank_of_both(
    monkeypatch, device: str, cores: int | None, n_ranks: int, at_once: bool
) -> None:
    """Base's and head's runs at the same time only on CPU, and only with 2 x world size cores or more (an
    unknown count is one core); GPU runs take turns."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    servers = _servers()
    cfg = _config(world_size=n_ranks, global_batch=2 * n_ranks)
    nm.compare_servers(_args(numerics_repeats=0), [cfg], servers, Console(), str, device)
    assert [main for s in servers.values() for _, _, main in s.requests] == [not at_once] * 2


GIB = 2**30


@pytest.mark.parametrize(
    "card_gib, cores, kind, ranks, at_once",
    [
        (80, 16, "zero2", 1, 4),  # an H100: the bound (16.6 GiB a run, gpt2-774m's footprint) places four
        (141, 16, "zero2", 1, 5),  # an H200: all five of a recipe's runs
        (141, 6, "zero2", 1, 3),  # two host cores a rank
        (141, 7, "zero2", 1, 3),  # whole ranks only: 7 cores hold three
        (141, 16, "fsdp_full", 2, 4),  # two ranks a run: 16 cores for four
        (16, 16, "zero2", 1, 1),  # not even one run fits the bound: one at a time
        (141, 16, "fsdp2_offload", 1, 1),  # no memory model for an offloaded strategy: one at a time
        (None, 16, "zero2", 1, 1),  # no card to hold it against
    ],
)
def test_gpu_runs_go_at_once_as_far_as_the_memory_models_bound_and_the_cores_allow(
    monkeypatch, card_gib: int | None, cores: int, kind: str, ranks: int, at_once: int
) -> None:
    """On GPUs a recipe's five runs (both deterministic runs, three noisy ones) share the card where the memory
    model's bound for the numerics' gpt2-124m places them all, with two host cores a rank: the wall time of the
    recipe set is then that of its slowest run, not five."""
    from distbench.gate import fit

    monkeypatch.setattr(fit, "card_bytes", lambda: None if card_gib is None else card_gib * GIB)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    cfg = _config(
        strategy=kind,
        world_size=ranks,
        model="gpt2-124m",
        micro_batch=2,
        global_batch=2 * ranks,
        seq_len=256,
    )
    got = nm.runs_at_once([cfg], "cuda", 5)
    assert got == at_once and isinstance(got, int)


def test_no_configurations_run_one_at_a_time() -> None:
    assert nm.runs_at_once([], "cuda", 5) == 1 and nm.runs_at_once([], "cpu", 2) == 1


class Gathered(Server):
    """A stand-in server whose requests and start wait until `together` of them are in flight at once."""

    def __init__(self, name: str, barrier: threading.Barrier) -> None:
        super().__init__(name, 4)
        self.barrier = barrier

    def twin(self, n: int) -> Gathered:
        return Gathered(f"base-{n}", self.barrier)

    def start(self) -> None:
        self.barrier.wait()

    def request(self, request: dict[str, Any], timeout: float) -> Any:
        self.barrier.wait()
        return super().request(request, timeout)


def test_every_run_of_a_recipe_and_every_twin_start_is_in_flight_at_once_whatever_the_cores(
    monkeypatch,
) -> None:
    """A recipe's runs and the twins' starts each get a thread of their own, not a pool sized by the host's cores
    (min(32, cores + 4) on one core is five): eight runs at once on base's eight servers and head's, and
    seven twins started together, on a host that reports one core."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    starts = threading.Barrier(7, timeout=10)
    twins = nm._start_twins(Gathered("base", starts), 7, Console())
    assert len(twins) == 7
    (one,) = nm._start_twins(Gathered("base", threading.Barrier(1)), 1, Console())  # three at once: one twin
    assert one.log == "/logs/base-1.log" and nm._start_twins(Gathered("base", starts), 0, Console()) == []
    runs = threading.Barrier(8, timeout=10)
    base = [Gathered("base", runs), *(Gathered(f"base-{n}", runs) for n in range(1, 7))]
    head = Gathered("head", runs)
    ask = nm.ask_servers({"base": base[0], "head": head}, 9.0, {"base": base[1:]})
    (o,) = nm.compare_variants(
        [("ddp ws2", _config())], ask, recipes=("default",), steps=2, repeats=6, at_once=True
    )
    assert o.kind == nm.IDENTICAL and sum(len(b.requests) for b in base) == 7


class Twinned(Server):
    """A stand-in server that makes twins (VariantProcess.twin) and answers from several threads at once: each
    request waits until `together` requests are in flight on the side's servers, so a test passes only if they
    really run at the same time."""

    def __init__(self, name: str, side: list[Twinned], together: int, broken: set[int] = frozenset()) -> None:
        super().__init__(name, 4)
        self.side, self.together, self.broken = side, together, broken
        self.started = self.closed = False
        side.append(self)

    def twin(self, n: int) -> Twinned:
        return Twinned(f"{self.log.split('/')[-1][:-4]}-{n}", self.side, self.together, self.broken)

    def start(self) -> None:
        from distbench.gate.variants import VariantStartError

        if int(self.log[-5]) in self.broken:
            raise VariantStartError("base", "planted start failure")
        self.started = True

    def close(self) -> None:
        self.closed = True

    def request(self, request: dict[str, Any], timeout: float) -> Any:
        barrier = IN_FLIGHT.setdefault(id(self.side), threading.Barrier(self.together, timeout=10))
        barrier.wait()
        return super().request(request, timeout)


IN_FLIGHT: dict[int, threading.Barrier] = {}


def test_on_a_card_that_holds_them_a_recipes_runs_go_to_base_and_its_twins_at_once(monkeypatch) -> None:
    """Five runs at once on an H200: base's deterministic and three noisy runs on base's server and three twins
    (one each, all four in flight together), head's on its own; the twins are closed once the numerics end,
    so the speed runs that follow have the card to themselves; the verdict is the serial one's."""
    from distbench.gate import fit

    monkeypatch.setattr(fit, "card_bytes", lambda: 141 * GIB)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    base_side: list[Twinned] = []
    base = Twinned("base", base_side, together=4)
    servers: dict[str, Any] = {"base": base, "head": Server("head", 4)}
    cfg = _config(world_size=1, global_batch=2, model="gpt2-124m", seq_len=256)
    (o,) = nm.compare_servers(_args(), [cfg], servers, Console(), str, "cuda")
    assert o.kind == nm.IDENTICAL
    assert len(base_side) == 4 and [len(s.requests) for s in base_side] == [1, 1, 1, 1]
    assert all(s.started and s.closed for s in base_side[1:]) and not base.closed
    assert sorted(RunConfig.from_dict(s.requests[0][0]["cfg"]).deterministic for s in base_side) == [
        False,
        False,
        False,
        True,
    ]
    assert len(servers["head"].requests) == 1


def test_a_twin_that_does_not_start_is_left_out_and_its_runs_take_turns_on_the_others(monkeypatch) -> None:
    from distbench.gate import fit

    monkeypatch.setattr(fit, "card_bytes", lambda: 141 * GIB)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    base_side: list[Twinned] = []
    base = Twinned("base", base_side, together=1, broken={2})
    console = Console()
    cfg = _config(world_size=1, global_batch=2, model="gpt2-124m", seq_len=256)
    (o,) = nm.compare_servers(_args(), [cfg], {"base": base, "head": Server("head", 4)}, console, str, "cuda")
    assert o.kind == nm.IDENTICAL
    assert sum(len(s.requests) for s in base_side) == 4 and base_side[2].requests == []
    assert [line for line in console.lines if "did not start" in line] == [
        "  note: a second server of the base variant did not start (planted start failure); its runs take turns"
    ]


def test_the_numerics_flags_help_says_each_mode_default_and_exit_as_the_code_acts() -> None:
    """`distbench ab --help` is where a user learns what --numerics on/only/default/suite/off do, what a
    divergence exits with and the defaults the comparison reads: each flag's help, written out by hand."""
    p = argparse.ArgumentParser()
    nm.add_flags(p)
    helps = {a.dest: a.help for a in p._actions if a.dest != "help"}
    assert helps == {
        "numerics": "compare head's per-step loss and gradient norm with base's in deterministic mode, over the "
        "recipes (--recipes): on (default: then the speed), only (no speed runs), default (the default step "
        "alone, then the speed), suite (run the invariant tests under base and head instead: those that fail "
        "under head alone, per strategy; no speed), off (speed alone); a divergence beyond the tolerance, or "
        "a test failing under head alone, exits 4",
        "recipes": "the recipes the numerics compare, comma-separated (default: all, i.e. default, "
        "accumulation, clipping, bf16-amp, fp16, activation-checkpointing, resume); a recipe a strategy "
        "cannot run on the device is skipped with its reason",
        "suite_timeout": "seconds each side's test run may take under --numerics suite (default 3600); past "
        "it, undecided",
        "numerics_steps": "steps each numerics run trains (default 8)",
        "numerics_repeats": "runs of base with non-deterministic kernels whose spread sets the tolerance beside "
        "rounding (default 3 on GPUs, 0 on CPU, whose kernels run alike either way; under 2: rounding alone)",
    }


def test_the_numerics_flags_parse_to_what_the_comparison_reads() -> None:
    """Defaults: every recipe, --numerics on, 8 steps, the device's repeats (None), an hour for the suite;
    given values parse to their types; an unknown mode is refused."""
    p = argparse.ArgumentParser()
    nm.add_flags(p)
    a = p.parse_args([])
    assert (a.numerics, a.recipes, a.numerics_steps, a.numerics_repeats, a.suite_timeout) == (
        "on",
        ("default", "accumulation", "clipping", "bf16-amp", "fp16", "activation-checkpointing", "resume"),
        8,
        None,
        3600.0,
    )
    a = p.parse_args(
        ["--numerics", "only", "--recipes", "fp16,resume", "--numerics-steps", "3", "--numerics-repeats", "2"]
        + ["--suite-timeout", "90.5"]
    )
    assert (a.numerics, a.recipes, a.numerics_steps, a.numerics_repeats, a.suite_timeout) == (
        "only",
        ("fp16", "resume"),
        3,
        2,
        90.5,
    )
    for mode in nm.MODES:
        assert p.parse_args(["--numerics", mode]).numerics == mode
    with pytest.raises(SystemExit):
        p.parse_args(["--numerics", "fast"])


def test_each_numerics_flag_is_documented_with_the_default_the_parser_has() -> None:
    p = argparse.ArgumentParser()
    nm.add_flags(p)
    helps = {a.option_strings[0]: a.help or "" for a in p._actions if a.option_strings and a.dest != "help"}
    assert set(helps) == {
        "--numerics",
        "--recipes",
        "--suite-timeout",
        "--numerics-steps",
        "--numerics-repeats",
    }
    assert all(helps.values()), helps
    assert "on (default: then the speed)" in helps["--numerics"] and "exits 4" in helps["--numerics"]
    assert f"(default: all, i.e. {RECIPE_NAMES})" in helps["--recipes"]
    assert "(default 3600)" in helps["--suite-timeout"]
    assert "(default 8)" in helps["--numerics-steps"]
    assert "(default 3 on GPUs, 0 on CPU" in helps["--numerics-repeats"]


def test_an_empty_or_unknown_recipe_list_is_refused_listing_every_recipe() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        nm.parse_recipes(" , ")
    assert str(e.value) == f"no recipe given; name one or more of: all, {RECIPE_NAMES}"
    with pytest.raises(argparse.ArgumentTypeError) as e:
        nm.parse_recipes("accumulate")
    assert (
        str(e.value) == f"unknown recipe 'accumulate'. Did you mean accumulation? Known: all, {RECIPE_NAMES}"
    )


# --- what the report receives -------------------------------------------------------------------------------


def test_the_tolerance_rule_states_the_measured_spread_only_from_two_runs() -> None:
    """One run has no spread to measure; from two on, the largest difference per metric in two significant
    figures."""
    base = curve([6.0, 5.0], [2.0, 2.0])
    rule = "tolerance per step = max(4 float32 ulps of base's value, 2 x the run-to-run spread up to that step); "
    for runs in ([], [base]):
        assert nm.tolerance_statement(nm.tolerance(base, runs)) == rule + "no run-to-run spread measured"
    two = [base, curve([6.0, 5.001], [2.0, 2.0])]
    assert nm.tolerance_statement(nm.tolerance(base, two)) == (
        rule + "the largest difference between 2 runs of base with non-deterministic kernels was loss "
        "1.00e-03, grad_norm 0.00e+00"
    )


def test_within_tolerance_reports_each_metrics_largest_difference_as_a_share_of_its_tolerance() -> None:
    """loss moved by 1 of its 4 allowed ulps at step 1: 0.25; grad_norm not at all: 0.00."""
    base = curve([4.0, 4.0], [2.0, 2.0])
    v = nm.compare(base, curve([4.0, 4.0 + 4.0 * 2.0**-23], [2.0, 2.0]), nm.tolerance(base, []))
    assert v.kind == nm.WITHIN and v.largest == {"loss": pytest.approx(0.25), "grad_norm": 0.0}
    assert v.describe() == "within tolerance (largest difference / tolerance: loss 0.25, grad_norm 0.00)"


def test_a_value_of_zero_allows_no_move_at_all() -> None:
    """A base value of exactly 0 with no measured spread has a tolerance of 0: unmoved it is within (a share
    of 0), moved at all it diverges (an infinite share)."""
    base = curve([6.0, 5.0], [0.0, 0.0])
    tol = nm.tolerance(base, [])
    same = nm.compare(base, curve([6.0, 5.0 + 4.0 * 2.0**-23], [0.0, 0.0]), tol)
    assert same.kind == nm.WITHIN and same.largest["grad_norm"] == 0.0
    moved = nm.compare(base, curve([6.0, 5.0], [0.0, 1e-30]), tol)
    assert moved.kind == nm.DIVERGED and moved.largest["grad_norm"] == float("inf")
    assert moved.divergence is not None and (moved.divergence.step, moved.divergence.metric) == (
        1,
        "grad_norm",
    )


def test_curves_of_different_lengths_are_refused_naming_both() -> None:
    base = curve([6.0, 5.0, 4.0], [2.0] * 3)
    with pytest.raises(ValueError) as e:
        nm.compare(base, curve([6.0, 5.0], [2.0] * 2), nm.tolerance(base, []))
    assert str(e.value) == "base ran 3 steps, head 2: not comparable"


def test_the_spread_is_named_as_the_bound_only_where_it_is_larger_than_rounding() -> None:
    r = 4 * 2.0**-23 * 4.0  # rounding's bound at 4.0
    tol = nm.Tolerance({"loss": [r, r, r]}, {"loss": [r / 4, r / 2, r]}, 2)
    assert [tol.source("loss", s) for s in range(3)] == ["rounding", "rounding", "spread"]


def test_an_outcomes_json_holds_both_curves_the_tolerance_its_rule_and_the_divergence() -> None:
    base, head = curve([6.0, 5.0], [2.0, 2.0]), curve([6.0, 5.5], [2.0, 2.0])
    o = nm.NumericsOutcome(
        "ddp ws2", "fp16", base, head, nm.tolerance(base, []), versions={"base": {"torch": "a"}}
    )
    o.verdict = nm.compare(base, head, o.tolerance)
    assert o.tolerance is not None
    assert o.to_json() == {
        "config": "ddp ws2",
        "recipe": "fp16",
        "verdict": nm.DIVERGED,
        "detail": o.detail,
        "skipped": None,
        "base": {"loss": [6.0, 5.0], "grad_norm": [2.0, 2.0]},
        "head": {"loss": [6.0, 5.5], "grad_norm": [2.0, 2.0]},
        "tolerance": o.tolerance.to_dict(),
        "tolerance_rule": nm.tolerance_statement(o.tolerance),
        "versions": {"base": {"torch": "a"}},
        "divergence": {
            "step": 1,
            "metric": "loss",
            "base": 5.0,
            "head": 5.5,
            "allowed": o.tolerance.allowed("loss", 1),
        },
    }
    assert o.detail.startswith("fp16 on ddp ws2: diverged from step 1: loss 5.0 -> 5.5")
    skipped = nm.NumericsOutcome("zero2 ws2", "fp16", skipped="no fp16 on CPU")
    assert skipped.to_json() == {
        "config": "zero2 ws2",
        "recipe": "fp16",
        "verdict": nm.SKIPPED,
        "detail": "no fp16 on CPU",
        "skipped": "no fp16 on CPU",
        "base": None,
        "head": None,
        "tolerance": None,
        "tolerance_rule": None,
        "versions": {},
        "divergence": None,
    }


def test_which_recipes_a_strategy_cannot_run_is_judged_on_the_device_ab_runs_on() -> None:
    """zero2 cannot train fp16 on CPU (DeepSpeed's CPU accelerator), and can on a GPU: `distbench ab` on a GPU
    compares the recipe, on CPU skips it."""
    zero2 = _config(strategy="zero2")
    on_gpu = nm.compare_servers(_args(recipes=("fp16",)), [zero2], _servers(), Console(), str, "cuda")
    assert [o.kind for o in on_gpu] == [nm.IDENTICAL]
    on_cpu = nm.compare_servers(_args(recipes=("fp16",)), [zero2], _servers(), Console(), str, "cpu")
    assert [o.kind for o in on_cpu] == [nm.SKIPPED]
