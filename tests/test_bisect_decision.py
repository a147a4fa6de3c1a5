"""What a test-mode run of `distbench bisect` counts as good, over generated pytest outcomes (hypothesis).
The same examples every run (derandomize), so a failure reproduces from its log alone."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the `test` extra's hypothesis generates these histories")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROPERTIES = settings(max_examples=150, deadline=None, derandomize=True, database=None)


SUMMARY_WORDS = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "errors", "warnings")


@PROPERTIES
@given(
    st.sampled_from((None, 0, 1, 2, 3, 4, 5, -9)),
    st.dictionaries(st.sampled_from(SUMMARY_WORDS), st.integers(1, 3)),
    st.booleans(),
)
def test_a_pytest_run_is_good_only_where_the_node_ran_and_passed(rc, counts, raised):
    """Whatever pytest's exit status (None: killed at the timeout) and summary line: the candidate is good
    only where the node ran and passed (exit 0, a count passed, none failed nor errored), bad only where it
    ran and failed (exit 1, a count failed); a node that did not run (skipped, deselected, xfailed, an error
    in collection or in a fixture, no pytest there) is a skip. What is said of it is one line, with the error
    pytest printed."""
    from distbench.gate.history import node_outcome

    said_as = {w: w.removesuffix("s") if k == 1 else w for w, k in counts.items()}  # "1 error", "2 errors"
    summary = ", ".join(f"{k} {said_as[w]}" for w, k in counts.items()) or "no tests ran"
    error = ["E   ModuleNotFoundError: No module named 'x'"] if raised else []
    outcome, said = node_outcome(rc, "\n".join(["tests/test_x.py F", *error, f"{summary} in 0.12s"]))
    passed, failed, errors = (counts.get(w, 0) for w in ("passed", "failed", "errors"))
    good = rc == 0 and passed and not failed and not errors
    assert outcome == ("good" if good else "bad" if rc == 1 and failed else "skip"), (outcome, said)
    assert "\n" not in said and said.startswith(summary) and raised == ("No module named 'x'" in said)
