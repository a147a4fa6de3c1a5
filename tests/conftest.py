"""pytester's in-process runs (test_plugin, test_lanes, test_claims, ...) take every module first imported
inside them back out of sys.modules when they end; torch, imported again after that, crashed the process (a
segfault, or a UnicodeDecodeError inside torch/__init__) whenever those tests ran before anything else had
imported it, as in `pytest tests/test_plugin.py tests/test_report.py`. Imported here, it is never first
imported inside such a run."""

import torch  # noqa: F401

import properties  # noqa: E402

properties.load()  # the hypothesis profile (default: derandomized), before any test module is imported
