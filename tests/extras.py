"""Tests of opt-in extras skip, naming the install, where the extra is absent; CI, the gate, installs every
extra and sets DISTBENCH_REQUIRE_EXTRAS=1 so that such a skip fails instead of passing unseen."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE = "DISTBENCH_REQUIRE_EXTRAS"


def need(module: str, extra: str) -> ModuleType:
    """Import `module`, which the `distbench[extra]` extra installs, or skip (fail under REQUIRE) saying so."""
    try:
        return importlib.import_module(module)
    except ImportError:
        why = f"needs {module} from an opt-in extra: pip install --no-build-isolation -e '.[{extra}]'"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{why} ({REQUIRE}=1: every extra must be installed here)", pytrace=False)
        pytest.skip(why)
