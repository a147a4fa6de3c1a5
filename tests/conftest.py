"""pytester's in-process runs (test_plugin, test_lanes, test_claims, ...) take every module first imported
inside them back out of sys.modules when they end; torch, imported again after that, crashed the process (a
segfault, or a UnicodeDecodeError inside torch/__init__) whenever those tests ran before anything else had
imported it, as in `pytest tests/test_plugin.py tests/test_report.py`. Imported here, it is never first
imported inside such a run."""

import locale
from collections.abc import Iterator

import pytest
import torch  # noqa: F401

import properties  # noqa: E402

properties.load()  # the hypothesis profile (default: derandomized), before any test module is imported


@pytest.fixture
def ascii_locale() -> Iterator[None]:
    """The C locale for LC_CTYPE during the test, the one before it restored after: the locale's own encoding
    is then ASCII, so a file read in that encoding instead of as UTF-8 fails on its first non-ASCII byte."""
    was = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    yield
    locale.setlocale(locale.LC_CTYPE, was)
