"""The one way a test imports a package that an opt-in extra installs: `need(module)`.

A test that needs such a package and finds it missing fails, naming the package and the line that installs
it; it never skips. A skip for a missing package is a hole the tier's summary hides: the README's `pytest`
once passed on CI (which installed every extra) and failed on a newcomer's fresh install. The default tier
needs only what the README's `.[test]` installs (history's packages included); the tests of the other extras
carry a marker the default tier leaves out (`trace`) or run in the slow tier, after CI installs `.[dev]`.
tests/test_extras.py fails when a test module imports one of these packages directly.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

#: Each opt-in extra of pyproject.toml and the top-level modules its packages give (test_extras.py holds this
#: to pyproject.toml and to the installed distributions).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "history": ("asv", "asv_runner", "ruptures"),
    "trace": ("hta",),
    "lint": ("ruff", "mypy", "pre_commit"),
    "docs": ("sphinx", "myst_parser", "furo"),
    "mutation": ("mutmut",),
}
#: The extras the README's `pip install --no-build-isolation -e ".[test]"` brings along with `test`.
IN_TEST = ("history",)


def extra_of(module: str) -> str | None:
    """The extra whose packages give `module` (a dotted name), or None for any other module."""
    top = module.split(".")[0]
    return next((extra for extra, mods in EXTRA_MODULES.items() if top in mods), None)


def install_line(extra: str) -> str:
    """The command that installs `extra`: the README's own line for those it brings."""
    return f"pip install --no-build-isolation -e '.[{'test' if extra in IN_TEST else extra}]'"


def need(module: str) -> ModuleType:
    """Import `module`, which an opt-in extra installs, or fail the test naming it and its install line."""
    extra = extra_of(module)
    if extra is None:
        raise ValueError(
            f"{module} is no extra's package: import it directly (tests/extras.py EXTRA_MODULES)"
        )
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(
            f"needs {module} (the '{extra}' extra), which is not installed ({e}): {install_line(extra)}",
            pytrace=False,
        )
