"""Does it still train to the same loss? The numerics comparison's verdicts and tolerance (gate/numerics.py), the
goldens per machine class (testsuite/goldens.py), and the bites: changes of numerics that every side
of an installation shares, which within-installation parity passes and the comparison catches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import numerics_plants
from distbench.config import RunConfig
from distbench.gate import numerics as nm
from distbench.gate.ab import ABReport
from distbench.invariants.checks import BF16_LOSS_RTOL, assert_losses_match, assert_params_and_grads_match
from distbench.report import gate as render
from distbench.testsuite import goldens

GOLDENS = Path(__file__).parent / "goldens"
#: The golden case's steps: enough for AdamW's moments to have moved the loss (measured: eps x10 from step 1).
GOLDEN_STEPS = 4
#: On CPU the goldens of these strategies: the tier's cheapest of each kind (one process, replicated, sharded);
#: the GPU tier keeps every strategy's.
CPU_GOLDEN_STRATEGIES = ("single", "ddp", "fsdp_full")


def curve(loss, norm=None):
    return nm.Curve(tuple(loss), tuple(norm if norm is not None else loss))


# --- verdicts and tolerance -----------------------------------------------------------------------------------


def test_identical_within_and_diverged():
    base = curve([6.0, 5.9, 5.8], [2.0, 2.1, 2.2])
    tol = nm.tolerance(base, [])
    assert nm.compare(base, base, tol).kind == nm.IDENTICAL
    one_ulp = curve([6.0, 5.9 * (1 + nm.FP32_EPS), 5.8], [2.0, 2.1, 2.2])
    assert nm.compare(base, one_ulp, tol).kind == nm.WITHIN
    moved = curve([6.0, 5.9, 5.8], [2.0, 2.1, 2.2 * (1 + 10 * nm.FP32_EPS)])
    v = nm.compare(base, moved, tol)
    assert v.kind == nm.DIVERGED and (v.divergence.step, v.divergence.metric) == (2, "grad_norm")
    assert "from step 2: grad_norm" in v.describe()


def test_rounding_bound_is_ulps_of_the_value():
    assert nm.rounding_bound((6.0, -2.0)) == [nm.ULPS * nm.FP32_EPS * 6.0, nm.ULPS * nm.FP32_EPS * 2.0]


def test_spread_sets_the_tolerance_where_larger_and_never_shrinks():
    base = curve([6.0, 5.9, 5.8])
    noisy = [curve([6.0, 5.9, 5.8]), curve([6.0, 5.91, 5.8]), curve([6.0, 5.9, 5.8])]
    tol = nm.tolerance(base, noisy)
    assert tol.spread["loss"][0] == 0.0
    assert tol.spread["loss"][1] == pytest.approx(0.01) and tol.spread["loss"][2] == pytest.approx(0.01)
    assert tol.allowed("loss", 2) == pytest.approx(nm.SPREAD_FACTOR * 0.01)
    assert tol.source("loss", 2) == "spread" and tol.source("loss", 0) == "rounding"
    assert nm.compare(base, curve([6.0, 5.9, 5.815]), tol).kind == nm.WITHIN
    assert nm.compare(base, curve([6.0, 5.9, 5.83]), tol).kind == nm.DIVERGED


def test_a_nan_diverges():
    base = curve([6.0, 5.9])
    assert nm.compare(base, curve([6.0, float("nan")]), nm.tolerance(base, [])).kind == nm.DIVERGED


@pytest.mark.parametrize(
    "bad,why", [({"loss": [1.0]}, "grad_norm"), ({"loss": [1.0], "grad_norm": []}, "1 losses and 0")]
)
def test_bad_curves_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        nm.Curve.from_dict(bad, "x.json")


def _report(kinds: list[str], speed: bool = False) -> ABReport:
    base = curve([6.0, 5.9])
    heads = {nm.IDENTICAL: base, nm.DIVERGED: curve([6.0, 5.0])}
    outs = []
    for k in kinds:
        o = nm.NumericsOutcome(f"cfg {k}")
        if k == nm.NOT_COMPARED:
            o.error = "head's numerics run failed"
        else:
            o.base, o.head, o.tolerance = base, heads[k], nm.tolerance(base, [])
            o.verdict = nm.compare(base, o.head, o.tolerance)
        outs.append(o)
    return ABReport([], 0.05, 0.05, 0.02, 0.005, 0.0, False, "b", "h", numerics=outs, speed=speed)


@pytest.mark.parametrize(
    "kinds,code",
    [([nm.IDENTICAL], 0), ([nm.IDENTICAL, nm.DIVERGED], nm.EXIT_DIVERGED), ([nm.NOT_COMPARED], 3)],
)
def test_exit_status_and_report(kinds, code):
    report = _report(kinds)
    assert report.exit_code == code
    md = render.to_markdown(report)
    assert f"(exit {code})" in md and ("| Step | Metric |" in md) == (nm.NOT_COMPARED not in kinds)
    js = render.to_json(report)
    assert [n["verdict"] for n in js["numerics"]] == kinds and js["exit_code"] == code


def test_a_divergence_outranks_a_speed_pass_and_speed_still_counts():
    assert _report([nm.DIVERGED], speed=True).exit_code == nm.EXIT_DIVERGED
    assert _report([nm.IDENTICAL], speed=True).exit_code == 3  # no speed pair ran: undecided, never a pass


# --- goldens ----------------------------------------------------------------------------------------------------


def golden_config(suite, strategy: str, world_size: int) -> RunConfig:
    return nm.numerics_config(suite.config(strategy, world_size), GOLDEN_STEPS)


def run_curve(suite, cfg: RunConfig, job=None, **kw) -> nm.Curve:
    outs = suite.run_job(cfg.world_size, job or nm.curve_job, cfg=cfg, **kw)
    return nm.curve_of(outs, f"{cfg.strategy} ws{cfg.world_size}")


def test_matches_golden(suite, strategy, world_size, request):
    """Every strategy's loss and gradient norm against the golden of this machine class, within the golden's
    tolerance, whatever versions it was written with (a failure names both sides'). A machine class without
    goldens skips, naming the file it looked for; the classes CI runs on have them all
    (test_goldens_cover_the_machine_classes_ci_runs_on)."""
    if suite.device_type == "cpu" and strategy not in CPU_GOLDEN_STRATEGIES:
        pytest.skip(f"CPU tier: goldens of {', '.join(CPU_GOLDEN_STRATEGIES)} only (the GPU tier has all)")
    cfg = golden_config(suite, strategy, world_size)
    hardware, now = goldens.hardware(suite.device_type), goldens.run_versions(suite.device_type)
    path = GOLDENS / goldens.machine_key(hardware) / goldens.file_name(cfg)
    got = run_curve(suite, cfg)
    if request.config.getoption("--update-goldens"):
        noisy = [run_curve(suite, cfg.replace(deterministic=False)) for _ in range(2)]
        tol = nm.tolerance(got, noisy)
        goldens.write(path, goldens.Golden(hardware, now, cfg.to_dict(), got, tol, isa_env=goldens.isa_env()))
        return
    golden, why = goldens.load(path, cfg)
    if golden is None:
        pytest.skip(why)
    failure = goldens.mismatch(golden, got, now, path)
    assert failure is None, f"{strategy} ws{world_size} {failure}"


#: The machine classes CI runs on, and the (strategy, world size) goldens each must hold: the CPU tier's at
#: world sizes 1 and 2 (single at 1 alone) on GitHub's and .ci/run's runners (AVX2 or AVX-512), the GPU
#: tier's on one H200.
CPU_CASES = [(s, n) for s in CPU_GOLDEN_STRATEGIES for n in (1, 2) if (s, n) != ("single", 2)]
CI_CLASSES = {
    "cpu-avx2": CPU_CASES,
    "cpu-avx512": CPU_CASES,
    "nvidia-h200": [
        (s, 1)
        for s in ("single", "ddp", "fsdp_full", "fsdp_grad", "fsdp_hybrid", "fsdp_offload", "fsdp1_full")
        + ("fsdp1_grad", "zero1", "zero2", "zero3", "zero3_offload")
    ],
}


def test_goldens_cover_the_machine_classes_ci_runs_on():
    """test_matches_golden runs, not skips, wherever CI runs: each class's folder holds every golden its tier
    compares, named for the strategy and world size its configuration says."""
    for key, cases in CI_CLASSES.items():
        found = {
            (g.config["strategy"], g.config["world_size"])
            for g in map(goldens.read, sorted((GOLDENS / key).glob("*.json")))
        }
        assert set(cases) <= found, f"{GOLDENS / key}: no golden for {sorted(set(cases) - found)}"


def test_golden_files_name_their_machine():
    """Each committed golden sits under the key of the machine class it records, and is for the configuration
    its name says: a file copied into another machine's folder would otherwise pass for that machine's."""
    files = sorted(GOLDENS.glob("*/*.json"))
    assert files, f"no goldens under {GOLDENS}"
    for f in files:
        g = goldens.read(f)
        assert f.parent.name == goldens.machine_key(g.hardware), f
        assert f.name == goldens.file_name(RunConfig.from_dict(g.config)), f
        assert g.versions.get("torch"), f"{f}: no torch version recorded"


def test_golden_comparison_catches_a_moved_step(tmp_path, monkeypatch):
    """The golden check's own bite: a golden whose step 2 loss moved by 10 ulps fails the comparison, and the
    message names the step, the metric, the old and the new value."""
    monkeypatch.setattr(goldens, "UPDATED", [])  # not the session's: its summary lists real goldens only
    cfg = RunConfig(steps=3)
    got = curve([6.0, 5.9, 5.8], [2.0, 2.1, 2.2])
    path = tmp_path / "k" / goldens.file_name(cfg)
    v = {"torch": "2.13.0"}
    goldens.write(path, goldens.Golden("x", v, cfg.to_dict(), got, nm.tolerance(got, [])))
    assert goldens.UPDATED[-1] == (path, ["new golden"])
    golden, _ = goldens.load(path, cfg)
    assert golden is not None and goldens.mismatch(golden, got, v, path) is None
    moved = curve([6.0, 5.9, 5.8 * (1 + 10 * nm.FP32_EPS)], [2.0, 2.1, 2.2])
    failure = goldens.mismatch(golden, moved, v, path)
    assert failure is not None and f"step 2 loss: 5.8 -> {moved.loss[2]!r}" in failure
    assert "(the same versions)" in failure
    assert goldens.load(path, cfg.replace(steps=4))[0] is None  # another configuration: no golden
    assert "no golden" in goldens.load(tmp_path / "none.json", cfg)[1]
    path.write_text("{")
    with pytest.raises(ValueError, match="not readable"):
        goldens.load(path, cfg)


def test_an_update_records_what_moved_between_which_versions(tmp_path, monkeypatch):
    """--update-goldens over a golden written with other versions: the file keeps its history and appends the
    date, both version sets, how many values moved, the largest move and the digest of the values replaced;
    a rewrite that moves nothing under the same versions adds no entry."""
    monkeypatch.setattr(goldens, "UPDATED", [])
    cfg = RunConfig(steps=2)
    old, new = curve([6.0, 5.9], [2.0, 2.1]), curve([6.0, 5.9 * (1 + 3 * nm.FP32_EPS)], [2.0, 2.1])
    path = tmp_path / goldens.file_name(cfg)
    v1, v2 = {"torch": "2.13.0", "deepspeed": "0.19.8"}, {"torch": "2.14.0", "deepspeed": "0.19.8"}
    goldens.write(path, goldens.Golden("x", v1, cfg.to_dict(), old, nm.tolerance(old, [])))
    diff = goldens.write(
        path, goldens.Golden("x", v2, cfg.to_dict(), new, nm.tolerance(new, [])), "2026-12-02"
    )
    assert diff == ["1 values moved (largest: loss 3 ulps, grad_norm 0 ulps)", "torch 2.13.0 -> 2.14.0"]
    (entry,) = goldens.read(path).history
    assert entry == {
        "date": "2026-12-02",
        "versions_before": v1,
        "versions_after": v2,
        "values_moved": 1,
        "max_abs_diff": {"loss": new.loss[1] - 5.9, "grad_norm": 0.0},
        "max_ulps": {"loss": 3.0, "grad_norm": 0.0},
        "replaced_digest": goldens.curve_digest(old),
    }
    assert goldens.write(path, goldens.Golden("x", v2, cfg.to_dict(), new, nm.tolerance(new, []))) == [
        "nothing moved"
    ]
    assert len(goldens.read(path).history) == 1


def test_a_golden_from_before_versions_left_the_key_reads_them_from_there(tmp_path):
    """The documented defaults of fields a golden predates: versions from its old key, no history, no emulated
    instruction set; a configuration field at its RunConfig default (the next test)."""
    cfg = RunConfig(steps=2)
    c = curve([6.0, 5.9], [2.0, 2.1])
    old = {
        "key": {"hardware": "cpu AVX512", "torch": "2.13.0+cpu", "cuda": None, "deepspeed": "0.19.8",
                "transformers": "5.24.0"},
        "config": cfg.to_dict(),
        "curve": c.to_dict(),
        "tolerance": nm.tolerance(c, []).to_dict(),
    }  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    g = goldens.read(path)
    assert g.hardware == "cpu AVX512" and g.history == [] and g.isa_env == {}
    assert g.versions == {
        "torch": "2.13.0+cpu",
        "cuda": None,
        "deepspeed": "0.19.8",
        "transformers": "5.24.0",
    }


def test_a_planted_change_fails_the_golden_after_a_version_bump(suite, tmp_path, monkeypatch):
    """The golden test's bite across an upgrade: DDP at 2 ranks writes its golden as if with another torch and
    DeepSpeed (a simulated bump); the same run still matches it, compared and not skipped, and a run with
    AdamW's epsilon x10 (tests/numerics_plants.py) fails it, the message naming both version sets."""
    monkeypatch.setattr(goldens, "UPDATED", [])
    cfg = golden_config(suite, "ddp", 2)
    hardware, now = goldens.hardware(suite.device_type), goldens.run_versions(suite.device_type)
    before = {**now, "torch": "2.12.0", "deepspeed": "0.18.0"}
    base, planted = (
        as_curve(suite.run_job(2, numerics_plants.train, plant=p, cfg=cfg)[0]) for p in (None, "adamw_eps")
    )
    path = tmp_path / goldens.machine_key(hardware) / goldens.file_name(cfg)
    goldens.write(path, goldens.Golden(hardware, before, cfg.to_dict(), base, nm.tolerance(base, [])))
    golden, why = goldens.load(path, cfg)
    assert golden is not None, why
    assert goldens.mismatch(golden, base, now, path) is None
    failure = goldens.mismatch(golden, planted, now, path)
    assert failure is not None and failure.startswith(nm.DIVERGED), failure
    assert f"written with {goldens.describe_versions(before)}" in failure
    assert f"this run has {goldens.describe_versions(now)}" in failure
    assert (
        f"torch 2.12.0 -> {now['torch']}" in failure and f"deepspeed 0.18.0 -> {now['deepspeed']}" in failure
    )


# --- bites: shared changes of numerics that parity passes ------------------------------------------------------


@pytest.mark.parametrize("plant", ["adamw_eps", "bf16_loss", "ddp_prediv"])
def test_numerics_catch_what_parity_passes(suite, plant):
    """DDP at 2 ranks with a plant (tests/numerics_plants.py) against the same run without: the numerics verdict
    is "diverged", while the within-installation loss parity (the planted run against the planted reference)
    stays green. The pre-divide plant changes DDP alone: the parameter and gradient parity catch it too."""
    cfg = golden_config(suite, "ddp", 2)
    base, run = (
        suite.run_job(2, numerics_plants.train, plant=p, cfg=cfg, return_params=True, return_grads=True)[0]
        for p in (None, plant)
    )
    verdict = nm.compare(as_curve(base), as_curve(run), nm.tolerance(as_curve(base), []))
    assert verdict.kind == nm.DIVERGED, verdict.describe()
    ref_cfg = cfg.replace(strategy="single", world_size=1)
    ref = suite.run_job(1, numerics_plants.reference, plant=plant, cfg=ref_cfg)[0]
    assert_losses_match(
        run["losses"],
        ref["losses"],
        f"ddp ws2 planted {plant}",
        against="the single-process reference with the same plant",
    )
    if plant == "ddp_prediv":
        with pytest.raises(AssertionError, match="pre-divided twice (parameter|gradient)"):
            assert_params_and_grads_match(run, ref, cfg.lr, "ddp ws2 pre-divided twice")
    else:
        assert_params_and_grads_match(run, ref, cfg.lr, f"ddp ws2 planted {plant}")


def as_curve(train_out: dict) -> nm.Curve:
    return nm.Curve(tuple(train_out["losses"]), tuple(train_out["grad_norms"]))


@pytest.mark.gpu
@pytest.mark.strategies("ddp")
@pytest.mark.up_to_world_size(1)
@pytest.mark.parametrize("backend", sorted(numerics_plants.SDPA_BACKENDS))
def test_sdpa_backends_diverge_from_math(suite, strategy, world_size, backend):
    """bf16 DDP on one GPU with every SDPA call on `backend` against deterministic mode's math kernel: the
    numerics verdict is "diverged", while the bf16 loss parity with the fp32 reference stays green (on CPU the
    attention switch there is, eager against SDPA's math, is bitwise the same in deterministic mode)."""
    cfg = nm.numerics_config(suite.config(strategy, world_size, precision="bf16"), GOLDEN_STEPS)
    base, run = (
        suite.run_job(world_size, numerics_plants.train, plant=p, cfg=cfg)[0]
        for p in (None, f"sdpa_{backend}")
    )
    verdict = nm.compare(as_curve(base), as_curve(run), nm.tolerance(as_curve(base), []))
    print(f"sdpa {backend} against math: {verdict.describe()}")
    assert verdict.kind == nm.DIVERGED, verdict.describe()
    ref = suite.reference(cfg.replace(precision="fp32"))["losses"]
    np.testing.assert_allclose(
        run["losses"], ref, rtol=BF16_LOSS_RTOL, err_msg=f"sdpa {backend}: bf16 parity"
    )


@pytest.mark.slow  # two variant servers and five numerics runs: 70 s on 2 loaded cores
def test_ab_numerics_catches_a_planted_adamw_epsilon(tmp_path):
    """`distbench ab --numerics only` end to end: the head variant's interpreters plant AdamW's epsilon x10 at
    start (tests/plant_site), every side of the head installation alike; the verdict is "diverged" and the gate
    exits numerics.EXIT_DIVERGED, each side reporting the versions it ran."""
    import subprocess
    import sys

    plant_site = Path(__file__).parent / "plant_site"
    proc = subprocess.run(
        [sys.executable, "-m", "distbench.cli", "ab", "--device", "cpu", "-s", "ddp", "-n", "2"]
        + ["--numerics", "only", "--recipes", "default", "--numerics-steps", "4", "-o", str(tmp_path)]
        + ["--head", f"path={plant_site},env.{numerics_plants.ENV}=adamw_eps"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == nm.EXIT_DIVERGED, proc.stdout + proc.stderr
    (n,) = json.loads((tmp_path / "ab.json").read_text())["numerics"]
    assert n["verdict"] == nm.DIVERGED and n["divergence"]["step"] >= 1, n
    assert n["versions"]["base"] == n["versions"]["head"] and n["versions"]["base"]["torch"]
    assert "NUMERICS DIVERGED" in (tmp_path / "ab.md").read_text()


#: A transformers release other than the lock's, and a huggingface_hub both accept (5.17 asks <2).
OTHER_TRANSFORMERS, HUB = "5.17.0", "huggingface_hub>=1.31,<2"


@pytest.mark.slow  # a 10 MB download, two variant servers and ten numerics runs: 141 s on 2 loaded cores
def test_ab_numerics_across_two_transformers_releases(tmp_path):
    """A real comparison of two versions: head imports transformers OTHER_TRANSFORMERS from its own directory
    (path=), base the lock's. Each side reports the version it ran, and the verdict is one of the three (on
    2026-11-28, 5.17.0 against 5.24.0: identical for ddp and fsdp_full at 2 ranks)."""
    import subprocess
    import sys

    import transformers

    if transformers.__version__ == OTHER_TRANSFORMERS:
        pytest.skip(f"the lock's transformers is {OTHER_TRANSFORMERS} already")
    target = tmp_path / "tf"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    got = subprocess.run([*pip, f"transformers=={OTHER_TRANSFORMERS}", HUB], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(
            f"could not install transformers {OTHER_TRANSFORMERS} from the package index: {got.stderr[-300:]}"
        )
    proc = subprocess.run(
        [sys.executable, "-m", "distbench.cli", "ab", "--device", "cpu", "-s", "ddp,fsdp_full", "-n", "2"]
        + [
            "--numerics",
            "only",
            "--recipes",
            "default",
            "-o",
            str(tmp_path / "ab"),
            "--head",
            f"path={target}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode in (0, nm.EXIT_DIVERGED), proc.stdout + proc.stderr
    report = json.loads((tmp_path / "ab" / "ab.json").read_text())
    for n in report["numerics"]:
        assert n["verdict"] in (nm.IDENTICAL, nm.WITHIN, nm.DIVERGED), n
        assert n["versions"]["head"]["transformers"] == OTHER_TRANSFORMERS, n["versions"]
        assert n["versions"]["base"]["transformers"] == transformers.__version__, n["versions"]


def test_a_golden_holds_across_fields_that_only_time_the_run_or_were_added_at_their_default():
    from distbench.config import RunConfig
    from distbench.testsuite.goldens import same_computation

    cfg = RunConfig(strategy="ddp", world_size=2, steps=4)
    written = {k: v for k, v in cfg.to_dict().items() if k not in ("until_ci", "max_windows")}
    assert same_computation(written, cfg)  # written before the timing fields existed
    assert same_computation({**written, "windows": 4}, cfg)  # timed otherwise, the same computation
    assert not same_computation({**written, "lr": 0.5}, cfg)
    assert not same_computation({**written, "a_field_since_removed": 1}, cfg)
    assert not same_computation(
        written, cfg.replace(dropout=0.1)
    )  # a field at a value other than its default
