"""The upgrade gate's numerics over the recipes users train with (gate/numerics.py RECIPES): every recipe runs for
every strategy, each trains what it names, a recipe a strategy cannot run is skipped with its reason, and a change
that breaks one recipe alone is caught there, naming the recipe and the step, where the default step reads
identical."""

from __future__ import annotations

from typing import Any

import pytest

import numerics_plants
from distbench.config import RunConfig
from distbench.gate import numerics as nm

#: The recipes the issue asks the gate to compare, written out here rather than read from RECIPES: a recipe
#: dropped from the numerics fails the tests below.
REQUIRED = {"default", "accumulation", "clipping", "bf16-amp", "fp16", "activation-checkpointing", "resume"}


class FakeVariants:
    """An Ask whose curves are a function of what each run trains (no ranks): records every run asked, and
    `broken(cfg, resume_at)` says where head's numbers move."""

    def __init__(self, broken=lambda cfg, resume_at: False) -> None:
        self.asked: list[tuple[str, RunConfig, int | None]] = []
        self.broken = broken

    def __call__(self, side: str, cfg: RunConfig, resume_at: int | None) -> dict[str, Any]:
        self.asked.append((side, cfg, resume_at))
        loss = [6.0 - 0.01 * s - 0.001 * cfg.accum_steps for s in range(cfg.steps)]
        norm = [4.0 - 0.1 * s for s in range(cfg.steps)]
        if side == "head" and self.broken(cfg, resume_at):
            loss = [v * (1 + 1e-3) if s >= 2 else v for s, v in enumerate(loss)]
        return {"status": "ok", "curve": {"loss": loss, "grad_norm": norm}, "versions": {"torch": "x"}}


def _config(strategy: str = "ddp", world_size: int = 2) -> RunConfig:
    return RunConfig(strategy=strategy, world_size=world_size, micro_batch=2, global_batch=2 * world_size)


def test_every_recipe_runs_and_trains_what_it_names():
    ask = FakeVariants()
    out = nm.compare_variants([("ddp ws2", _config())], ask, device="cpu", steps=4, repeats=0)
    assert {o.recipe for o in out} == REQUIRED and set(nm.RECIPES) == REQUIRED
    assert all(o.kind == nm.IDENTICAL for o in out), [(o.recipe, o.detail) for o in out]
    head = {
        o.recipe: cfg for o, (side, cfg, _) in zip(out, [a for a in ask.asked if a[0] == "head"], strict=True)
    }
    assert head["default"].accum_steps == 1 and head["default"].clip_grad_norm == nm.NEVER_CLIP
    assert head["accumulation"].accum_steps == nm.ACCUM
    # the clip binds: a quarter of base's smallest default norm (3.7), under every step's norm
    assert head["clipping"].clip_grad_norm == pytest.approx(nm.CLIP_FRACTION * 3.7)
    assert "binding at 4 of 4 steps" in next(o.detail for o in out if o.recipe == "clipping")
    assert head["bf16-amp"].precision == "bf16-amp" and head["fp16"].precision == "fp16"
    assert head["activation-checkpointing"].activation_checkpointing
    resumed = {r for side, _, r in ask.asked if side == "head"} - {None}
    assert resumed == {2}, ask.asked  # saved half-way, and only the resume recipe asked for it
    assert all(cfg.deterministic and cfg.steps == 4 for _, cfg, _ in ask.asked)


def test_a_recipe_the_strategy_cannot_run_here_is_skipped_with_its_reason():
    out = nm.compare_variants(
        [("zero2 ws2", _config("zero2"))], FakeVariants(), device="cpu", steps=4, repeats=0
    )
    skipped = {o.recipe: o.skipped for o in out if o.kind == nm.SKIPPED}
    assert set(skipped) == {"fp16"} and "fp16" in skipped["fp16"] and "CPU" in skipped["fp16"], skipped
    assert nm.exit_status(out) is None  # a skip is reported, not a failure
    from distbench.report import numerics as render

    assert "1 skipped" in render.summary(out) and any("SKIPPED" in r for r in render.verdict_rows(out)[4])


def test_a_change_to_one_recipe_is_caught_there_and_named_with_its_step():
    """Head moves the loss only where a step accumulates: `--numerics default` (the default step alone) reads
    identical, the recipe set names the accumulation recipe, the configuration and the first step, and exits
    EXIT_DIVERGED."""
    ask = FakeVariants(broken=lambda cfg, resume_at: cfg.accum_steps > 1)
    only_default = nm.compare_variants(
        [("ddp ws2", _config())], ask, recipes=("default",), steps=4, repeats=0
    )
    assert [o.kind for o in only_default] == [nm.IDENTICAL] and nm.exit_status(only_default) is None
    out = nm.compare_variants([("ddp ws2", _config())], ask, steps=4, repeats=0)
    diverged = [o for o in out if o.kind == nm.DIVERGED]
    assert [o.recipe for o in diverged] == ["accumulation"], [(o.recipe, o.kind) for o in out]
    assert diverged[0].verdict.divergence.step == 2 and diverged[0].verdict.divergence.metric == "loss"
    assert diverged[0].detail.startswith("accumulation on ddp ws2: diverged from step 2: loss")
    assert nm.exit_status(out) == nm.EXIT_DIVERGED


def test_a_resume_that_changes_the_steps_after_it_is_caught():
    out = nm.compare_variants(
        [("ddp ws2", _config())], FakeVariants(broken=lambda cfg, r: r is not None), steps=4, repeats=0
    )
    assert [o.recipe for o in out if o.kind == nm.DIVERGED] == ["resume"]


def test_recipes_flag_and_default_mode():
    import argparse

    assert nm.parse_recipes("all") == tuple(nm.RECIPES)
    assert nm.parse_recipes("fp16, resume") == ("fp16", "resume")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown recipe 'accumulate'.*accumulation"):
        nm.parse_recipes("accumulate")
    assert nm.recipes_of(argparse.Namespace(numerics="default", recipes=("fp16",))) == ("default",)
    assert nm.recipes_of(argparse.Namespace(numerics="only", recipes=("fp16",))) == ("fp16",)


def test_an_old_variant_server_cannot_resume_and_says_so():
    class Old:
        protocol, log = 3, "log"

        def request(self, request, timeout):  # pragma: no cover - must not be reached
            raise AssertionError(request)

    ask = nm.ask_servers({"base": Old(), "head": Old()}, 10)
    reply = ask("head", _config(), 2)
    assert reply["status"] == "error" and "predates numerics resumed runs" in reply["error"]


@pytest.mark.up_to_world_size(2)
def test_the_resume_recipe_in_real_ranks_continues_the_uninterrupted_curve(suite, tmp_path):
    """ddp at 2 ranks, saved after step 2 and resumed in fresh trainers: the resumed steps are bitwise the
    uninterrupted run's (what run_curve joins into one curve), and the resumed part is really trained anew
    (its step count)."""
    cfg = nm.numerics_config(suite.config("ddp", 2), 4)
    whole = nm.curve_of(suite.run_job(2, nm.curve_job, cfg=cfg), "whole")
    saved = suite.run_job(2, nm.curve_job, cfg=cfg.replace(steps=2), save_at=2, checkpoint_dir=str(tmp_path))
    rest = nm.curve_of(suite.run_job(2, nm.curve_job, cfg=cfg, resume_from=str(tmp_path)), "resumed")
    assert len(rest.loss) == 2
    assert nm.curve_of(saved, "saved").loss + rest.loss == whole.loss


def test_a_planted_accumulation_bug_in_real_ranks_is_caught_by_the_recipes_alone(suite):
    """DDP at 2 ranks, head with the accum_drop plant (tests/numerics_plants.py: the gradients accumulated under
    no_sync lost): the default step is bitwise base's, the accumulation recipe diverges from step 0."""

    def ask(side: str, cfg: RunConfig, resume_at: int | None) -> dict[str, Any]:
        plant = "accum_drop" if side == "head" else None
        return {"status": "ok", "curve": suite.run_job(2, numerics_plants.curve, plant=plant, cfg=cfg)[0]}

    out = nm.compare_variants(
        [("ddp ws2", suite.config("ddp", 2, micro_batch=2, global_batch=4))],
        ask,
        recipes=("default", "accumulation"),
        steps=3,
        repeats=0,
    )
    assert [(o.recipe, o.kind) for o in out] == [("default", nm.IDENTICAL), ("accumulation", nm.DIVERGED)]
    assert out[1].verdict.divergence.step == 0, out[1].detail


def _ab_args(*flags: str):
    from distbench.commands import COMMANDS
    from distbench.commands.parser import build_parser

    return build_parser(COMMANDS).parse_args(["ab", "--device", "cpu", *flags])


def test_ab_takes_the_users_configuration_as_run_does(tmp_path):
    """`distbench ab` reads run's recipe flags and --ds-config (one parser function, commands/run.py): they reach
    the configurations its numerics and speed train, the DeepSpeed config only to the strategies that take it."""
    from distbench.commands.ab import configurations

    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"reduce_bucket_size": 1000000}}')
    flags = [
        "-s",
        "ddp,zero2",
        "-n",
        "2",
        "--global-batch",
        "8",
        "--clip-grad-norm",
        "0.5",
        "--dropout",
        "0.1",
    ]
    args = _ab_args(*flags, "--activation-checkpointing", "--lora-rank", "4", "--ds-config", str(ds))
    ddp, zero2 = configurations(args, "cpu", 0)
    for c in (ddp, zero2):
        assert (c.global_batch, c.accum_steps, c.clip_grad_norm, c.dropout, c.lora_rank) == (
            8,
            2,
            0.5,
            0.1,
            4,
        )
        assert c.activation_checkpointing
    assert ddp.options == {} and zero2.options == {"ds_config": str(ds)}
    plain = configurations(_ab_args("-s", "zero2", "-n", "2"), "cpu", 0)[0]
    assert (plain.clip_grad_norm, plain.accum_steps, plain.options) == (0.0, 1, {})


def test_ab_refuses_a_ds_config_before_any_variant_starts(tmp_path):
    from distbench.commands.ab import configurations
    from distbench.errors import DistbenchError

    with pytest.raises(DistbenchError, match="zero\\* strategies only"):
        configurations(_ab_args("-s", "ddp", "--ds-config", "{}"), "cpu", 0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 3}')  # a key the harness owns, at another value
    with pytest.raises(DistbenchError):
        configurations(_ab_args("-s", "zero2", "-n", "2", "--ds-config", str(bad)), "cpu", 0)
