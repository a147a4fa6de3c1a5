"""The tier's workload for a model: a sequence the model's positions can hold (testsuite/suite.py)."""

from __future__ import annotations

from distbench.testsuite.suite import Suite


def test_the_gpu_tiers_sequence_is_cut_to_a_small_models_positions() -> None:
    # the tier's 256 would fail on the device
    assert Suite("cuda").config("ddp", 2, "gpt2-tiny").seq_len == 64
    assert Suite("cuda").config("ddp", 2, "gpt2-124m").seq_len == 256  # 1,024 positions: the tier's own
    assert Suite("cpu").config("ddp", 2, "gpt2-tiny").seq_len == 0  # 0: the model's own length


def test_a_given_sequence_length_is_kept() -> None:
    assert Suite("cuda").config("ddp", 2, "gpt2-tiny", seq_len=32).seq_len == 32
