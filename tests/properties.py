"""What every property test (hypothesis) shares: how many cases it draws and how, per profile, and the helpers its
strategies need.

Two profiles, chosen by DISTBENCH_HYPOTHESIS (tests/conftest.py loads it before any test module is imported):

- `ci`, the default (the README's `pytest`, CI): derandomized, so every run draws the same cases and a verdict
  does not flip between two runs of one commit; no example database, so nothing carries over between runs or
  machines. Every counterexample a run has found is kept as an explicit `@example` beside its test.
- `nightly` (DISTBENCH_HYPOTHESIS=nightly, the nightly workflow): fresh random cases, NIGHTLY_FACTOR times as
  many, to find what the fixed ones miss. A failure prints the `@reproduce_failure` blob that replays it (and
  hypothesis prints its seed): the counterexample then becomes an `@example`.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE_ENV = "DISTBENCH_HYPOTHESIS"
#: hypothesis's own default: a test's `cases(n)` is its number of cases under `ci`
_BASE = 100
NIGHTLY_FACTOR = 20

settings.register_profile(
    "ci", max_examples=_BASE, derandomize=True, database=None, deadline=None, print_blob=True
)
settings.register_profile(
    "nightly",
    max_examples=_BASE * NIGHTLY_FACTOR,
    derandomize=False,
    database=None,
    deadline=None,
    print_blob=True,
)


def load() -> None:
    """Load the profile DISTBENCH_HYPOTHESIS names (default `ci`); an unknown name fails the session, naming it."""
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in ("ci", "nightly"):
        raise ValueError(f"{PROFILE_ENV}={name!r}: the hypothesis profiles are 'ci' (default) and 'nightly'")
    settings.load_profile(name)


def cases(n: int) -> settings:
    """Settings of a property test that draws `n` cases under `ci` (what its cases cost decides n), scaled by
    the profile loaded: NIGHTLY_FACTOR times as many under `nightly`. Everything else comes from the profile."""
    return settings(max_examples=max(1, n * settings.default.max_examples // _BASE))


def narrowed(estimate: float, low: float, high: float, shrink: float) -> tuple[float, float]:
    """The ends of an interval around `estimate` whose sides are `shrink` (0 to 1) of [low, high]'s: what more
    samples make of it. Kept inside [low, high]: estimate - (estimate - low) rounds below a low of 1e-160, and
    an interval that grew by rounding is no narrower one (the nightly profile found that case)."""
    return max(low, estimate - shrink * (estimate - low)), min(high, estimate + shrink * (high - estimate))


def ordered(a: float, b: float) -> tuple[float, float]:
    """(low, high) of two drawn ends, for st.floats(low, high): a signed zero is made 0.0, since sorted() keeps
    (0.0, -0.0) as it is (they compare equal) and hypothesis reads floats(0.0, -0.0) as an empty range."""
    low, high = sorted((a, b))
    return low + 0.0, high + 0.0
