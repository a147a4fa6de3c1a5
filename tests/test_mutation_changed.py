"""The per-change mutation run (scripts/mutation_changed.py): which functions a diff touched, named as mutmut
names their mutants, and when the run fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutation_changed.py"
_spec = importlib.util.spec_from_file_location("mutation_changed", SCRIPT)
assert _spec is not None and _spec.loader is not None
mc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)

SOURCE = """\
LIMIT = 3


def free(x):
    return x + 1


class Rule:
    @property
    def bound(self):
        return LIMIT

    def check(self, x):
        return x < LIMIT
"""

DIFF = """\
diff --git a/src/distbench/a.py b/src/distbench/a.py
--- a/src/distbench/a.py
+++ b/src/distbench/a.py
@@ -5 +5 @@ def free(x):
-    return x + 2
+    return x + 1
@@ -12,0 +13,2 @@ class Rule:
+    def check(self, x):
+        return x < LIMIT
diff --git a/src/distbench/b.py b/src/distbench/b.py
--- a/src/distbench/b.py
+++ b/src/distbench/b.py
@@ -9,2 +8,0 @@
-    x = 1
-    y = 2
diff --git a/src/distbench/gone.py b/src/distbench/gone.py
--- a/src/distbench/gone.py
+++ /dev/null
@@ -1 +0,0 @@
-x = 1
"""


def test_a_diff_gives_the_new_versions_changed_lines():
    """Added or replaced lines of the new version; a pure removal marks the lines around where it was; a
    deleted file has none."""
    assert mc.changed_lines(DIFF) == {"src/distbench/a.py": {5, 13, 14}, "src/distbench/b.py": {8, 9}}


def test_functions_are_named_as_mutmut_names_them_with_their_lines():
    sep = "\N{LATIN LETTER LATERAL CLICK}"
    assert mc.functions(SOURCE) == [
        ("x_free", 4, 5),
        (f"x{sep}Rule{sep}bound", 9, 11),  # the decorator is the function's
        (f"x{sep}Rule{sep}check", 13, 14),
    ]


def test_only_guarded_modules_functions_the_diff_touched_are_run():
    """A change at module level (a constant) or in an unguarded module runs nothing; the patterns are
    mutmut's names of the touched functions' mutants."""
    guards = {"src/distbench/a.py": ["tests/test_a.py"]}
    read = {"src/distbench/a.py": SOURCE}
    found = mc.touched(guards, {"src/distbench/a.py": {5, 13}, "src/distbench/c.py": {1}}, read)
    sep = "\N{LATIN LETTER LATERAL CLICK}"
    assert found == {"src/distbench/a.py": ["x_free", f"x{sep}Rule{sep}check"]}
    assert mc.patterns(found) == [
        "distbench.a.x_free__mutmut_*",
        f"distbench.a.x{sep}Rule{sep}check__mutmut_*",
    ]
    assert mc.touched(guards, {"src/distbench/a.py": {1}}, read) == {}  # LIMIT = 3: no function


def test_the_run_mutates_only_the_changed_modules_against_their_guards():
    pyproject = 'x = 1\nonly_mutate = [\n    "src/a/*",\n]\npytest_add_cli_args_test_selection = ["t.py"]\n'
    text = mc.configured(pyproject, ["src/distbench/a.py"], ["tests/test_a.py", "tests/test_b.py"])
    assert 'only_mutate = [\n    "src/distbench/a.py",\n]' in text
    assert 'pytest_add_cli_args_test_selection = [\n    "tests/test_a.py",\n    "tests/test_b.py",\n]' in text
    assert text.startswith("x = 1\n")


def test_a_survivor_fails_the_run_unless_listed_equivalent_and_an_unjudged_mutant_is_named():
    results = """\
    distbench.a.x_free__mutmut_1: killed
    distbench.a.x_free__mutmut_2: survived
    distbench.a.x_free__mutmut_3: no tests
    distbench.a.x_free__mutmut_4: not checked
    distbench.a.x_other__mutmut_1: survived
"""
    wanted = ["distbench.a.x_free__mutmut_*"]
    survivors, unjudged = mc.verdict(mc.ms.statuses(results), wanted)
    assert survivors == ["distbench.a.x_free__mutmut_2", "distbench.a.x_free__mutmut_3"]
    assert unjudged == ["distbench.a.x_free__mutmut_4"]
    listed = {"distbench.a.x_free__mutmut_2": "x + 1 and 1 + x"}
    assert mc.verdict(mc.ms.statuses(results, listed), wanted)[0] == ["distbench.a.x_free__mutmut_3"]
