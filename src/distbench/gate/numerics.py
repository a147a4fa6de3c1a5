"""Does head still train to the same loss as base? Per configuration, both variants train the same seeded steps
on the same data in deterministic mode, and their loss and global gradient norm are compared step by step.

Parity (invariants/) compares strategies with a reference inside one installation, so an upgrade that changes a
kernel both use (an SDPA backend, a fused AdamW, a bf16 cast in a model file) moves both and stays green; this
compares two installations, or two checkouts, with each other.

Verdicts, per configuration:
    identical    every step's loss and gradient norm equal to the bit
    within       none differs by more than its step's tolerance
    diverged     from step k on, by how much (the first step and metric beyond tolerance)

The comparison runs over RECIPES, the ways users train (accumulation, clipping that binds, bf16-amp, fp16 with its
loss scaler, activation checkpointing, a resume half-way), not the default step alone: an upgrade that breaks one
of those paths leaves the default step identical. A recipe a strategy cannot run on the device is skipped with
the strategy's own reason, in the report.

The tolerance of a step and metric is derived, never a constant picked to pass: the larger of
    rounding    ULPS units in the last place of float32 (losses and norms are float32 reductions) of the
                base's value: what a changed reduction order alone moves a value by at its first steps
                (measured on gpt2-tiny, FSDP2 against DDP: losses equal, norms 0-1.6 ulps apart over 8 steps)
    spread      SPREAD_FACTOR x the largest difference, up to that step, between `repeats` runs of the base
                with non-deterministic kernels (atomics in attention backwards, TF32): how far the base's own
                run-to-run noise carries a value by that step, measured in every comparison
The report states both, and which one set each verdict's bound.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import RunConfig

if TYPE_CHECKING:
    import argparse

    from rich.console import Console

#: The metrics compared, per step: the global-batch loss and the global gradient norm before clipping.
METRICS = ("loss", "grad_norm")
#: A clipping bound no gradient reaches: torch's clip_grad_norm_ (and DeepSpeed's) then multiply every gradient
#: by exactly 1.0, so asking for clipping records each step's global norm without changing a bit of training.
NEVER_CLIP = 1e30
#: Units in the last place of float32 a value may move by rounding alone (reduction order).
ULPS = 4
FP32_EPS = float(np.finfo(np.float32).eps)
#: The base's measured run-to-run spread is one or a few samples of a noise whose next draw may be larger.
SPREAD_FACTOR = 2.0
#: Steps compared by default: enough for a changed update rule to reach the loss (AdamW's epsilon x10 moved
#: gpt2-tiny's loss by 5 ulps from step 2 on).
DEFAULT_STEPS = 8
#: Runs of the base with non-deterministic kernels whose spread is measured (pairs among them: 3).
DEFAULT_REPEATS = 3
#: --numerics-repeats by device when not given. On CPU none: over every recipe of ddp at 2 ranks (2026-12-02) the
#: runs with non-deterministic kernels were bitwise the deterministic one (CPU kernels and gloo have no atomics
#: or TF32), and three more runs per recipe would take the recipe set past its budget (docs/gate.md).
REPEATS_BY_DEVICE = {"cuda": DEFAULT_REPEATS, "cpu": 0}

IDENTICAL, WITHIN, DIVERGED, NOT_COMPARED = "identical", "within tolerance", "diverged", "not compared"
SKIPPED = "skipped"
#: `distbench ab`'s exit status when a configuration's numerics diverged.
EXIT_DIVERGED = 4


def numerics_config(cfg: RunConfig, steps: int = DEFAULT_STEPS, deterministic: bool = True) -> RunConfig:
    """`cfg` as the numerics comparison trains it: `steps` steps, no warm-up or profiling, deterministic kernels
    (or not, for the spread), and the global gradient norm recorded (NEVER_CLIP, unless `cfg` clips)."""
    return cfg.replace(
        steps=steps,
        warmup=0,
        windows=1,
        device_time_steps=0,
        deterministic=deterministic,
        clip_grad_norm=cfg.clip_grad_norm or NEVER_CLIP,
    )


# --- the recipes -------------------------------------------------------------------------------------------

#: Micro-batches a rank accumulates per step in the accumulation recipe (where the configuration does not already).
ACCUM = 4
#: The clipping recipe's threshold, as a fraction of the smallest pre-clip gradient norm of base's default run:
#: well under every step's norm, so clipping changes every update (a threshold that never binds multiplies the
#: gradients by exactly 1.0 and leaves a broken clipping path unseen).
CLIP_FRACTION = 0.25
#: The recipes compared, by name, with what each trains: the configuration as given, then one change each.
RECIPES: dict[str, str] = {
    "default": "the configuration as given",
    "accumulation": f"{ACCUM} micro-batches accumulated per rank per step",
    "clipping": f"gradients clipped at {CLIP_FRACTION:g} x base's smallest default-run norm (binds every step)",
    "bf16-amp": "fp32 weights, bf16 compute through torch.autocast",
    "fp16": "fp16 compute with dynamic loss scaling",
    "activation-checkpointing": "every transformer block recomputed in backward",
    "resume": "saved after half the steps and resumed in fresh ranks: the steps after the resume compared",
}


def recipe_config(recipe: str, cfg: RunConfig, clip: float) -> RunConfig:
    """`cfg` as `recipe` trains it (RECIPES); `clip`: the clipping recipe's threshold (the user's own where
    `cfg` clips already)."""
    if recipe == "accumulation":
        return cfg if cfg.accum_steps >= 2 else cfg.replace(global_batch=cfg.global_batch * ACCUM)
    if recipe == "clipping":
        return cfg.replace(clip_grad_norm=cfg.clip_grad_norm or clip)
    if recipe in ("bf16-amp", "fp16"):
        return cfg.replace(precision=recipe)
    if recipe == "activation-checkpointing":
        return cfg.replace(activation_checkpointing=True)
    if recipe in ("default", "resume"):
        return cfg
    raise ValueError(f"unknown recipe {recipe!r}; one of {', '.join(RECIPES)}")


def skip_reason(recipe: str, cfg: RunConfig, device: str) -> str | None:
    """Why the strategy cannot run `recipe` on `device` (its registry entry's own reason), or None."""
    from ..strategies import get_spec

    if recipe == "resume" and cfg.steps < 2:
        return f"a resume half-way needs 2 steps or more, not {cfg.steps}: raise --numerics-steps"
    return get_spec(cfg.strategy).unsupported_reason(device, cfg.world_size, None, cfg.precision)


def resume_step(recipe: str, cfg: RunConfig) -> int | None:
    """The step after which the resume recipe saves and resumes (half-way); None for the others."""
    return cfg.steps // 2 if recipe == "resume" else None


@dataclass(frozen=True)
class Curve:
    """One run's values per step, by metric."""

    loss: tuple[float, ...]
    grad_norm: tuple[float, ...]

    def values(self, metric: str) -> tuple[float, ...]:
        return tuple(getattr(self, metric))

    def to_dict(self) -> dict[str, list[float]]:
        return {m: list(self.values(m)) for m in METRICS}

    @classmethod
    def from_dict(cls, d: dict[str, Any], what: str = "curve") -> Curve:
        """A Curve from its JSON form; ValueError naming `what` when a metric is missing or not numbers."""
        try:
            loss, norm = (tuple(float(v) for v in d[m]) for m in METRICS)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{what}: needs lists of numbers {', '.join(METRICS)} ({type(e).__name__}: {e})"
            ) from None
        if len(loss) != len(norm) or not loss:
            raise ValueError(f"{what}: {len(loss)} losses and {len(norm)} gradient norms")
        return cls(loss, norm)


# --- in the ranks ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_thread_on_cpu(device_type: str) -> Iterator[None]:
    """On CPU, one intra-op thread: a parallel reduction's order follows the thread count, which follows the
    machine's cores, and a golden must not change with them."""
    import torch

    if device_type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def curve_job(ctx: Any, cfg: RunConfig, **train_args: Any) -> dict[str, list[float]]:
    """The train job of this distbench, in every rank: per-step losses and global gradient norms. `train_args`:
    jobs.train's checkpoint arguments (save_at and checkpoint_dir, or resume_from)."""
    from ..jobs.train import train

    with one_thread_on_cpu(ctx.device_type):
        out = train(ctx, cfg, **train_args)
    return {"loss": out["losses"], "grad_norm": out["grad_norms"]}


def curve_of(per_rank: list[dict[str, list[float]]], what: str) -> Curve:
    """The run's curve from its ranks' replies; ValueError when ranks disagree or no norm was recorded."""
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], 1):
        if other != first:
            raise ValueError(f"{what}: rank {rank} reports other values than rank 0: {other} vs {first}")
    return Curve.from_dict(first, what)


def run_curve(pool: Any, cfg: RunConfig, timeout: float, resume_at: int | None = None) -> dict[str, Any]:
    """One numerics run of `cfg` in `pool` (a variant server's request): {"status": "ok", "curve": ...}, or a
    failure with the error. `resume_at`: train that many steps, save, and train the rest in fresh trainers
    resumed from the checkpoint; the curve is the first steps' values, then the resumed run's."""
    import tempfile

    from ..runtime.pool import JobError

    what = f"{cfg.strategy} ws{cfg.world_size}"
    try:
        if resume_at is None:
            curve = curve_of(pool.run(curve_job, {"cfg": cfg}, timeout), what)
        else:
            with tempfile.TemporaryDirectory(prefix="distbench-numerics-") as ckpt:
                saved = {"cfg": cfg.replace(steps=resume_at), "save_at": resume_at, "checkpoint_dir": ckpt}
                first = curve_of(pool.run(curve_job, saved, timeout), f"{what} before the save")
                rest = curve_of(
                    pool.run(curve_job, {"cfg": cfg, "resume_from": ckpt}, timeout), f"{what} resumed"
                )
            if len(rest.loss) != cfg.steps - resume_at:
                raise ValueError(f"{what}: resumed after step {resume_at}, trained {len(rest.loss)} more steps "
                                 f"where {cfg.steps - resume_at} were asked")  # fmt: skip
            curve = Curve(first.loss + rest.loss, first.grad_norm + rest.grad_norm)
    except (JobError, ValueError) as e:
        return {"status": "error", "error": str(e)}
    return {"status": "ok", "curve": curve.to_dict(), "versions": versions()}


def versions() -> dict[str, str | None]:
    """The versions of what computes, in this process (a variant's own, from its path= or python=)."""
    import torch

    from ..machine import package_version

    return {
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "deepspeed": package_version("deepspeed"),
    }


# --- tolerance and verdict -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """Per metric and step: the rounding bound, the measured spread, and the tolerance (the larger, see module)."""

    rounding: dict[str, list[float]]
    spread: dict[str, list[float]]
    runs: int  # runs with non-deterministic kernels the spread comes from

    def allowed(self, metric: str, step: int) -> float:
        return max(self.rounding[metric][step], SPREAD_FACTOR * self.spread[metric][step])

    def source(self, metric: str, step: int) -> str:
        r, s = self.rounding[metric][step], SPREAD_FACTOR * self.spread[metric][step]
        return "spread" if s > r else "rounding"

    def to_dict(self) -> dict[str, Any]:
        return {"rounding": self.rounding, "spread": self.spread, "runs": self.runs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tolerance:
        return cls(
            {m: [float(v) for v in d["rounding"][m]] for m in METRICS},
            {m: [float(v) for v in d["spread"][m]] for m in METRICS},
            int(d["runs"]),
        )


def rounding_bound(values: tuple[float, ...]) -> list[float]:
    """ULPS float32 ulps of each value (module doc)."""
    return [ULPS * FP32_EPS * abs(v) for v in values]


def spread_envelope(runs: list[Curve], metric: str, steps: int) -> list[float]:
    """Per step, the largest difference between any two of `runs` at that step or before (noise carried by
    training does not shrink back: a step's bound is never below an earlier step's)."""
    out, worst = [], 0.0
    for s in range(steps):
        for a, b in itertools.combinations(runs, 2):
            worst = max(worst, abs(a.values(metric)[s] - b.values(metric)[s]))
        out.append(worst)
    return out


def tolerance(base: Curve, noisy: list[Curve]) -> Tolerance:
    """The tolerance around `base`: rounding, and the spread of `noisy` (runs of the base with
    non-deterministic kernels; fewer than two: no spread measured, zero)."""
    n = len(base.loss)
    return Tolerance(
        {m: rounding_bound(base.values(m)) for m in METRICS},
        {m: spread_envelope(noisy, m, n) for m in METRICS},
        len(noisy),
    )


@dataclass(frozen=True)
class Divergence:
    """The first step and metric beyond tolerance."""

    step: int
    metric: str
    base: float
    head: float
    allowed: float

    @property
    def relative(self) -> float:
        return abs(self.head - self.base) / abs(self.base) if self.base else float("inf")

    def describe(self) -> str:
        return (
            f"from step {self.step}: {self.metric} {self.base!r} -> {self.head!r} "
            f"({self.relative:.2e} relative, allowed {self.allowed:.2e} absolute)"
        )


@dataclass(frozen=True)
class Verdict:
    kind: str  # IDENTICAL, WITHIN or DIVERGED
    divergence: Divergence | None = None
    largest: dict[str, float] = field(default_factory=dict)  # per metric: the largest |head - base| / allowed

    def describe(self) -> str:
        if self.divergence is not None:
            return f"{DIVERGED} {self.divergence.describe()}"
        if self.kind == WITHIN:
            worst = ", ".join(f"{m} {r:.2f}" for m, r in self.largest.items())
            return f"{WITHIN} (largest difference / tolerance: {worst})"
        return IDENTICAL


def compare(base: Curve, head: Curve, tol: Tolerance) -> Verdict:
    """head against base, step by step (module doc). Curves of different lengths cannot be compared
    (ValueError)."""
    if len(base.loss) != len(head.loss):
        raise ValueError(f"base ran {len(base.loss)} steps, head {len(head.loss)}: not comparable")
    if base == head:
        return Verdict(IDENTICAL)
    largest = dict.fromkeys(METRICS, 0.0)
    first: Divergence | None = None
    for step in range(len(base.loss)):
        for m in METRICS:
            b, h = base.values(m)[step], head.values(m)[step]
            allowed = tol.allowed(m, step)
            diff = abs(h - b) if np.isfinite(h) else float("inf")
            largest[m] = max(largest[m], diff / allowed if allowed else float("inf") if diff else 0.0)
            if diff > allowed and first is None:
                first = Divergence(step, m, b, h, allowed)
    return Verdict(DIVERGED if first else WITHIN, first, largest)


def tolerance_statement(tol: Tolerance) -> str:
    """The rule and what was measured, in a sentence for the report."""
    measured = (
        f"the largest difference between {tol.runs} runs of base with non-deterministic kernels was "
        + ", ".join(f"{m} {max(tol.spread[m]):.2e}" for m in METRICS)
        if tol.runs >= 2
        else "no run-to-run spread measured"
    )
    return (
        f"tolerance per step = max({ULPS} float32 ulps of base's value, {SPREAD_FACTOR:g} x the run-to-run "
        f"spread up to that step); {measured}"
    )


# --- between two variants ----------------------------------------------------------------------------------


@dataclass
class NumericsOutcome:
    label: str  # the configuration, as the report names it
    recipe: str = "default"
    base: Curve | None = None
    head: Curve | None = None
    tolerance: Tolerance | None = None
    verdict: Verdict | None = None
    error: str | None = None
    skipped: str | None = None  # why the strategy cannot run the recipe here
    versions: dict[str, dict[str, Any]] = field(default_factory=dict)  # per side, what its run reported
    note: str = ""  # what the recipe trained with, where it chose a value (the clipping threshold)

    @property
    def kind(self) -> str:
        return self.verdict.kind if self.verdict else SKIPPED if self.skipped else NOT_COMPARED

    @property
    def detail(self) -> str:
        """The verdict in words, naming the recipe and configuration where it diverged."""
        if self.verdict is None:
            return self.skipped or self.error or ""
        text = self.verdict.describe()
        if self.verdict.divergence is not None:
            text = f"{self.recipe} on {self.label}: {text}"
        return f"{text}; {self.note}" if self.note else text

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.label,
            "recipe": self.recipe,
            "verdict": self.kind,
            "detail": self.detail,
            "skipped": self.skipped,
            "base": self.base.to_dict() if self.base else None,
            "head": self.head.to_dict() if self.head else None,
            "tolerance": self.tolerance.to_dict() if self.tolerance else None,
            "tolerance_rule": tolerance_statement(self.tolerance) if self.tolerance else None,
            "versions": self.versions,
            "divergence": self.verdict.divergence.__dict__
            if self.verdict and self.verdict.divergence
            else None,
        }


#: Asks one variant for one numerics run of a configuration: ("base" or "head", cfg, the step after which to save
#: and resume, or None) -> the server's reply.
Ask = Callable[[str, RunConfig, "int | None"], dict[str, Any]]


def compare_variants(
    configs: list[tuple[str, RunConfig]],
    ask: Ask,
    *,
    recipes: tuple[str, ...] = tuple(RECIPES),
    device: str = "cpu",
    steps: int = DEFAULT_STEPS,
    repeats: int = DEFAULT_REPEATS,
    at_once: bool = False,
    on_outcome: Callable[[NumericsOutcome], None] | None = None,
) -> list[NumericsOutcome]:
    """Per (label, configuration) and recipe: base and head in deterministic mode, `repeats` runs of base with
    non-deterministic kernels for the spread, and the verdict. A recipe the strategy cannot run on `device` is
    SKIPPED with its reason; a run that fails leaves the recipe NOT_COMPARED with its error. `at_once`: base's
    and head's deterministic runs at the same time (the values do not depend on it; the wall time halves where
    the machine has the cores for both)."""
    out = []
    for label, cfg in configs:
        defaults: list[NumericsOutcome] = []
        for recipe in (r for r in RECIPES if r in recipes):
            o = NumericsOutcome(label, recipe)
            try:
                clip = _clip_threshold(ask, cfg, steps, defaults) if recipe == "clipping" else 0.0
                rcfg = numerics_config(recipe_config(recipe, cfg, clip), steps)
                o.skipped = skip_reason(recipe, rcfg, device)
                if o.skipped is None:
                    _compare_recipe(o, ask, rcfg, resume_step(recipe, rcfg), repeats, at_once)
                    if recipe == "clipping":
                        o.note = _clip_note(rcfg.clip_grad_norm, o.base)
            except ValueError as e:
                o.error = str(e)
            if recipe == "default":
                defaults.append(o)
            out.append(o)
            if on_outcome:
                on_outcome(o)
    return out


def _compare_recipe(
    o: NumericsOutcome, ask: Ask, cfg: RunConfig, resume_at: int | None, repeats: int, at_once: bool
) -> None:
    """Base's and head's deterministic runs and base's noisy runs (`at_once`: all asked at the same time; each
    side's runs then go to as many of its servers as it has, ask_servers), the verdict."""
    noisy_cfg = cfg.replace(deterministic=False)
    if at_once:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2 + repeats) as runs:
            sides = [runs.submit(_curve, ask, side, cfg, resume_at, o.versions) for side in ("base", "head")]
            spread = [runs.submit(_curve, ask, "base", noisy_cfg, resume_at) for _ in range(repeats)]
            o.base, o.head = (f.result() for f in sides)
            noisy = [f.result() for f in spread]
    else:
        o.base = _curve(ask, "base", cfg, resume_at, o.versions)
        o.head = _curve(ask, "head", cfg, resume_at, o.versions)
        noisy = [_curve(ask, "base", noisy_cfg, resume_at) for _ in range(repeats)]
    o.tolerance = tolerance(o.base, noisy)
    o.verdict = compare(o.base, o.head, o.tolerance)


def _clip_threshold(ask: Ask, cfg: RunConfig, steps: int, defaults: list[NumericsOutcome]) -> float:
    """CLIP_FRACTION of the smallest pre-clip norm of base's default run (that recipe's, or one run for it)."""
    run = defaults[0].base if defaults else None
    base = run or _curve(ask, "base", numerics_config(cfg, steps), None)
    return CLIP_FRACTION * min(base.grad_norm)


def _clip_note(threshold: float, base: Curve | None) -> str:
    """The threshold and the steps it bound at in base's run (pre-clip norm above it)."""
    norms = base.grad_norm if base else ()
    bound = sum(n > threshold for n in norms)
    return f"clipped at {threshold:.4g}, binding at {bound} of {len(norms)} steps"


def _curve(
    ask: Ask, side: str, cfg: RunConfig, resume_at: int | None, versions: dict[str, Any] | None = None
) -> Curve:
    reply = ask(side, cfg, resume_at)
    if reply.get("status") != "ok":
        raise ValueError(f"{side}'s numerics run failed: {reply.get('error') or reply.get('status')}")
    if versions is not None:
        versions[side] = reply.get("versions") or {}
    return Curve.from_dict(reply["curve"], f"{side}'s numerics run")


def exit_status(outcomes: list[NumericsOutcome]) -> int | None:
    """EXIT_DIVERGED when a configuration diverged, 3 (undecided) when one was not compared, else None (the
    speed verdict decides)."""
    kinds = {o.kind for o in outcomes}
    if DIVERGED in kinds:
        return EXIT_DIVERGED
    return 3 if NOT_COMPARED in kinds else None


#: The server protocol (gate/serve.py) from which a variant runs numerics requests, and runs them with a resume.
PROTOCOL, RESUME_PROTOCOL = 3, 4


def ask_servers(servers: dict[str, Any], timeout: float, twins: dict[str, list[Any]] | None = None) -> Ask:
    """An Ask over `distbench ab`'s two variant servers (gate/variants.py's VariantProcess, started), and a
    side's `twins` (started servers of the same variant): a side's run goes to whichever of its servers is
    free, so that runs asked at once from several threads run at once."""
    free: dict[str, queue.SimpleQueue[Any]] = {}
    for side, server in servers.items():
        free[side] = queue.SimpleQueue()
        for s in [server, *(twins or {}).get(side, [])]:
            free[side].put(s)

    def ask(side: str, cfg: RunConfig, resume_at: int | None) -> dict[str, Any]:
        server = free[side].get()
        try:
            return _ask(side, server, cfg, resume_at)
        finally:
            free[side].put(server)

    def _ask(side: str, server: Any, cfg: RunConfig, resume_at: int | None) -> dict[str, Any]:
        needs, what = (PROTOCOL, "runs") if resume_at is None else (RESUME_PROTOCOL, "resumed runs")
        if server.protocol < needs:
            return {
                "status": "error",
                "error": f"the {side} variant's distbench predates numerics {what} (its server speaks protocol "
                f"{server.protocol}, they need {needs}): leave them out with --recipes, or compare speed alone "
                "with --numerics off",
            }
        request: dict[str, Any] = {"op": "numerics", "cfg": cfg.to_dict()}
        if resume_at is not None:
            request["resume_at"] = resume_at
        return server.request(request, timeout) or {
            "status": "error",
            "error": f"the {side} variant died or hung (log: {server.log})",
        }

    return ask


#: The precisions the recipes train in (bf16-amp, fp16, and the strategies' defaults): runs_at_once bounds the
#: memory of the hungriest.
RECIPE_PRECISIONS = ("fp32", "bf16-amp", "fp16")


def runs_at_once(configs: list[RunConfig], device: str, runs: int) -> int:
    """How many of a recipe's `runs` (both sides' deterministic runs, then base's noisy ones) may run at the same
    time: on CPU as many as have a core for each rank; on GPUs as many as fit on the card together by the memory
    model's bound (gate/fit.py's bounding_peak, at the hungriest precision a recipe trains) and have
    CORES_PER_RANK host cores a rank; one where the card or the bound is unknown. The curves do not depend on
    it: the deterministic runs are deterministic, and the noisy runs' spread is that of their kernels."""
    from ..testsuite.schedule import CORES_PER_RANK
    from . import fit

    if not configs:
        return 1
    cores, widest = os.cpu_count() or 1, max(c.world_size for c in configs)
    if device != "cuda":
        return max(1, min(runs, cores // widest))
    card = fit.card_bytes()
    peaks = [
        fit.bounding_peak(c.replace(precision=p), fit.n_params(c.model))
        for c in configs
        for p in RECIPE_PRECISIONS
    ]
    if card is None or any(p is None for p in peaks):
        return 1
    peak = max(p for p in peaks if p is not None)
    by_memory = max((k for k in range(1, runs + 1) if fit.fits(peak, card, k)), default=1)
    return max(1, min(by_memory, cores // (CORES_PER_RANK * widest)))


def _start_twins(server: Any, count: int, console: Console) -> list[Any]:
    """`count` more servers of `server`'s variant, started at once (their imports and ranks' start overlap); one
    that does not start is left out, said, and its runs go to the others."""
    from concurrent.futures import ThreadPoolExecutor

    from ..errors import DistbenchError

    if count < 1:
        return []
    twins = [server.twin(n) for n in range(1, count + 1)]

    def start(twin: Any) -> Any:
        try:
            twin.start()
        except DistbenchError as e:
            console.print(
                f"  note: a second server of the base variant did not start ({e}); its runs take turns"
            )
            return None
        return twin

    with ThreadPoolExecutor(count) as pool:
        return [t for t in pool.map(start, twins) if t is not None]


#: --numerics: on (the recipes, then speed), only (the recipes, no speed), default (the default step alone, then
#: speed), suite (the invariant tests under each side, no speed: gate/suite.py), off (speed alone).
MODES = ("on", "only", "default", "suite", "off")
#: The modes that compare no speed.
NO_SPEED = ("only", "suite")


def parse_recipes(text: str) -> tuple[str, ...]:
    """--recipes: comma-separated names of RECIPES, or "all"; ArgumentTypeError naming an unknown one."""
    import argparse

    from ..errors import did_you_mean

    names = (
        tuple(RECIPES) if text.strip() == "all" else tuple(r.strip() for r in text.split(",") if r.strip())
    )
    for r in names:
        if r not in RECIPES:
            raise argparse.ArgumentTypeError(
                f"unknown recipe {r!r}.{did_you_mean(r, list(RECIPES))} Known: all, {', '.join(RECIPES)}"
            )
    if not names:
        raise argparse.ArgumentTypeError("no recipe given; name one or more of: all, " + ", ".join(RECIPES))
    return names


def recipes_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The recipes `distbench ab` compares: the default step alone under --numerics default, else --recipes."""
    return ("default",) if args.numerics == "default" else args.recipes


def add_flags(p: argparse.ArgumentParser) -> None:
    """`distbench ab`'s flags of the numerics comparison."""
    p.add_argument(
        "--numerics",
        choices=MODES,
        default="on",
        help="compare head's per-step loss and gradient norm with base's in deterministic mode, over the "
        "recipes (--recipes): on (default: then the speed), only (no speed runs), default (the default step "
        "alone, then the speed), suite (run the invariant tests under base and head instead: those that "
        "fail under head alone, per strategy; no speed), off (speed alone); a divergence beyond the "
        f"tolerance, or a test failing under head alone, exits {EXIT_DIVERGED}",
    )
    p.add_argument(
        "--recipes",
        type=parse_recipes,
        default=tuple(RECIPES),
        help="the recipes the numerics compare, comma-separated (default: all, i.e. "
        + ", ".join(RECIPES)
        + "); a recipe a strategy cannot run on the device is skipped with its reason",
    )
    p.add_argument(
        "--suite-timeout",
        type=float,
        default=3600.0,
        help="seconds each side's test run may take under --numerics suite (default 3600); past it, undecided",
    )
    p.add_argument(
        "--numerics-steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"steps each numerics run trains (default {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--numerics-repeats",
        type=int,
        help="runs of base with non-deterministic kernels whose spread sets the tolerance beside rounding "
        f"(default {REPEATS_BY_DEVICE['cuda']} on GPUs, {REPEATS_BY_DEVICE['cpu']} on CPU, whose kernels run "
        "alike either way; under 2: rounding alone)",
    )


def compares(args: argparse.Namespace) -> bool:
    """Whether a comparison's flags ask for the numerics in its servers (not --numerics off or suite: `nightly`,
    whose flags are only the speed runs', leaves it off)."""
    return getattr(args, "numerics", "off") not in ("off", "suite")


def compare_servers(
    args: argparse.Namespace,
    configs: list[RunConfig],
    servers: dict[str, Any],
    console: Console,
    label_of: Callable[[RunConfig], str],
    device: str,
) -> list[NumericsOutcome]:
    """Unless --numerics is off or suite: head's numerics against base's per configuration and recipe, then
    fresh ranks for the speed runs; `label_of` names a configuration as the report does."""
    if not compares(args):
        return []

    def show(o: NumericsOutcome) -> None:
        console.print(
            f"  numerics {o.recipe} {o.label}: {o.detail if o.verdict else f'{o.kind}: {o.detail}'}"
        )

    repeats = REPEATS_BY_DEVICE[device] if args.numerics_repeats is None else args.numerics_repeats
    at_once = runs_at_once(configs, device, 2 + repeats)
    twins = _start_twins(servers["base"], at_once - 2, console)  # base's servers: all at once but head's run
    try:
        outcomes = compare_variants(
            [(label_of(c), c) for c in configs],
            ask_servers(servers, args.timeout, {"base": twins}),
            recipes=recipes_of(args),
            device=device,
            steps=args.numerics_steps,
            repeats=repeats,
            at_once=at_once > 1,
            on_outcome=show,
        )
    finally:
        for twin in twins:
            twin.close()
    for server in servers.values():
        server.recycle()
    return outcomes
