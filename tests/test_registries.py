"""The strategy registry and the metric registry are complete: every fact another module reads about a
strategy or a metric is in its entry, and an incomplete entry fails here (not on a GPU hours later)."""

from __future__ import annotations

import dataclasses

import pytest

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.invariants.export import EXPORTERS
from distbench.strategies import REGISTRY, default_strategies, get_spec
from distbench.strategies.spec import GRIDS, MemoryLayout, StrategySpec, check_spec
from distbench.workloads import count_params, get_model
from distbench.workloads.models import MODELS


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_strategy_entry_is_complete(name):
    assert check_spec(REGISTRY[name], set(EXPORTERS)) == []


def _planted(**changes) -> StrategySpec:
    return dataclasses.replace(REGISTRY["fsdp_full"], name="planted", **changes)


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"memory": None}, "no memory layout"),
        ({"memory": MemoryLayout(sharded=frozenset({"activations"}))}, "components outside"),
        ({"checkpoint": None}, "no checkpoint format"),
        (
            {"checkpoint": dataclasses.replace(REGISTRY["fsdp_full"].checkpoint, exporter="hdf5")},
            "unknown exporter 'hdf5'",
        ),
        ({"cpu": False}, "GPU only without saying why"),
        ({"cpu": False, "gpu_only_why": "CUDA only", "grids": frozenset({"cpu"})}, "CPU default grid"),
        ({"grids": frozenset({"nightly"})}, "unknown grid"),
        ({"target": "distbench.strategies.fsdp:NoSuchTrainer"}, "does not name a callable"),
        ({"config_check": "distbench.strategies.ds_config:no_such_check"}, "does not name a callable"),
    ],
    ids=[
        "no-memory",
        "bad-component",
        "no-checkpoint",
        "unknown-exporter",
        "gpu-only-why",
        "cpu-grid",
        "grid",
        "target",
        "config-check",
    ],
)
def test_an_incomplete_strategy_entry_fails(changes, needle):
    found = check_spec(_planted(**changes), set(EXPORTERS))
    assert any(needle in f for f in found), found


def test_default_grids_come_from_the_registry():
    """What `distbench run`, asv and `distbench ab` run without flags (seed 004's set on GPUs)."""
    from distbench.matrix import default_matrix

    assert default_strategies("cuda") == ["single", "ddp", "fsdp_full", "fsdp_grad", "zero2", "zero3"]
    assert default_matrix("cpu", 0).strategies == default_strategies("cpu")
    assert default_matrix("cuda", 4).strategies == default_strategies("cuda")
    for grid in GRIDS:
        assert default_strategies(grid), f"grid {grid} is empty"
    with pytest.raises(ValueError, match="unknown grid"):
        default_strategies("nightly")  # type: ignore[arg-type]


def test_the_gpu_nightly_runs_every_strategy_without_listing_them():
    from pathlib import Path

    from distbench.commands.run import _strategies

    assert _strategies("all") == list(REGISTRY)
    gpu = (Path(__file__).resolve().parents[1] / ".github" / "workflows" / "gpu.yml").read_text()
    assert "distbench run\n          --strategy all\n" in gpu


def test_user_options_are_typed():
    spec = get_spec("zero2")
    cfg = RunConfig(strategy="zero2", world_size=1, options={"ds_config": 3})
    with pytest.raises(ConfigError, match="option 'ds_config'"):
        spec.options_for(cfg)
    assert spec.options_for(cfg.replace(options={"ds_config": {"gradient_clipping": 0.5}}))["stage"] == 2
    with pytest.raises(ConfigError, match="has no option 'ds_config'"):
        get_spec("ddp").options_for(cfg.replace(strategy="ddp", options={"ds_config": {}}))


def test_only_strategies_whose_format_reshards_say_so():
    """The resharding and export tests cover strategies whose registry format supports it."""
    for name in ("fsdp_full", "fsdp_grad", "zero2", "zero3"):  # tests/test_checkpoint.py::test_resharding
        assert REGISTRY[name].checkpoint.reshards
    assert not REGISTRY["ddp"].checkpoint.reshards and REGISTRY["ddp"].checkpoint.exporter is None


# --- metrics ---------------------------------------------------------------------------------------------
def _gpu_reply(rank: int) -> dict:
    """What the bench job returns on a GPU rank with every optional measurement present (device time, NVML,
    allocator peaks), so its summary carries every metric the bench job can write."""
    nvml = {
        "throttled": False,
        "throttle_reasons": [],
        "power_capped": False,
        "gpu_util_pct": {"mean": 97.0},
        "sm_clock_mhz": {"median": 1755.0},
        "power_w": {"mean": 600.0},
        "temp_c": {"max": 60.0},
    }
    return {
        "rank": rank,
        "device_type": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "peak_dtype": "bf16",
        "seq_len": 32,
        "n_params": 1000,
        "flops": {"flops_per_token": 6000.0},
        "optimizer_impl": "fused",
        "step_times_s": [0.10, 0.11, 0.10],
        "warmup_step_times_s": [0.2],
        "windows": [{"wall_s": 0.31, "steps": 3, "host_cpu_s": [0.02, 0.03, 0.02]}],
        "losses": [5.0, 4.9, 4.8, 4.7],
        "gc": None,
        "nvml": nvml,
        "memory": {
            "mem_allocated_peak_bytes": 2**30,
            "mem_reserved_peak_bytes": 2**31,
            "nvml_mem_used_peak_bytes": 3 * 2**30,
            "mem_allocated_bytes": 2**29,
            "mem_total_bytes": 2**36,
        },
        "device_time": {
            "compute_s": 0.08,
            "comm_s": 0.01,
            "busy_s": 0.09,
            "wall_s": 0.1,
            "processing_s": 0.5,
            "steps": 3,
        },
    }


class _Pool:
    device_type = "cuda"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def run(self, job, kwargs, timeout):
        return [_gpu_reply(r) for r in range(self.world_size)]


def _every_metric_a_result_carries() -> set[str]:
    """The metric names of results as `distbench run` writes them: the bench job's summary at world sizes 1
    and 2, scaling.annotate's speedup and efficiency, and the trace breakdown the matrix copies in."""
    from distbench import scaling
    from distbench.matrix import run_benchmark
    from distbench.metrics import names

    results = [
        run_benchmark(
            _Pool(ws),
            RunConfig(
                strategy="ddp",
                world_size=ws,
                model="gpt2-tiny",
                global_batch=4,
                micro_batch=2,
                steps=3,
                warmup=1,
            ),
        )
        for ws in (1, 2)
    ]
    scaling.annotate(results)
    carried = {k for r in results for k in r["metrics"]}
    return carried | set(names(source="trace"))


def test_every_metric_a_result_carries_has_a_registry_entry():
    from distbench.metrics import METRICS

    carried = _every_metric_a_result_carries()
    assert {
        "step_time_s",
        "mfu",
        "device_compute_s",
        "step_gcycles",
        "speedup",
        "config_overhead_s",
    } <= carried
    assert carried - set(METRICS) == set(), "metrics without an entry in distbench/metrics.py"


def test_a_metric_without_a_registry_entry_fails(monkeypatch):
    import distbench.results as results
    from distbench.measure.timing import throughput
    from distbench.metrics import METRICS

    monkeypatch.setattr(results, "throughput", lambda *a: {**throughput(*a), "planted_per_s": 1.0})
    assert _every_metric_a_result_carries() - set(METRICS) == {"planted_per_s"}


def test_metric_entries_are_consistent():
    from distbench.metrics import COMPARED, FORMATS, METRICS, fmt_metric, names

    for m in METRICS.values():
        assert m.better in ("higher", "lower") and m.unit and m.description, m.name
        assert m.format in FORMATS, f"{m.name}: unknown format {m.format!r}"
        assert m.ab in ("gate", "gate-host-bound", "device", "report", ""), m.name
    assert COMPARED[:2] == ("tokens_per_s", "step_time_s")
    assert names(ab="gate")[0] == "step_time_s"  # the A/B gate always gates the step time
    assert fmt_metric("step_time_s", 0.0123) == "12.30 ms" and fmt_metric("mfu", 0.4) == "40.0%"
    assert fmt_metric("mem_reserved_peak_bytes", 2**31) == "2.00 GiB" and fmt_metric("unknown", 1.5) == "1.5"


def test_asv_tracks_what_the_registry_says():
    """benchmarks/bench_training.py has one track per asv entry, named, unit'd and versioned as registered,
    recording the lower-is-better form."""
    import importlib
    import sys
    from pathlib import Path

    from distbench.metrics import METRICS

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        bench = importlib.import_module("benchmarks.bench_training")
    finally:
        sys.path.pop(0)
    tracked = [m for m in METRICS.values() if m.asv is not None]
    assert {m.name for m in tracked} >= {"step_time_s", "mfu", "scaling_efficiency", "busbw_gbps"}
    for m in tracked:
        cls, method = m.asv.benchmark.split(".")
        fn = getattr(getattr(bench, cls), method)
        assert fn.unit == m.asv.unit and m.name in fn.version
        assert m.asv_value(2.0) == (2.0 * m.asv.scale if m.better == "lower" else m.asv.scale / 2.0)
        if m.source != "busbw":  # a training track records the lower-is-better form of the result's metric
            cache = {"train": {"ddp/2": {"status": "ok", "metrics": {k: 0.5 for k in METRICS}}}}
            track = getattr(bench, cls)()
            track.setup(cache, "ddp", 2)
            got = getattr(track, method)(cache, "ddp", 2)
            if isinstance(got, dict):  # per-window samples (none here: the figure alone)
                assert got == {"samples": [m.asv_value(0.5)], "number": 1}
            else:
                assert got == m.asv_value(0.5)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_registered_models_parameter_count_is_its_built_models(name):
    """ModelSpec.param_count reads the configuration (the GPU session plans its lanes with it before any
    model code is imported); the model transformers builds from it on the meta device is the reference."""
    spec = MODELS[name]
    assert spec.param_count() == count_params(spec.build(0, "meta"))


def test_a_factorys_parameter_count_is_its_models():
    spec = get_model("user_models:tiny_lm")
    assert spec.param_count() == count_params(spec.build(0, "meta")) > 0
