"""The upgrade gate's numerics over the recipes users train with (gate/numerics.py RECIPES): every recipe runs for
every strategy, each trains what it names, a recipe a strategy cannot run is skipped with its reason, and a change
that breaks one recipe alone is caught there, naming the recipe and the step, where the default step reads
identical."""

from __future__ import annotations

from pathlib import Path
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


def test_both_sides_at_once_come_to_the_same_verdicts():
    broken = FakeVariants(broken=lambda cfg, resume_at: cfg.precision == "fp16")
    one, both = (
        nm.compare_variants([("ddp ws2", _config())], broken, steps=4, repeats=1, at_once=at_once)
        for at_once in (False, True)
    )
    assert [(o.recipe, o.kind, o.detail) for o in one] == [(o.recipe, o.kind, o.detail) for o in both]
    assert [o.recipe for o in both if o.kind == nm.DIVERGED] == ["fp16"]


def test_a_recipe_the_strategy_cannot_run_here_is_skipped_with_its_reason():
    out = nm.compare_variants(
        [("zero2 ws2", _config("zero2"))], FakeVariants(), device="cpu", steps=4, repeats=0
    )
    skipped = {o.recipe: o.skipped for o in out if o.kind == nm.SKIPPED}
    assert set(skipped) == {"fp16"} and "fp16" in skipped["fp16"] and "CPU" in skipped["fp16"], skipped
    assert nm.exit_status(out) is None  # a skip is reported, not a failure
    from distbench.report import numerics as render

    assert "1 skipped" in render.summary(out) and any("SKIPPED" in r for r in render.verdict_rows(out)[4])
    assert "fp16: fp16 compute with dynamic loss scaling" in "\n".join(render.to_markdown(out))


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


@pytest.mark.slow  # real ranks save, stop and resume: 14 s of the default tier's budget
def test_the_resume_recipe_in_real_ranks_continues_the_uninterrupted_curve(suite):
    """run_curve at 2 ddp ranks, saved after step 2 and resumed in fresh trainers: one curve of all the steps,
    bitwise the uninterrupted run's (what a variant whose resume works reports)."""
    cfg = nm.numerics_config(suite.config("ddp", 2), 4)
    pool = suite.pool_manager.pool_for(2)
    whole, resumed = (nm.run_curve(pool, cfg, 600, resume_at) for resume_at in (None, 2))
    assert resumed["status"] == "ok" and len(resumed["curve"]["loss"]) == 4, resumed
    assert resumed["curve"] == whole["curve"]


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


# --- the suite under head (gate/suite_ab.py) -----------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{}</testsuite></testsuites>"""


def _junit(path, cases: dict[str, str]):
    body = {"passed": "", "failed": '<failure message="x"/>', "skipped": '<skipped message="y"/>'}
    xml = "".join(
        f'<testcase classname="tests.test_accumulation" name="{n}">{body[o]}</testcase>'
        for n, o in cases.items()
    )
    path.write_text(JUNIT.format(xml))
    return path


def test_the_suite_names_per_strategy_the_tests_failing_under_head_alone(tmp_path):
    from distbench.gate import suite_ab
    from distbench.report import suite as render
    from distbench.strategies import REGISTRY

    base = suite_ab.read_junit(
        _junit(
            tmp_path / "b.xml",
            {"test_a[ddp-ws2]": "passed", "test_a[zero2-ws2]": "failed", "test_c": "passed"},
        )
    )
    head = suite_ab.read_junit(
        _junit(
            tmp_path / "h.xml",
            {
                "test_a[ddp-ws2]": "failed",
                "test_a[zero2-ws2]": "failed",
                "test_c": "skipped",
                "test_new": "failed",
            },
        )
    )
    c = suite_ab.compare(base, head, REGISTRY)
    assert c.regressions == {
        "ddp": ["tests.test_accumulation::test_a[ddp-ws2]"],
        suite_ab.NO_STRATEGY: ["tests.test_accumulation::test_new"],  # new under head, failing: counted
    }
    assert c.both == {"zero2": ["tests.test_accumulation::test_a[zero2-ws2]"]} and not c.fixed
    assert c.exit_code == nm.EXIT_DIVERGED and c.counts["head"] == {"passed": 0, "failed": 3, "skipped": 1}
    assert "2 test(s) fail under head and pass under base" in render.to_markdown(c, "b", "h")
    same = suite_ab.compare(base, base, REGISTRY)
    assert same.exit_code == 0 and not same.regressions and same.both
    with pytest.raises(ValueError, match="not a JUnit XML"):
        suite_ab.read_junit(tmp_path / "missing.xml")


def test_the_suite_runs_each_side_with_its_own_interpreter_over_the_run(tmp_path):
    from distbench.gate import suite_ab

    cmd = suite_ab.pytest_command("/venv/bin/python", tmp_path / "j.xml", ["ddp", "zero2"], 2, "cpu")
    assert cmd[:3] == ["/venv/bin/python", "-m", "pytest"] and all(m in cmd for m in suite_ab.MODULES)
    assert cmd[cmd.index("--strategies") + 1] == "ddp,zero2" and cmd[cmd.index("--world-sizes") + 1] == "1,2"
    assert "gpu" not in cmd and suite_ab.pytest_command("p", tmp_path, ["ddp"], None, "cuda")[-2:] == [
        "-m",
        "gpu",
    ]
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert all((root / m).is_file() for m in suite_ab.MODULES)  # a renamed module would leave the suite empty


# --- end to end through `distbench ab` -----------------------------------------------------------------------


#: This checkout's code, first on the path of the `distbench ab` processes the tests start.
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _ab(
    out, *flags: str, timeout: float = 900, device: str = "cpu", env: dict[str, str] | None = None
) -> tuple[int, dict, float]:
    """`distbench ab` in its own process (`env` added to its environment): exit status, ab.json (with "cpu_s",
    the CPU seconds it and every process it waited for used), wall seconds."""
    import json
    import os
    import resource
    import subprocess
    import sys
    import time

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    t0, c0 = time.perf_counter(), cpu()
    proc = subprocess.Popen(
        [sys.executable, "-m", "distbench.cli", "ab", "--device", device, "-o", str(out), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH")))),
            **(env or {}),
        },
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: ab closes its variant servers, which run in sessions of their own
        proc.communicate(timeout=120)
        raise
    took, cpu_s = time.perf_counter() - t0, cpu() - c0
    report = json.loads((out / "ab.json").read_text()) if (out / "ab.json").is_file() else {}
    return proc.returncode, {**report, "output": output, "cpu_s": cpu_s}, took


def _planted_head(plant: str) -> str:
    from pathlib import Path

    return f"path={Path(__file__).parent / 'plant_site'},env.{numerics_plants.ENV}={plant}"


@pytest.mark.slow  # two variant servers, 2 + 4 numerics runs of ddp at 2 ranks and 3 speed pairs: 554 s on 2 cores
# at a load average of about 27 (2026-12-02)
def test_ab_recipe_numerics_catch_a_planted_accumulation_bug_the_default_step_misses(tmp_path):
    """The issue's user story with a planted defect: head drops the gradients DDP accumulates under no_sync
    (tests/numerics_plants.py accum_drop). `--numerics default` reads identical and passes; the recipes
    exit EXIT_DIVERGED, naming the accumulation recipe, the configuration and step 0."""
    head = ["-s", "ddp", "-n", "2", "--numerics-steps", "3", "--head", _planted_head("accum_drop")]
    speed = [
        "--min-pairs",
        "3",
        "--max-pairs",
        "3",
        "--budget",
        "1",
    ]  # the speed after it: as short as it goes
    code, report, _ = _ab(tmp_path / "default", *head, "--numerics", "default", *speed)
    (n,) = report["numerics"]
    assert (n["recipe"], n["verdict"]) == ("default", nm.IDENTICAL), report["output"]
    assert code != nm.EXIT_DIVERGED, report["output"]
    code, report, _ = _ab(
        tmp_path / "recipes", *head, "--numerics", "only", "--recipes", "default,accumulation"
    )
    assert code == nm.EXIT_DIVERGED, report["output"]
    default, accumulation = report["numerics"]
    assert default["verdict"] == nm.IDENTICAL and accumulation["verdict"] == nm.DIVERGED
    assert accumulation["divergence"]["step"] == 0
    assert accumulation["detail"].startswith("accumulation on ddp ws2"), accumulation["detail"]


@pytest.mark.slow  # pytest over ddp's accumulation tests at 1-2 ranks, once a side: 987 s on 2 cores at a load
@pytest.mark.nightly  # average of 15-34 (2026-12-02), too long for the per-submission slow tier
def test_ab_suite_names_the_tests_a_planted_accumulation_bug_breaks(tmp_path):
    """`--numerics suite`, narrowed to ddp's accumulation tests (PYTEST_ADDOPTS, which both sides' pytest read):
    under base they pass, under head (accum_drop) they fail, and ab names them under ddp and exits
    EXIT_DIVERGED."""
    code, report, _ = _ab(
        tmp_path,
        *("-s", "ddp", "-n", "2", "--numerics", "suite", "--head", _planted_head("accum_drop")),
        timeout=1200,
        env={"PYTEST_ADDOPTS": "-k 'accumulat and ddp'"},
    )
    assert code == nm.EXIT_DIVERGED, report["output"]
    assert report["counts"]["base"]["passed"] > 0 and report["counts"]["base"]["failed"] == 0, report[
        "counts"
    ]
    assert report["regressions"].get("ddp") and not report["errors"], report
    assert all("ddp" in t for t in report["regressions"]["ddp"]), report["regressions"]


#: The recipe set's budgets (docs/gate.md): on CPU every default strategy at world sizes 1 and 2 with gpt2-tiny; on
#: one GPU every default strategy at one rank with the numerics' GPU workload (commands/ab.py NUMERICS).
CPU_BUDGET_S, GPU_BUDGET_S = 600.0, 300.0


def _whole_recipe_set(tmp_path, device: str, world_sizes: tuple[int, ...], budget: float) -> None:
    """An A/A `distbench ab --numerics only` over the default strategies at each world size: every strategy
    compares every recipe or names why it skips it, all identical or within tolerance, in `budget` seconds in
    all. Writes the table to $DISTBENCH_RECIPES_OUT/summary-<device>.md when set (scripts/gate_recipes.sh), with
    the CPU seconds beside the wall seconds: on a shared machine the wall time says how loaded it was."""
    import os
    from pathlib import Path

    rows, total = [], 0.0
    for ws in world_sizes:
        out = tmp_path / f"ws{ws}"
        code, report, took = _ab(out, "-n", str(ws), "--numerics", "only", timeout=3 * budget, device=device)
        total += took
        assert code == 0, report["output"]
        by_config: dict[str, set[str]] = {}
        for n in report["numerics"]:
            by_config.setdefault(n["config"], set()).add(n["recipe"])
            assert n["verdict"] in (nm.IDENTICAL, nm.WITHIN, nm.SKIPPED), n
            assert n["verdict"] != nm.SKIPPED or n["skipped"], n
        assert by_config and all(recipes == REQUIRED for recipes in by_config.values()), by_config
        kinds = [n["verdict"] for n in report["numerics"]]
        compared = len(kinds) - kinds.count(nm.SKIPPED)
        skips = sorted(
            {f"{n['recipe']} ({n['config'].split()[0]})" for n in report["numerics"] if n["skipped"]}
        )
        cpu_s = report["cpu_s"]
        rows.append(
            f"| {ws} | {len(by_config)} | {compared} | {', '.join(skips) or '-'} | {took:.0f} | {cpu_s:.0f} |"
        )
    head = "| World size | Strategies | Recipes compared | Skipped | Wall s | CPU s |"
    table = [head, "|---|---|---|---|---|---|", *rows]
    load = os.getloadavg()[0]
    table.append(
        f"\n{device}: {total:.0f} s in all against a budget of {budget:.0f} s (load average {load:.1f})."
    )
    if os.environ.get("DISTBENCH_RECIPES_OUT"):
        Path(os.environ["DISTBENCH_RECIPES_OUT"], f"summary-{device}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    assert total <= budget, "\n".join(table)


@pytest.mark.nightly  # the whole recipe set at two world sizes: 55 s on an idle 2-core machine, far more loaded
def test_the_whole_recipe_set_fits_its_cpu_budget(tmp_path):
    _whole_recipe_set(tmp_path, "cpu", (1, 2), CPU_BUDGET_S)


@pytest.mark.gpu
@pytest.mark.exclusive
@pytest.mark.nightly_gpu(1, "the whole recipe set of every default strategy: about 5 min of its own")
def test_the_whole_recipe_set_fits_its_gpu_budget(tmp_path):
    _whole_recipe_set(tmp_path, "cuda", (1,), GPU_BUDGET_S)
