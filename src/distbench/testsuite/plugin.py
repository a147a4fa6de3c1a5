"""pytest plugin: markers, options, tier-aware parametrization and the `suite` fixture.

A test that takes `strategy` and/or `world_size` arguments is generated for both tiers:
`test_loss_parity[zero3-ws2]` runs on CPU with gloo and a tiny model; `test_loss_parity[zero3-ws2-gpu]` is
marked `gpu` and runs on CUDA with NCCL and a GPU-size model. Plain `pytest` deselects the gpu tier
(addopts `-m 'not gpu'`); `pytest -m gpu` selects it. Cases that cannot run here skip with the reason.
With GPUs the session runs in lanes (schedule.py plans them, lanes.py runs them): child pytest processes side
by side, several on each GPU as memory and host cores allow, `exclusive` tests alone last. A claim about time
that the machine's noise cannot decide ends as UNDECIDED (claims.py): reported with its interval and reason,
never a failure and never a pass.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..config import PositiveFloat, PositiveInt, parse_list, parse_value
from ..errors import ConfigError
from ..runtime import terminate
from ..runtime.phases import PhaseLog
from ..runtime.pool import cuda_device_count
from ..runtime.shelf import Shelf
from ..runtime.worker import LEFTOVER_BYTES
from ..strategies import REGISTRY, get_spec
from ..workloads.models import check_model_name
from . import goldens
from .claims import UNDECIDED_KEY, Undecided
from .schedule import Case, Plan, plan, seats_per_device
from .session_watch import LEFT_KEY, SessionWatch, undecided_of
from .suite import TIER_DEFAULTS, Suite

TIERS = (("cpu", ""), ("cuda", "-gpu"))
OPTIONS = pytest.StashKey[dict[str, Any]]()
PHASES = pytest.StashKey[PhaseLog]()  # the session's phase table, shared by both tiers' suites
WATCH = pytest.StashKey[SessionWatch]()
SESSION = pytest.StashKey[dict[str, Any]]()  # session_facts
SESSION_ENV = "DISTBENCH_SESSION"  # session_facts, as a lane receives them
SIGTERM_BEFORE = pytest.StashKey[Any]()  # the SIGTERM handler before ours (runtime/terminate.py)
#: pytest cache keys: each test's seconds and its lane's device memory per rank in the last session, which
#: order the next session's units and size its seats
DURATIONS_KEY, PEAKS_KEY = "distbench/durations", "distbench/rank_peak_bytes"
#: A test's expected cost, relative to others, when neither pytest's cache nor distbench_durations has it (a new
#: test on a fresh runner): the lanes start the costliest groups first, so that none is left alone at the end.
#: Measured on one H200 in lanes: a ZeRO-3 test took 19-20 s (its engine builds), the other strategies' 2-7 s.
UNMEASURED_COST = {"zero3": 4.0, "zero3_offload": 4.0}


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
        "lanes_per_device": _parse_lanes_per_device(config.getoption("--lanes-per-device")),
        "solo": _parse_choice(config.getoption("--solo"), "--solo", ("auto", "on", "off")),
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


def _parse_choice(text: str, option: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise ConfigError(f"{option} {text!r}: use {', '.join(choices)}")
    return text


def _parse_lanes_per_device(text: str) -> str | int:
    """auto, or how many lanes may share one device slot."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--lanes-per-device {text!r}: use auto, or a number of lanes (1 or more)")
    return int(text)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "distbench_durations",
        "JSON of each test's seconds in a tier run (scripts/tier_durations.py): the lanes' plan on a runner "
        "whose pytest cache has no figures of its own yet",
        default="",
    )
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
        "--timeline-json",
        default=None,
        help="also write when each test ran: its start and end in seconds from the session's first test, in "
        "order (which tests overlapped in lanes, and what the lanes ended on)",
    )
    g.addoption(
        "--lanes",
        default="auto",
        help="run the session's tests in lanes, child pytest processes side by side on the GPUs "
        "(several per GPU, --lanes-per-device), `exclusive` tests alone last: auto (on with GPUs when 2+ "
        "lanes would run at once), off, or N device slots (the first N GPUs; without GPUs: N CPU slots)",
    )
    g.addoption(
        "--lanes-per-device",
        default="auto",
        help="how many lanes may share one device slot: auto (on a GPU as many as fit in 80%% of its "
        "memory at the tests' measured or estimated peak per rank, with 2 host cores per rank; on a "
        "CPU slot 1), or N",
    )
    g.addoption(
        "--solo",
        default="auto",
        help="under lanes on 2+ device slots, run the one-rank `exclusive` tests (device time, memory, kernels) "
        "in a lane of their own on the last slot, once the lanes of several ranks are done, while one-rank "
        "lanes go on on the other slots, instead of alone after every lane: auto (on with GPUs), on, or off",
    )
    g.addoption(
        "--lane-timeout",
        default=None,
        help="seconds one test may run in a lane before its process is "
        "killed and the test fails (default 3 x --job-timeout)",
    )
    g.addoption(
        "--update-goldens",
        action="store_true",
        help="write the golden loss and gradient-norm curves of this machine class "
        "(tests/goldens/, docs/numerics.md) instead of comparing with them; each golden records what moved, "
        "between which versions, and the summary lists it",
    )
    g.addoption("--distbench-lane", default=None, help=argparse.SUPPRESS)  # set by lanes.py in a lane process


#: The markers the plugin registers (the docs' pytest reference lists them with pyproject.toml's).
MARKERS = (
    "gpu: GPU tier (NCCL, GPU-size models); run with `pytest -m gpu`",
    "world_size(n): the test needs n ranks",
    "strategies(*names): restrict a strategy-parametrized test to these",
    "exclusive(quiet_host=False): measures time or memory of the machine; under lanes it runs last, with nothing "
    "else running (one-rank ones on 2+ GPUs in the solo lane, beside other GPUs' lanes, unless quiet_host)",
    "up_to_world_size(n): what the test checks does not change past n ranks (a recipe beside the sharding, "
    "not the sharding): the tier's larger default world sizes skip it, --world-sizes naming them runs it",
    "default_cases(*ids): the CPU cases (e.g. 'ddp-ws2') the default tier runs of a strategy-parametrized "
    "test; its other CPU cases repeat what these show and run nightly (`pytest -m nightly`), unless "
    "--strategies or --world-sizes names them",
)


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    config.stash[SIGTERM_BEFORE] = terminate.install()  # a cancelled CI job cleans up as after Ctrl-C
    try:
        config.stash[OPTIONS] = _parse_options(config)
    except ConfigError as e:  # a usage error, not an INTERNALERROR: one line with the fix
        raise pytest.UsageError(str(e)) from None
    lane_dir = config.getoption("--distbench-lane")
    if lane_dir:
        from .lane_child import LANE_POOL_ENV, LANE_WARM_ENV, LaneReporter

        reporter = LaneReporter(
            config, Path(lane_dir), config.stash.setdefault(PHASES, PhaseLog()), lambda: close_suites(config)
        )
        config.pluginmanager.register(reporter, "distbench-lane")
        config.add_cleanup(reporter.close)
        if os.environ.get(LANE_POOL_ENV):  # its ranks start (imports, CUDA, NCCL) while this process collects
            device_type, world_size = os.environ[LANE_POOL_ENV].split(":")
            suite = session_suite(config, device_type)
            suite.pool_manager.pool_for(int(world_size)).spawn()
            if os.environ.get(LANE_WARM_ENV):
                reporter.warm = lambda: warm_pool(suite, int(world_size))


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Known environment breakages (`distbench doctor`), up front: a DeepSpeed op build failing in every rank
    on TORCH_CUDA_ARCH_LIST=9.0a reads as a strategy bug otherwise."""
    import importlib.util
    import os

    from ..doctor import FAIL, WARN, check_cuda_arch_list, check_multicast

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
    up_to = metafunc.definition.get_closest_marker("up_to_world_size")
    chosen = metafunc.config.stash[OPTIONS]["strategies"] or metafunc.config.stash[OPTIONS]["world_sizes"]
    default_cases = metafunc.definition.get_closest_marker("default_cases")
    nightly = (
        set() if chosen or default_cases is None else _nightly_cases(metafunc, selected, default_cases.args)
    )
    params = []
    for device_type, suffix in TIERS:
        if gpu_only and device_type == "cpu":
            continue
        tier = [device_type] if with_tier else []
        for ws in _tier_world_sizes(metafunc.config, device_type):
            marks = [pytest.mark.gpu] if device_type == "cuda" else []
            if up_to and ws > up_to.args[0] and not metafunc.config.stash[OPTIONS]["world_sizes"]:
                marks.append(pytest.mark.skip(reason=beyond_reason(up_to.args[0], ws)))
            if "strategy" in names:
                for s in selected:
                    spec = REGISTRY[s]
                    if spec.max_world_size is not None and ws > spec.max_world_size:
                        continue
                    case = f"{s}-ws{ws}"
                    later = [pytest.mark.nightly] if device_type == "cpu" and case in nightly else []
                    params.append(pytest.param(*tier, s, ws, id=f"{case}{suffix}", marks=marks + later))
            else:
                params.append(pytest.param(*tier, ws, id=f"ws{ws}{suffix}", marks=marks))
    metafunc.parametrize(argnames, params)


def _nightly_cases(metafunc: pytest.Metafunc, strategies: list[str], default: tuple[str, ...]) -> set[str]:
    """The test's CPU cases not in `default` (a default_cases mark); a name there that is no case of the test
    (a typo, or a strategy since restricted away) stops collection, named, rather than run nothing."""
    cases = {f"{s}-ws{ws}" for s in strategies for ws in TIER_DEFAULTS["cpu"]["world_sizes"]}
    unknown = sorted(set(default) - cases)
    if unknown:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: default_cases names no case {unknown}")
    return cases - set(default)


def beyond_reason(up_to: int, world_size: int) -> str:
    """Why a test marked up_to_world_size skips its larger default world sizes, and how to run them."""
    return (
        f"what this test checks does not change past {up_to} ranks, which it ran at; "
        f"`--world-sizes {world_size}` runs it here"
    )


def _params(item: pytest.Item) -> dict[str, Any]:
    """The item's parameters, less those of an empty parameter set (a --strategies or --world-sizes filter that
    leaves a test none, which pytest collects once with NOTSET values and skips)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    return {k: v for k, v in params.items() if type(v).__name__ != "NotSetType"}


def item_device_type(item: pytest.Item) -> str:
    return str(_params(item).get("device_type", "cuda" if item.get_closest_marker("gpu") else "cpu"))


def item_world_size(item: pytest.Item) -> int:
    """The ranks (GPUs on the gpu tier) a test needs: its world_size parameter or marker, else 1."""
    marker = item.get_closest_marker("world_size")
    return int(_params(item).get("world_size") or (marker.args[0] if marker else 1))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (torch, every test module and item), as each rank does after its imports
    (runtime/worker.py): a full collection in this process, which DDP's and DeepSpeed's teardown and every
    in-process benchmark run, then scans only what the test made. Unfrozen, one took 0.29 s over the CPU
    tier's 384k collected objects (2-core host), and the tier's in-process benchmarks, three collections
    each, spent most of their time in them."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip what this machine cannot run, with the reason. That reason goes before any skip the parametrization
    chose (up_to_world_size): pytest reports the first, and "needs 4 CUDA devices" is the truth on a machine
    that has fewer, not "--world-sizes 4 runs it here"."""
    n_cuda: int | None = None
    for item in items:
        params = _params(item)
        device_type = item_device_type(item)
        ws = item_world_size(item)
        reason = None
        if device_type == "cuda":
            n_cuda = cuda_device_count() if n_cuda is None else n_cuda
            if n_cuda == 0:
                reason = "gpu tier: no CUDA device on this machine"
            elif ws > n_cuda:
                reason = f"needs {ws} CUDA devices, this machine has {n_cuda}"
        strategy = params.get("strategy")
        if reason is None and strategy:
            reason = get_spec(strategy).unsupported_reason(device_type, ws)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason), append=False)
    if n_cuda is not None and n_cuda >= 2 and not config.stash[OPTIONS]["world_sizes"]:
        for item in one_gpu_repeats(items):
            item.add_marker(pytest.mark.skip(reason=ONE_GPU_REPEAT), append=False)
    if not config.stash[OPTIONS]["world_sizes"]:
        for item, why in nightly_gpu_cases(items):
            item.add_marker(pytest.mark.skip(reason=why), append=False)


def nightly_gpu_cases(items: list[pytest.Item]) -> list[tuple[pytest.Item, str]]:
    """The GPU cases a `nightly_gpu(from_world_size, why)` mark leaves to the nightly GPU job, each with its
    skip reason (`why` and how to run it here); none already skipped, whose reason is the truer one."""
    out = []
    for item in items:
        mark = item.get_closest_marker("nightly_gpu")
        ws = item_world_size(item)
        if mark and item_device_type(item) == "cuda" and ws >= mark.args[0] and _runs(item):
            out.append(
                (item, f"{mark.args[1]}; `--world-sizes {ws}` runs it here (the nightly GPU job does)")
            )
    return out


def _runs(item: pytest.Item) -> bool:
    """Whether nothing has marked the item to skip yet."""
    return not any(m.name == "skip" for m in item.iter_markers())


#: Why a one-GPU case skips where two GPUs are (one_gpu_repeats), and where it runs.
ONE_GPU_REPEAT = (
    "on 2+ GPUs its world-size-2 case runs the same CUDA kernels with NCCL collectives, and the CPU tier runs "
    "its one-rank path; `--world-sizes 1,2` runs it here (the nightly GPU job does)"
)


def one_gpu_repeats(items: list[pytest.Item]) -> list[pytest.Item]:
    """The GPU cases at world size 1 whose world-size-2 case of the same test, strategy and other parameters
    also runs, for strategies the CPU tier runs too: a third of the 2-GPU tier's time repeated what world size 2
    shows (1,116 of 3,327 s on 2x H200), and the one-rank branches it adds are the CPU tier's. Strategies with
    no CPU tier (FSDP1, FSDP2 offload) and those with no second rank (single) keep theirs."""

    def key(item: pytest.Item, params: dict[str, Any]) -> tuple[str, str]:
        rest = {k: v for k, v in params.items() if k != "world_size"}
        return item.nodeid.split("[")[0], repr(sorted(rest.items()))

    gpu = [(it, p) for it in items if (p := _params(it)).get("strategy") and item_device_type(it) == "cuda"]
    at_two = {key(it, p) for it, p in gpu if p.get("world_size") == 2 and _runs(it)}
    return [
        it
        for it, p in gpu
        if p.get("world_size") == 1 and _runs(it) and get_spec(p["strategy"]).cpu and key(it, p) in at_two
    ]


def _cache_get(config: pytest.Config, key: str) -> dict[str, float]:
    """A dict of numbers the last session left in pytest's cache; {} without a cache or with a damaged one."""
    cache = getattr(config, "cache", None)
    value = cache.get(key, {}) if cache is not None else {}
    if not isinstance(value, dict):
        return {}
    return {k: float(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _committed_durations(config: pytest.Config) -> dict[str, float]:
    """The tests' seconds from the file the ini option distbench_durations names (relative to the rootdir);
    {} when none is named. A file that is missing or not a JSON object of numbers stops the session, named."""
    name = str(config.getini("distbench_durations") or "")
    if not name:
        return {}
    path = config.rootpath / name
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise pytest.UsageError(f"distbench_durations: cannot read {path}: {e}") from None
    if not isinstance(table, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in table.values()
    ):
        raise pytest.UsageError(
            f"distbench_durations: {path} is not a JSON object of test ids and seconds "
            "(write it with scripts/tier_durations.py)"
        )
    return {str(k): float(v) for k, v in table.items()}


def _case(item: pytest.Item, durations: dict[str, float]) -> Case:
    """An item as the scheduler sees it; its group is its strategy (a strategy's cases share the session's
    cached checkpointed runs) or else its module (module fixtures); its cost, its last duration when known,
    else its group's UNMEASURED_COST."""
    params = _params(item)
    strategy = params.get("strategy") or params.get("strategy_name")
    group = strategy or item.nodeid.split("::")[0]
    exclusive = item.get_closest_marker("exclusive")
    return Case(
        item.nodeid,
        item_world_size(item),
        str(group),
        exclusive=bool(exclusive),
        quiet_host=bool(exclusive and exclusive.kwargs.get("quiet_host")),
        reads_any=not strategy,
        inert=bool(item.get_closest_marker("skip")),
        cost=durations.get(item.nodeid, UNMEASURED_COST.get(str(group), 1.0)),
        device_type=item_device_type(item),
    )


def _rank_peak_estimate(config: pytest.Config, cases: list[Case], peaks: dict[str, float]) -> float:
    """Device bytes a rank of the lanes' cases may hold at its peak: the mean of those measured in earlier
    sessions, since seats run that many cases at once and a few large ones seldom meet (the lanes hand out no
    work while a GPU is nearly full, and a case that runs out of memory beside others runs again alone); with
    none measured, 16 bytes per parameter of the tier's largest model (fp32 weights, gradients and Adam's two
    moments) times 1.5 for activations and buffers, plus 2 GiB for the CUDA context and NCCL. A case shorter
    than the GPU watch's sampling period is never measured: on an H200, 196 of about 200 were, and taking the
    largest measured peak (18-20 GiB) whenever any was missing cut the next session from 8 lanes to 5 or 6,
    where 8 had held at most 56 of 140 GiB (the mean was 5.5 GiB)."""
    measured = [peaks[c.nodeid] for c in cases if c.nodeid in peaks]
    if measured:
        return statistics.fmean(measured)
    from ..workloads import get_model

    models = config.stash[OPTIONS]["models"] or TIER_DEFAULTS["cuda"]["models"]
    n = max(get_model(m).param_count() for m in models)
    return 16 * n * 1.5 + 2 * 2**30


def _gpu_memory_bytes() -> int | None:
    """The smallest visible GPU's memory, from NVML; None without it."""
    from ..machine import nvml
    from .lane_watch import visible_handles

    nv = nvml()
    if nv is None:
        return None
    handles = visible_handles(nv)
    try:
        return min(int(nv.nvmlDeviceGetMemoryInfo(h).total) for h in handles) if handles else None
    except Exception:
        return None


def _lane_plan(session: pytest.Session) -> tuple[Plan, bool] | None:
    """The session's lane plan and whether its devices are GPUs; None to run everything here."""
    cfg = session.config
    opts = cfg.stash[OPTIONS]
    mode = opts["lanes"]
    if mode == "off":
        return None
    durations = {**_committed_durations(cfg), **_cache_get(cfg, DURATIONS_KEY)}
    cases = [_case(it, durations) for it in session.items]
    gpus = any(
        item_device_type(it) == "cuda" for it, c in zip(session.items, cases, strict=True) if not c.inert
    )
    if mode == "auto":
        if not gpus:  # the CPU tier: lanes cost more than they give on 2 cores (docs/gpu-tier.md)
            return None
        devices = cuda_device_count()
    else:
        devices = int(mode)
        if gpus and devices > cuda_device_count():
            pytest.exit(
                f"--lanes {devices}: this machine has {cuda_device_count()} CUDA devices", returncode=4
            )
    seats = opts["lanes_per_device"] if opts["lanes_per_device"] != "auto" else 1
    if gpus and opts["lanes_per_device"] == "auto":
        shared = [c for c in cases if not (c.inert or c.exclusive)]
        peak = _rank_peak_estimate(cfg, shared, _cache_get(cfg, PEAKS_KEY)) if shared else None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        seats = seats_per_device(devices, _gpu_memory_bytes(), peak, cores)
    p = plan(cases, devices, seats, solo=opts["solo"] == "on" or (opts["solo"] == "auto" and gpus))
    return (p, gpus) if p.worth_it else None


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
    watch = cfg.stash[WATCH] = SessionWatch()
    cfg.pluginmanager.register(watch, "distbench-session-watch")
    if any(item_device_type(it) == "cuda" for it in session.items):
        watch.gpu.start()
    decision = _lane_plan(session)
    if decision is None:
        return None
    from .lanes import LaneRunner

    p, gpus = decision
    reporter = cfg.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"distbench lanes on {p.devices} {'GPU' if gpus else 'slot'}(s), up to {p.seats} per device: "
            f"{len(p.first)} skipped here, then {len(p.units)} units of work in up to {p.lanes_at_once} "
            f"lanes at once"
            + (f", {len(p.solo.nodeids)} one-rank exclusive on a device of their own" if p.solo else "")
            + f", then {len(p.alone)} exclusive alone"
        )
    opts = cfg.stash[OPTIONS]
    facts = {k: v for k, v in session_facts(cfg).items() if k != "owner"}
    shelves = [Shelf(Path(facts["shelf"]) / dt) for dt in ("cpu", "cuda")]

    def group_done(group: str) -> None:
        """A strategy's tests are all done: its shelved runs and checkpoints go (gigabytes on GPUs)."""
        if group in REGISTRY:
            t0 = time.perf_counter()
            watch.shelf_freed += sum(s.drop(group) for s in shelves)
            watch.shelf_drop_s += time.perf_counter() - t0

    runner = LaneRunner(
        session,
        p,
        gpus,
        opts["lane_timeout"] or 3 * opts["job_timeout"],
        cfg.stash.setdefault(PHASES, PhaseLog()),
        watch.occupancy,
        watch.gpu,
        {SESSION_ENV: json.dumps(facts)},
        group_done,
        _warm_up(session, p.alone),
    )
    watch.lanes = runner.stats
    try:
        runner.run()
    finally:
        watch.shelf_left = sum(s.size() for s in shelves)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Tests this process runs itself count in the session's occupancy (lanes' tests are counted from their
    events; their reports are replayed here without this hook). The GPU watch pauses while an `exclusive`
    test runs: it measures the machine, and each NVML query is a call into the driver beside its timed steps."""
    watch = item.config.stash.get(WATCH, None)
    if watch is None or item.config.getoption("--distbench-lane"):
        return (yield)
    exclusive = item.get_closest_marker("exclusive") is not None
    watch.occupancy.start(item.nodeid)
    watch.gpu.paused = exclusive
    try:
        return (yield)
    finally:
        watch.gpu.paused = False
        watch.occupancy.finish(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A claim the machine could not decide (claims.Undecided) is reported as UNDECIDED: skipped in junit
    with its interval and reason, counted apart in the summary, and it does not fail the session."""
    rep = yield
    if call.excinfo is not None and call.excinfo.errisinstance(Undecided):
        why = str(call.excinfo.value)
        path, lineno, _ = item.reportinfo()
        rep.outcome = "skipped"
        rep.longrepr = (str(path), (lineno or 0) + 1, f"UNDECIDED: {why}")
        rep.user_properties.append((UNDECIDED_KEY, why))
    return rep


def pytest_report_teststatus(report: Any, config: pytest.Config) -> tuple[str, str, str] | None:
    if undecided_of(report) is not None and report.when == "call":
        return "undecided", "U", "UNDECIDED"
    return None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the GPU watch; leave each test's seconds and its lane's device memory per rank to the next
    session's plan (pytest's cache)."""
    cfg = session.config
    watch = cfg.stash.get(WATCH, None)
    if watch is None or cfg.getoption("--distbench-lane"):
        return
    watch.gpu.stop()
    cache = getattr(cfg, "cache", None)
    if cache is None:
        return
    if watch.durations:
        cache.set(DURATIONS_KEY, {**_cache_get(cfg, DURATIONS_KEY), **watch.durations})
    if watch.lanes is not None and watch.lanes.peak_bytes:
        sizes = {it.nodeid: item_world_size(it) for it in session.items}
        per_rank = {t: b / sizes.get(t, 1) for t, b in watch.lanes.peak_bytes.items()}
        cache.set(PEAKS_KEY, {**_cache_get(cfg, PEAKS_KEY), **per_rank})


#: seconds of the session's end (rank pools closed, shelf removed) past which pytest_unconfigure says so
END_SAY_S = 2.0

SUITES = pytest.StashKey[dict[str, Suite]]()  # this process's Suite per device type


def session_suite(cfg: pytest.Config, device_type: str) -> Suite:
    """This process's Suite for a tier, made on first use (by a test, by a lane starting its first pool, or by
    the warm-up of the exclusive tests' pools while the lanes end) and closed with the session."""
    suites = cfg.stash.setdefault(SUITES, {})
    if device_type not in suites:
        opts = cfg.stash[OPTIONS]
        facts = session_facts(cfg)
        suites[device_type] = Suite(
            device_type,
            steps=opts["steps"],
            timeout=opts["job_timeout"],
            models=opts["models"] or [],
            shelf=Shelf(Path(facts["shelf"]) / device_type),
            phases=cfg.stash.setdefault(PHASES, PhaseLog()),
        )
    return suites[device_type]


def warm_pool(suite: Suite, world_size: int) -> None:
    """One short benchmark in the suite's pool of `world_size` (CUDA context, first kernels, the libraries'
    handles: about 10 s of a pool's first test on an H200). A failure is left to the test that next uses the
    pool, which reports it."""
    from ..matrix import run_benchmark

    try:
        run_benchmark(
            suite.pool_manager.pool_for(world_size),
            suite.bench_config("ddp", world_size, steps=1, warmup=0),
            nvml=False,
        )
    except Exception:
        return


def _warm_up(session: pytest.Session, nodeids: list[str]) -> Callable[[], threading.Thread]:
    """Start the pools the exclusive tests `nodeids` will use, and run one short benchmark in each: their
    ranks' start, imports, CUDA context and first kernels (about 15 s of the first exclusive test on an H200)
    then overlap the lanes' last tests instead of following them. The ranks are spawned here, on the session's
    thread (they die with the thread that spawned them), the rest in the thread returned. A failure is left
    to the test that next uses the pool, which reports it."""
    wanted = set(nodeids)
    needs = sorted(
        {
            (item_device_type(it), item_world_size(it))
            for it in session.items
            if it.nodeid in wanted and "suite" in getattr(it, "fixturenames", ())
        }
    )

    def start() -> threading.Thread:
        pools = []
        for device_type, ws in needs:
            suite = session_suite(session.config, device_type)
            try:
                suite.pool_manager.pool_for(ws).spawn()
            except Exception:
                continue
            pools.append((suite, ws))

        def warm() -> None:
            for suite, ws in pools:
                warm_pool(suite, ws)

        thread = threading.Thread(target=warm, name="distbench-warm-up", daemon=True)
        thread.start()
        return thread

    return start


@pytest.fixture(scope="session")
def _suites(request: pytest.FixtureRequest) -> Callable[[str], Suite]:
    return lambda device_type: session_suite(request.config, device_type)


def session_facts(config: pytest.Config) -> dict[str, Any]:
    """What every process of the session shares: the shelf directory (runs and checkpoints every lane reads;
    removed at the session's end) and the session's GPU count. A lane reads them from its parent."""
    facts = config.stash.get(SESSION, None)
    if facts is None:
        if config.getoption("--distbench-lane"):
            facts = json.loads(os.environ[SESSION_ENV])
        else:
            facts = {
                # the default temp directory (TMPDIR): on the H200 VM the tier's checkpoints in /dev/shm took
                # tens of GiB of the RAM its 8 lanes needed
                "shelf": tempfile.mkdtemp(prefix="distbench-session-"),
                "gpus": cuda_device_count(),
                "owner": True,
            }
        config.stash[SESSION] = facts
    return facts


def close_suites(config: pytest.Config) -> None:
    """Close this process's suites (their rank pools); a later test would open new ones."""
    for suite in config.stash.get(SUITES, {}).values():
        suite.close()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Close this process's suites, and remove the session's shelf (gigabytes of checkpoints on the GPU tier)
    in the process that made it. First of the unconfigure hooks: after a SIGTERM or Ctrl-C, the terminal
    reporter's hook prints the interrupt, and where the output is gone (`timeout 60 pytest | head`) that
    raises and no later hook runs. A SIGTERM while the pools close still leaves the shelf removed. The shelf
    goes in a thread beside the pools' close: on the 2-GPU tier it held tens of GiB at the end. An end slower
    than END_SAY_S says what it waited on (a command's wall clock includes it)."""
    t0 = time.perf_counter()
    facts = config.stash.get(SESSION, None)
    remover = None
    if facts and facts.get("owner"):
        remover = threading.Thread(
            target=shutil.rmtree, args=(facts["shelf"],), kwargs={"ignore_errors": True}, daemon=True
        )
        remover.start()
    try:
        close_suites(config)
    finally:
        closed = time.perf_counter() - t0
        if remover is not None:
            remover.join()
        terminate.restore(config.stash.get(SIGTERM_BEFORE, None))
    took = time.perf_counter() - t0
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if took > END_SAY_S and reporter is not None and not config.getoption("--distbench-lane"):
        with contextlib.suppress(OSError):  # the output may be gone (`pytest | head`)
            reporter.write_line(
                f"distbench: the session's end took {took:.1f} s: closing its rank pools {closed:.1f} s, "
                "removing its shelved runs and checkpoints beside them"
            )


@pytest.fixture
def device_type(request: pytest.FixtureRequest) -> str:
    """The tier of a test not parametrized by the plugin: cuda when marked gpu, else cpu."""
    return "cuda" if request.node.get_closest_marker("gpu") else "cpu"


@pytest.fixture
def suite(_suites, device_type: str, request: pytest.FixtureRequest) -> Iterator[Suite]:
    """The session's Suite for this test's tier: pools, tier defaults and cached references; the time its jobs
    take is charged to this test in the session's phase table, and device memory its jobs left allocated in
    the pools (a leak every later test of the pool runs beside) to its report (LEFT_KEY). A shared run or
    checkpoint the test wrote into fails its teardown (runtime/shelf.py: they are read-only to tests)."""
    s = _suites(device_type)
    s.current_test = request.node.nodeid
    before = s.held_bytes()
    yield s
    left = s.held_bytes() - before
    if left > LEFTOVER_BYTES:
        request.node.user_properties.append((LEFT_KEY, left))
    s.check_shelved()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Where the session's time went, by phase (runtime/phases.py), what the lanes and the GPUs did, and the
    claims the machine left undecided: the suite's own slowdowns and its noise show here."""
    for path, diff in goldens.UPDATED:
        terminalreporter.write_line(f"golden written: {path}: " + "; ".join(diff))
    log = config.stash.get(PHASES, PhaseLog())
    watch = config.stash.get(WATCH, None)
    if log.by_test and watch is not None and not config.getoption("--distbench-lane"):
        log.add_remainders(watch.durations)  # a session that ran rank jobs: where the rest of its time went
    out = config.getoption("--phases-json")
    if out:
        Path(out).write_text(json.dumps(log.by_test, indent=1, sort_keys=True) + "\n")
    timeline = config.getoption("--timeline-json")
    if timeline and watch is not None and not config.getoption("--distbench-lane"):
        Path(timeline).write_text(json.dumps(watch.timeline(), indent=1) + "\n")
    lines = log.table()
    if lines:
        terminalreporter.write_sep("-", "distbench: time in tests by phase")
        for line in lines:
            terminalreporter.write_line(line)
    if watch is None or config.getoption("--distbench-lane"):
        return
    session_lines = watch.lines()
    if session_lines:
        terminalreporter.write_sep("-", "distbench: lanes and devices")
        for line in session_lines:
            terminalreporter.write_line(line)
    if watch.undecided:
        terminalreporter.write_sep(
            "-", f"distbench: {len(watch.undecided)} claim(s) this machine left undecided"
        )
        for test, why in sorted(watch.undecided.items()):
            terminalreporter.write_line(f"UNDECIDED {test}: {why}")


@pytest.fixture
def save_result(request: pytest.FixtureRequest):
    """Write a result JSON into --results-dir when given (benchmark tests call it with every result)."""
    from ..results import save_result as _save

    out = request.config.getoption("--results-dir")

    def save(result: dict) -> None:
        if out:
            _save(result, out)

    return save
