"""Every global random stream a user's model may draw from survives a capture and restore in full
(workloads/global_rng.py): not only a generator's key and position, but what it holds between draws too
(numpy's and Python's spare normal deviate), through a checkpoint's weights-only file."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distbench.workloads import global_rng
from properties import cases

#: Draws a model, an augmentation or a sampler makes, each read back as plain numbers. The normal deviates
#: come in pairs (numpy's legacy polar method, Python's `random.gauss`): an odd count leaves one waiting.
DRAWS: dict[str, Callable[[], list[float]]] = {
    "torch.rand": lambda: torch.rand(3).tolist(),
    "torch.randn": lambda: torch.randn(3).tolist(),
    "np.random_sample": lambda: np.random.random_sample(3).tolist(),
    "np.standard_normal": lambda: np.random.standard_normal(1).tolist(),
    "np.normal": lambda: [float(np.random.normal())],
    "random.random": lambda: [random.random()],
    "random.gauss": lambda: [random.gauss(0.0, 1.0)],
    "random.randrange": lambda: [float(random.randrange(1000))],
}
SEQUENCES = st.lists(st.sampled_from(list(DRAWS)), max_size=6)


@pytest.fixture(autouse=True)
def _generators_put_back() -> Iterator[None]:
    """The test draws and seeds the process's generators: put back as they were, read without the code under
    test, so no later test sees streams this one moved."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def _draw(names: list[str]) -> list[list[float]]:
    return [DRAWS[name]() for name in names]


def _through_a_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a resume reads it: torch.save, then torch.load with weights_only=True."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@cases(25)
@given(st.integers(0, 2**32 - 1), SEQUENCES, st.integers(0, 2**32 - 1), SEQUENCES, SEQUENCES.filter(bool))
def test_a_restored_process_draws_what_the_captured_one_would_have(seed, before, other_seed, between, after):
    """Property: whatever was drawn before the capture (a spare normal deviate left waiting or not), and
    whatever the rebuilt process seeded and drew before its restore, every generator then draws exactly what
    the captured process drew next, draw for draw."""
    global_rng.seed_all(seed)
    _draw(before)
    saved = _through_a_checkpoint(global_rng.capture())
    expected = _draw(after)
    global_rng.seed_all(other_seed)
    _draw(between)
    global_rng.restore(saved)
    assert _draw(after) == expected


def test_preserved_leaves_every_generator_as_it_was_spare_deviates_included():
    """global_rng.preserved (a user's factory probed for its vocabulary) leaves each generator's whole
    state: a probe that drew an odd count of normal deviates changes numpy's and Python's spare one too."""
    np.random.standard_normal(1)  # a spare deviate waiting, as a model initialised from numpy leaves one
    random.gauss(0.0, 1.0)
    before = np.random.get_state(), random.getstate(), torch.get_rng_state()
    with global_rng.preserved():
        global_rng.seed_all(7)
        _draw(list(DRAWS))
    after = np.random.get_state(), random.getstate(), torch.get_rng_state()
    assert before[0][0] == after[0][0] and (before[0][1] == after[0][1]).all()
    assert before[0][2:] == after[0][2:], "numpy's position or spare deviate moved"
    assert before[1] == after[1] and torch.equal(before[2], after[2])
