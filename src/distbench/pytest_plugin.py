"""pytest plugin: markers, options, tier-aware parametrization and the `suite` fixture.

A test that takes `strategy` and/or `world_size` arguments is generated for both tiers:
`test_loss_parity[zero3-ws2]` runs on CPU with gloo and a tiny model; `test_loss_parity[zero3-ws2-gpu]` is
marked `gpu` and runs on CUDA with NCCL and a GPU-size model. Plain `pytest` deselects the gpu tier
(addopts `-m 'not gpu'`); `pytest -m gpu` selects it. Cases that cannot run here skip with the reason.
On 2+ GPUs the session runs in lanes (schedule.py plans them, lanes.py runs them): small world sizes side by
side on disjoint GPUs, `exclusive` tests alone last.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from .config import PositiveFloat, PositiveInt, parse_list, parse_value
from .errors import ConfigError
from .runtime.phases import PhaseLog
from .runtime.pool import cuda_device_count
from .schedule import Case, Plan, plan
from .strategies import REGISTRY, get_spec
from .suite import TIER_DEFAULTS, Suite
from .workloads.models import check_model_name

TIERS = (("cpu", ""), ("cuda", "-gpu"))
OPTIONS = pytest.StashKey[dict[str, Any]]()
PHASES = pytest.StashKey[PhaseLog]()  # the session's phase table, shared by both tiers' suites


def _parse_options(config: pytest.Config) -> dict[str, Any]:
    """The distbench options, validated as `distbench run` validates its flags (ConfigError on a bad one);
    a list option not given is None (the tier's default)."""

    def listed(name: str, annotation: Any, check: Any = None) -> list[Any] | None:
        text = config.getoption(name)
        if text is None:
            return None
        values = parse_list(annotation, text, name)
        if check:
            for v in values:
                check(v)
        return values

    return {
        "strategies": listed("--strategies", str, get_spec),
        "world_sizes": listed("--world-sizes", PositiveInt),
        "models": listed("--models", str, check_model_name),
        "steps": parse_value(PositiveInt, config.getoption("--steps"), "--steps"),
        "job_timeout": parse_value(PositiveFloat, config.getoption("--job-timeout"), "--job-timeout"),
        "lanes": _parse_lanes(config.getoption("--lanes")),
        "lane_timeout": None
        if config.getoption("--lane-timeout") is None
        else parse_value(PositiveFloat, config.getoption("--lane-timeout"), "--lane-timeout"),
    }


def _parse_lanes(text: str) -> str | int:
    """auto, off, or a number of device slots."""
    if text in ("auto", "off"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--lanes {text!r}: use auto, off, or a number of device slots (1 or more)")
    return int(text)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("distbench")
    g.addoption("--strategies", default=None, help="comma-separated strategies to test (default: all)")
    g.addoption(
        "--world-sizes", default=None, help="comma-separated world sizes (default: cpu 1,2; gpu 1,2,4)"
    )
    g.addoption(
        "--models",
        default=None,
        help="comma-separated models for the tier being run (default: cpu gpt2-tiny; gpu gpt2-124m)",
    )
    g.addoption("--steps", default="5", help="optimizer steps per training job (default 5)")
    g.addoption("--job-timeout", default="600", help="seconds before a hung job fails (default 600)")
    g.addoption("--results-dir", default=None, help="also write each benchmark test's result JSON here")
    g.addoption(
        "--phases-json",
        default=None,
        help="also write the session's seconds per test and phase (the phase table's data) to this JSON file",
    )
    g.addoption(
        "--lanes",
        default="auto",
        help="run tests of world sizes smaller than the GPU count side by side "
        "on disjoint GPUs, each lane a pytest process, `exclusive` tests alone last: auto (on with 2+ "
        "GPUs when 2+ lanes would exist), off, or N device slots (without GPUs: N CPU slots)",
    )
    g.addoption(
        "--lane-timeout",
        default=None,
        help="seconds one test may run in a lane before its process is "
        "killed and the test fails (default 3 x --job-timeout)",
    )
    g.addoption("--distbench-lane", default=None, help=argparse.SUPPRESS)  # set by lanes.py in a lane process


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: GPU tier (NCCL, GPU-size models); run with `pytest -m gpu`")
    config.addinivalue_line("markers", "world_size(n): the test needs n ranks")
    config.addinivalue_line("markers", "strategies(*names): restrict a strategy-parametrized test to these")
    config.addinivalue_line(
        "markers",
        "exclusive: measures time or memory of the machine; under lanes it runs "
        "last, with nothing else running",
    )
    try:
        config.stash[OPTIONS] = _parse_options(config)
    except ConfigError as e:  # a usage error, not an INTERNALERROR: one line with the fix
        raise pytest.UsageError(str(e)) from None
    lane_dir = config.getoption("--distbench-lane")
    if lane_dir:
        from .lane_child import LaneReporter

        reporter = LaneReporter(config, Path(lane_dir), config.stash.setdefault(PHASES, PhaseLog()))
        config.pluginmanager.register(reporter, "distbench-lane")
        config.add_cleanup(reporter.close)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Known environment breakages (`distbench doctor`), up front: a DeepSpeed op build failing in every rank
    on TORCH_CUDA_ARCH_LIST=9.0a reads as a strategy bug otherwise."""
    import importlib.util
    import os

    from .doctor import FAIL, WARN, check_cuda_arch_list, check_multicast

    checks = [
        check_cuda_arch_list(os.environ, importlib.util.find_spec("deepspeed") is not None),
        check_multicast(os.environ, cuda_device_count() > 0),
    ]
    return [
        f"distbench: {c.status.upper()} {c.name}: {c.detail}" + (f"; fix: {c.fix}" if c.fix else "")
        for c in checks
        if c.status in (WARN, FAIL)
    ]


def _tier_world_sizes(config: pytest.Config, device_type: str) -> list[int]:
    return config.stash[OPTIONS]["world_sizes"] or list(TIER_DEFAULTS[device_type]["world_sizes"])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "strategy" not in names and "world_size" not in names:
        return
    selected = metafunc.config.stash[OPTIONS]["strategies"] or list(REGISTRY)
    marker = metafunc.definition.get_closest_marker("strategies")
    if marker:  # a test may restrict itself, e.g. @pytest.mark.strategies("ddp", "fsdp_full")
        selected = [s for s in selected if s in marker.args]
    # A test marked gpu is GPU-tier only: generating its CPU-tier cases would run them under `-m gpu` on gloo.
    gpu_only = metafunc.definition.get_closest_marker("gpu") is not None
    # The tier travels as the device_type parameter where the test uses it (through `suite`), else as the
    # gpu mark alone, which the device_type fixture and pytest_collection_modifyitems fall back to.
    with_tier = "device_type" in names
    argnames = [n for n in ("device_type", "strategy", "world_size") if n in names]
    params = []
    for device_type, suffix in TIERS:
        if gpu_only and device_type == "cpu":
            continue
        marks = [pytest.mark.gpu] if device_type == "cuda" else []
        tier = [device_type] if with_tier else []
        for ws in _tier_world_sizes(metafunc.config, device_type):
            if "strategy" in names:
                for s in selected:
                    spec = REGISTRY[s]
                    if spec.max_world_size is not None and ws > spec.max_world_size:
                        continue
                    params.append(pytest.param(*tier, s, ws, id=f"{s}-ws{ws}{suffix}", marks=marks))
            else:
                params.append(pytest.param(*tier, ws, id=f"ws{ws}{suffix}", marks=marks))
    metafunc.parametrize(argnames, params)


def _params(item: pytest.Item) -> dict[str, Any]:
    callspec = getattr(item, "callspec", None)
    return callspec.params if callspec else {}


def item_device_type(item: pytest.Item) -> str:
    return str(_params(item).get("device_type", "cuda" if item.get_closest_marker("gpu") else "cpu"))


def item_world_size(item: pytest.Item) -> int:
    """The ranks (GPUs on the gpu tier) a test needs: its world_size parameter or marker, else 1."""
    marker = item.get_closest_marker("world_size")
    return int(_params(item).get("world_size") or (marker.args[0] if marker else 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_cuda: int | None = None
    for item in items:
        params = _params(item)
        device_type = item_device_type(item)
        ws = item_world_size(item)
        if device_type == "cuda":
            n_cuda = cuda_device_count() if n_cuda is None else n_cuda
            if n_cuda == 0:
                item.add_marker(pytest.mark.skip(reason="gpu tier: no CUDA device on this machine"))
                continue
            if ws > n_cuda:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs {ws} CUDA devices, this machine has {n_cuda}")
                )
                continue
        strategy = params.get("strategy")
        if strategy:
            reason = get_spec(strategy).unsupported_reason(device_type, ws)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def _case(item: pytest.Item) -> Case:
    """An item as the scheduler sees it; its group is its strategy (a strategy's cases share the session's
    cached checkpointed runs, so they go to one lane) or else its module (module fixtures)."""
    params = _params(item)
    group = params.get("strategy") or params.get("strategy_name") or item.nodeid.split("::")[0]
    return Case(
        item.nodeid,
        item_world_size(item),
        str(group),
        exclusive=bool(item.get_closest_marker("exclusive")),
        inert=bool(item.get_closest_marker("skip")),
    )


def _lane_plan(session: pytest.Session) -> tuple[Plan, int, bool] | None:
    """The session's lane plan, its number of device slots and whether they are GPUs; None to run here."""
    mode = session.config.stash[OPTIONS]["lanes"]
    if mode == "off":
        return None
    cases = [_case(it) for it in session.items]
    gpus = any(
        item_device_type(it) == "cuda" for it, c in zip(session.items, cases, strict=True) if not c.inert
    )
    if mode == "auto":
        if not gpus:  # the CPU tier: lanes cost more than they give on 2 cores (README, GPU tier)
            return None
        slots = cuda_device_count()
    else:
        slots = int(mode)
        if gpus and slots > cuda_device_count():
            pytest.exit(f"--lanes {slots}: this machine has {cuda_device_count()} CUDA devices", returncode=4)
    p = plan(cases, slots)
    return (p, slots, gpus) if slots >= 2 and p.worth_it else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """With lanes (--lanes), run the session as lanes.py plans it; otherwise pytest's own loop."""
    cfg = session.config
    if (
        cfg.option.collectonly
        or cfg.getoption("--distbench-lane")
        or (session.testsfailed and not cfg.option.continue_on_collection_errors)
    ):
        return None
    decision = _lane_plan(session)
    if decision is None:
        return None
    from .lanes import LaneRunner

    p, slots, gpus = decision
    reporter = cfg.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        lanes = ", ".join(f"ws{lane.world_size} x{len(lane.nodeids)}" for lane in p.lanes)
        reporter.write_line(
            f"distbench lanes on {slots} {'GPUs' if gpus else 'slots'}: {len(p.first)} skipped "
            f"here, then {len(p.lanes)} lanes side by side ({lanes}), then {len(p.whole)} on every "
            f"slot here, then {len(p.alone)} exclusive alone"
        )
    opts = cfg.stash[OPTIONS]
    LaneRunner(
        session,
        p,
        slots,
        gpus,
        opts["lane_timeout"] or 3 * opts["job_timeout"],
        cfg.stash.setdefault(PHASES, PhaseLog()),
    ).run()
    return True


@pytest.fixture(scope="session")
def _suites(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    cfg = request.config
    suites: dict[str, Suite] = {}

    def get(device_type: str) -> Suite:
        if device_type not in suites:
            opts = cfg.stash[OPTIONS]
            suites[device_type] = Suite(
                device_type,
                steps=opts["steps"],
                timeout=opts["job_timeout"],
                models=opts["models"] or [],
                workdir=tmp_path_factory.mktemp(f"distbench-{device_type}"),
                phases=cfg.stash.setdefault(PHASES, PhaseLog()),
            )
        return suites[device_type]

    yield get
    for s in suites.values():
        s.close()
        if s.workdir is not None:  # session checkpoints: gigabytes on the GPU tier, ours to remove
            shutil.rmtree(s.workdir, ignore_errors=True)


@pytest.fixture
def device_type(request: pytest.FixtureRequest) -> str:
    """The tier of a test not parametrized by the plugin: cuda when marked gpu, else cpu."""
    return "cuda" if request.node.get_closest_marker("gpu") else "cpu"


@pytest.fixture
def suite(_suites, device_type: str, request: pytest.FixtureRequest) -> Suite:
    """The session's Suite for this test's tier: pools, tier defaults and cached references; the time its jobs
    take is charged to this test in the session's phase table."""
    s = _suites(device_type)
    s.current_test = request.node.nodeid
    return s


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Where the session's time went, by phase (runtime/phases.py): the suite's own slowdowns show here."""
    log = config.stash.get(PHASES, PhaseLog())
    out = config.getoption("--phases-json")
    if out:
        Path(out).write_text(json.dumps(log.by_test, indent=1, sort_keys=True) + "\n")
    lines = log.table()
    if lines:
        terminalreporter.write_sep("-", "distbench: time in rank jobs by phase")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def save_result(request: pytest.FixtureRequest):
    """Write a result JSON into --results-dir when given (benchmark tests call it with every result)."""
    from .results import save_result as _save

    out = request.config.getoption("--results-dir")

    def save(result: dict) -> None:
        if out:
            _save(result, out)

    return save
