"""The one-line forms of a multi-line failure that reports and errors quote (distbench/errors.py)."""

from __future__ import annotations

from distbench.errors import error_line, first_line

RANK_FAILURE = """job bench failed at world size 2: rank 0 raised ConfigError
===== rank 0: error =====
Traceback (most recent call last):
  File "x.py", line 1, in <module>
    run()
distbench.errors.ConfigError: micro_batch 3 does not divide global_batch 8

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
RuntimeError: later"""


def test_first_line_is_the_summary_cut_to_its_limit() -> None:
    assert first_line(RANK_FAILURE) == "job bench failed at world size 2: rank 0 raised ConfigError"
    assert first_line(RANK_FAILURE, 8) == "job benc"
    assert first_line("\n  padded\nmore") == "padded"
    assert first_line(None) == first_line("") == first_line(" \n ") == ""


def test_error_line_is_the_first_raised_exception() -> None:
    assert error_line(RANK_FAILURE) == (
        "distbench.errors.ConfigError: micro_batch 3 does not divide global_batch 8"
    )
    assert error_line("no traceback here\nsecond") == "no traceback here"
    assert error_line("") == ""
