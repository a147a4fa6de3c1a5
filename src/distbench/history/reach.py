"""How small a step each series can find: a history that finds nothing has said little until it says what it
would have found.

A series' reach is the smallest step of its level that the change-point search (changepoints.find_changes, the
same search `distbench history` runs) places at its point in POWER of DRAWS generated series: the points since
the series' last change, then `after` points moved by the step, each with normal noise of the series' own
size. The search is scale-free (ranks for its test, the log in noise sigmas for the rest), so a reach is a
number of noise sigmas that depends only on the counts and alpha; it is found once for each and scaled by
each series' noise. On a cloud VM this is what tells a ratio series (noise about 1% a night) from an absolute
one (10-30%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .changepoints import find_changes, noise_scale

#: the share of generated series in which the step must be found at its point
POWER = 0.8
#: generated series per step size tried
DRAWS = 60
#: the largest step tried, in noise sigmas; a step the search cannot find below it is out of reach
MAX_SIGMAS = 16.0
#: halvings of [0, MAX_SIGMAS] in the search for the smallest step: a reach to 1/64 of MAX_SIGMAS
HALVINGS = 6


@dataclass(frozen=True)
class Reach:
    """What one series can find with `after` more points."""

    points: int  # the points since the series' last change (or its first point)
    noise: float  # a point's noise, relative (0.01: 1%)
    step: float | None  # the smallest relative step found at its point, POWER of the time; None: out of reach


def found_share(before: int, after: int, sigmas: float, alpha: float, seed: int = 0) -> float:
    """In how many of DRAWS generated series (`before` points of unit normal noise, then `after` points moved
    by `sigmas`) the search places a change exactly at the first moved point."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((DRAWS, before + after))
    step = np.r_[np.zeros(before), np.full(after, sigmas)]
    hits = 0
    for i, z in enumerate(noise):
        changes = find_changes(np.exp(0.01 * (z + step)), alpha=alpha, seed=seed + i)
        hits += any(c.index == before for c in changes)
    return hits / DRAWS


@lru_cache(maxsize=64)
def smallest_sigmas(before: int, after: int, alpha: float) -> float | None:
    """The smallest step, in noise sigmas, found at its point POWER of the time (every size tried on the same
    draws, so that sizes differ by their size alone), to 1/2**HALVINGS of MAX_SIGMAS; None when even
    MAX_SIGMAS is not."""
    if found_share(before, after, MAX_SIGMAS, alpha) < POWER:
        return None
    low, high = 0.0, MAX_SIGMAS
    for _ in range(HALVINGS):
        mid = (low + high) / 2
        if found_share(before, after, mid, alpha) >= POWER:
            high = mid
        else:
            low = mid
    return high


def reach(values: list[float], since: int, after: int, alpha: float) -> Reach:
    """The reach of a series of positive `values` whose last change (0: none) is before point `since`."""
    segment = np.log(np.asarray(values[since:], dtype=float))
    # a segment of one figure repeated (a memory peak) has no noise: any step separates it
    sd = noise_scale(segment) if np.ptp(segment) > 0 else 0.0
    sigmas = smallest_sigmas(len(segment), after, alpha)
    return Reach(len(segment), math.expm1(sd), None if sigmas is None else math.expm1(sigmas * sd))
