"""The numerics verdict's rules (gate/numerics.py, testsuite/goldens.py), stated against numbers computed here,
not the module's own constants: the rounding bound is 4 float32 ulps of the base's value, a divergence is
reported at the first step (and, within it, the first metric) beyond tolerance, and a golden written before a
field existed compares that field at its default."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distbench.config import RunConfig
from distbench.gate import numerics as nm
from distbench.testsuite.goldens import TIMING_ONLY, same_computation
from properties import cases


def ulps_up(v: float, n: int) -> float:
    """`v` moved up by n float32 ulps, counted by stepping float32 itself."""
    x = np.float32(v)
    for _ in range(n):
        x = np.nextafter(x, np.float32(np.inf))
    return float(x)


def curve(loss: list[float], norm: list[float] | None = None) -> nm.Curve:
    return nm.Curve(tuple(loss), tuple(norm if norm is not None else loss))


@pytest.mark.parametrize("value", [0.5, 4.0, 1024.0])
def test_rounding_alone_is_four_float32_ulps_of_the_base_value(value: float) -> None:
    """At a power of two an ulp above is exactly eps x value: 4 ulps up is within tolerance (equal to the
    bound), 5 diverge. A float64 or float16 epsilon, another count, or an absolute bound moves one side."""
    base = curve([value, value])
    tol = nm.tolerance(base, [])
    assert nm.compare(base, curve([value, ulps_up(value, 4)]), tol).kind == nm.WITHIN
    v = nm.compare(base, curve([value, ulps_up(value, 5)]), tol)
    assert v.kind == nm.DIVERGED and v.divergence is not None and v.divergence.step == 1
    assert v.divergence.allowed == pytest.approx(ulps_up(value, 4) - value, rel=1e-12)
    assert tol.source("loss", 1) == "rounding"


def test_a_negative_value_has_the_same_bound_as_its_magnitude() -> None:
    assert nm.rounding_bound((-4.0,)) == nm.rounding_bound((4.0,)) == [ulps_up(4.0, 4) - 4.0]


def test_the_divergence_is_the_first_step_then_the_first_metric_beyond_tolerance() -> None:
    base = curve([6.0, 5.0, 4.0, 3.0], [2.0, 2.0, 2.0, 2.0])
    tol = nm.tolerance(base, [])
    head = curve([6.0, 5.0, 4.5, 3.5], [2.0, 2.5, 2.5, 2.5])  # the norm at step 1, then both
    v = nm.compare(base, head, tol)
    assert v.divergence is not None
    assert (v.divergence.step, v.divergence.metric, v.divergence.head) == (1, "grad_norm", 2.5)
    both = curve([6.0, 5.5, 4.5, 3.5], [2.0, 2.5, 2.5, 2.5])  # both at step 1: loss is compared first
    d = nm.compare(base, both, tol).divergence
    assert d is not None and (d.step, d.metric, d.base, d.head) == (1, "loss", 5.0, 5.5)
    assert "from step 1: loss 5.0 -> 5.5" in nm.compare(base, both, tol).describe()


@cases(50)
@given(
    steps=st.integers(2, 10),
    beyond=st.sets(st.tuples(st.integers(0, 9), st.sampled_from(nm.METRICS)), min_size=1, max_size=6),
    spread=st.booleans(),
)
def test_a_divergence_is_reported_at_the_first_step_beyond_tolerance(
    steps: int, beyond: set[tuple[int, str]], spread: bool
) -> None:
    """Whatever steps and metrics are moved beyond their tolerance (the rest moved within it), the verdict
    names the earliest step, and the first metric of METRICS at that step."""
    beyond = {(s, m) for s, m in beyond if s < steps}
    base = {m: [3.0 + s * 0.25 for s in range(steps)] for m in nm.METRICS}
    noisy = [curve(base["loss"], base["grad_norm"])]
    if spread:  # a measured spread of 1e-3 from step 1 on
        noisy.append(curve([b + (1e-3 if s else 0.0) for s, b in enumerate(base["loss"])], base["grad_norm"]))
    tol = nm.tolerance(noisy[0], noisy)
    head = {
        m: [
            b + (2 * tol.allowed(m, s) + 1e-2 if (s, m) in beyond else tol.allowed(m, s) / 2)
            for s, b in enumerate(base[m])
        ]
        for m in nm.METRICS
    }
    v = nm.compare(noisy[0], curve(head["loss"], head["grad_norm"]), tol)
    if not beyond:
        assert v.kind == nm.WITHIN and v.divergence is None
        return
    first = min(beyond, key=lambda sm: (sm[0], nm.METRICS.index(sm[1])))
    assert v.kind == nm.DIVERGED and v.divergence is not None
    assert (v.divergence.step, v.divergence.metric) == first


#: a value other than its default for fields that decide what a run computes (each valid with the others'
#: defaults)
OTHER_VALUES: dict[str, object] = {
    "world_size": 2,
    "model": "gpt2-124m",
    "precision": "bf16-amp",
    "global_batch": 16,
    "micro_batch": 1,
    "steps": 4,
    "lr": 0.5,
    "weight_decay": 0.0,
    "eps": 1e-6,
    "lr_warmup_steps": 0,
    "seed": 7,
    "deterministic": False,
    "clip_grad_norm": 1.0,
    "dropout": 0.1,
    "activation_checkpointing": True,
    "lora_rank": 4,
}


@cases(40)
@given(field=st.sampled_from(sorted(OTHER_VALUES)), at_default=st.booleans())
def test_a_golden_written_before_a_field_existed_compares_it_at_its_default(
    field: str, at_default: bool
) -> None:
    """A golden without `field` (written before it existed) holds for a configuration that leaves the field at
    its default, and for none that sets it otherwise: the missing field is its default, neither "whatever
    the configuration has" nor "nothing"."""
    assert field not in TIMING_ONLY
    cfg = RunConfig() if at_default else RunConfig().replace(**{field: OTHER_VALUES[field]})
    written = {k: v for k, v in RunConfig().to_dict().items() if k != field}
    assert same_computation(written, cfg) == at_default


def test_writing_a_golden_says_what_moved_from_the_one_before(tmp_path, monkeypatch) -> None:
    """A new golden (or one over a damaged file) is "new golden"; over an earlier one, every step and metric
    that moved, or "nothing moved"; each write is listed for the session's summary, and the file reads back
    as what was written."""
    from distbench.testsuite import goldens

    monkeypatch.setattr(goldens, "UPDATED", [])
    cfg = RunConfig(steps=2)
    path = tmp_path / "machine" / goldens.file_name(cfg)

    def golden(loss: list[float], norm: list[float]) -> goldens.Golden:
        c = curve(loss, norm)
        return goldens.Golden("x", {"torch": "2.13.0"}, cfg.to_dict(), c, nm.tolerance(c, []))

    first = golden([6.0, 5.0], [2.0, 1.0])
    assert goldens.write(path, first) == ["new golden"]
    assert json.loads(path.read_text()) == first.to_json()
    loaded, why = goldens.load(path, cfg)
    assert loaded == first and why == ""
    assert goldens.write(path, first) == ["nothing moved"]
    moved = goldens.write(path, golden([6.0, 5.5], [2.5, 1.0]))
    assert moved[0].startswith("2 values moved (largest: loss ") and moved[1:] == ["the same versions"], moved
    path.write_text("{")
    assert goldens.write(path, first) == ["the file before was unreadable", "new golden"]
    assert [diff for _, diff in goldens.UPDATED] == [
        ["new golden"],
        ["nothing moved"],
        moved,
        ["the file before was unreadable", "new golden"],
    ]
    assert all(p == path for p, _ in goldens.UPDATED)
