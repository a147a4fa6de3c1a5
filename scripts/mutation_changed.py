"""Mutation-test what a change did to the modules that decide a verdict, in the per-change CI.

    python scripts/mutation_changed.py [--base REF] [--time-limit S] [--max-children N]
    python scripts/mutation_changed.py --modules src/distbench/measure/adaptive.py ...   # whole modules

Finds the functions and methods of the guarded modules (tests/mutation_guards.json) whose lines the change
touched (`git diff` of the work tree against --base: by default the merge base with origin/main, or HEAD~1
on main itself), and runs mutmut on only their mutants, against only those modules' guarding tests, in a
copy of the checkout (the work tree is never changed). It exits 1 when a mutant survives that
tests/mutation_equivalent.json does not list, naming each (`mutmut show NAME` in the copy prints its diff);
3 (undecided) when none survived but not all were judged within --time-limit; 0 otherwise. A change that
touches no guarded function ends at once, having run nothing.

The nightly run (docs/mutation-testing.md) mutates every guarded module; this one holds a change to the
functions it touched, so a rule cannot land untested.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_score", ROOT / "scripts" / "mutation_score.py")
assert _spec is not None and _spec.loader is not None
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

#: mutmut's separator in a method's mangled name: xǁClassǁmethod
_SEP = "\N{LATIN LETTER LATERAL CLICK}"
#: the exit status when no mutant survived but some were not judged within the time limit
UNDECIDED = 3
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", re.M)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def default_base() -> str:
    """The merge base with origin/main; HEAD~1 where that is HEAD itself (a commit on main: its own change) or
    there is no origin/main."""
    try:
        base = git("merge-base", "HEAD", "origin/main").strip()
        if base != git("rev-parse", "HEAD").strip():
            return base
    except subprocess.CalledProcessError:
        pass
    try:
        return git("rev-parse", "HEAD~1").strip()
    except subprocess.CalledProcessError:
        raise SystemExit("no base to diff against: give --base REF") from None


def changed_lines(diff: str) -> dict[str, set[int]]:
    """Per file of a `git diff -U0`, the lines of the new version that the change added or replaced; a hunk that
    only removed lines counts the line after the removal (the code around it changed meaning)."""
    out: dict[str, set[int]] = {}
    path = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None
            continue
        m = _HUNK.match(line)
        if m and path is not None:
            start, count = int(m.group(1)), int(m.group(2) or 1)
            out.setdefault(path, set()).update(range(start, start + count) if count else {start, start + 1})
    return out


def functions(source: str) -> list[tuple[str, int, int]]:
    """(mutmut's mangled name, first line, last line) of each module-level function and method of a
    module-level class: what mutmut mutates, named as it names them (x_f, xǁCǁm). Decorators count as lines
    of their function."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((f"x_{node.name}", first_line(node), node.end_lineno or node.lineno))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"x{_SEP}{node.name}{_SEP}{item.name}"
                    out.append((name, first_line(item), item.end_lineno or item.lineno))
    return out


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def touched(
    guards: dict[str, list[str]], lines: dict[str, set[int]], read: dict[str, str]
) -> dict[str, list[str]]:
    """Per guarded module touched, the mangled names of its functions whose lines the change touched."""
    out: dict[str, list[str]] = {}
    for path in sorted(guards.keys() & lines.keys()):
        names = [n for n, lo, hi in functions(read[path]) if any(lo <= x <= hi for x in lines[path])]
        if names:
            out[path] = names
    return out


def patterns(found: dict[str, list[str]]) -> list[str]:
    """mutmut's mutant-name patterns of the functions found (a function's mutants are NAME__mutmut_N)."""
    return [f"{ms.module_name(p)}.{n}__mutmut_*" for p, names in found.items() for n in names]


def configured(pyproject: str, modules: list[str], tests: list[str]) -> str:
    """pyproject.toml's text with [tool.mutmut] mutating `modules` against `tests` only."""
    listed = ",\n".join(f'    "{x}"' for x in modules)
    text = re.sub(r"^only_mutate = \[.*?\]", f"only_mutate = [\n{listed},\n]", pyproject, flags=re.M | re.S)
    listed = ",\n".join(f'    "{x}"' for x in tests)
    return re.sub(
        r"^pytest_add_cli_args_test_selection = \[.*?\]",
        f"pytest_add_cli_args_test_selection = [\n{listed},\n]",
        text,
        flags=re.M | re.S,
    )


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files (what the change is), into `dest`."""
    for rel in git("ls-files", "-co", "--exclude-standard", "-z").split("\0"):
        if rel and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


def verdict(by_mutant: dict[str, str], wanted: list[str]) -> tuple[list[str], list[str]]:
    """(survivors, not judged) among the mutants of the wanted patterns' functions."""
    mine = {n: s for n, s in by_mutant.items() if any(fnmatch.fnmatch(n, p) for p in wanted)}
    survivors = sorted(n for n, s in mine.items() if s not in ms.DETECTED | ms.UNJUDGED | {"equivalent"})
    unjudged = sorted(n for n, s in mine.items() if s in ms.UNJUDGED)
    return survivors, unjudged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", help="the ref the change is diffed against (default: see above)")
    parser.add_argument(
        "--modules", nargs="+", help="mutate these guarded modules whole, not a change's functions"
    )
    parser.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds mutmut may run (default 600)"
    )
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument(
        "--results", type=Path, help="write `mutmut results --all true` here (for mutation_score.py)"
    )
    args = parser.parse_args(argv)
    guards: dict[str, list[str]] = ms.load_json(ms.GUARDS)
    if args.modules:
        unknown = sorted(set(args.modules) - guards.keys())
        if unknown:
            parser.error(f"not a guarded module (tests/mutation_guards.json): {', '.join(unknown)}")
        wanted = [f"{ms.module_name(p)}.*" for p in args.modules]
        modules = list(args.modules)
    else:
        base = args.base or default_base()
        lines = changed_lines(git("diff", "-U0", "--no-color", base, "--", *guards))
        found = touched(guards, lines, {p: (ROOT / p).read_text() for p in lines if (ROOT / p).exists()})
        if not found:
            print(f"mutation of the change since {base[:12]}: no guarded function changed; nothing to run")
            return 0
        wanted, modules = patterns(found), list(found)
        print(
            f"mutation of the change since {base[:12]}: {len(wanted)} function(s) of {len(modules)} module(s)"
        )
        for p in wanted:
            print(f"  {p}")
    tests = sorted({t for m in modules for t in guards[m]})
    work = args.keep or Path(tempfile.mkdtemp(prefix="distbench-mutation-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(work, modules, tests, wanted, args)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _run(
    work: Path, modules: list[str], tests: list[str], wanted: list[str], args: argparse.Namespace
) -> int:
    copy_checkout(work)
    (work / "pyproject.toml").write_text(configured((work / "pyproject.toml").read_text(), modules, tests))
    mutmut = [sys.executable, "-m", "mutmut"]
    t0 = time.monotonic()
    # its own session: mutmut's workers go with it when the time limit stops it
    proc = subprocess.Popen(
        [*mutmut, "run", "--max-children", str(args.max_children), *wanted],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=args.time_limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    took = time.monotonic() - t0
    if not timed_out and proc.returncode != 0:
        if "nothing matches" in output:  # the changed functions hold nothing mutmut mutates
            print(f"no mutants in the changed functions ({took:.0f} s)")
            return 0
        print(output[-4000:], file=sys.stderr)
        print("mutmut failed before judging the mutants (above)", file=sys.stderr)
        return 2
    results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=work, capture_output=True, text=True)
    if args.results:
        args.results.write_text(results.stdout)
    equivalent = ms.load_json(ms.EQUIVALENT)
    by_mutant = ms.statuses(results.stdout, equivalent)
    survivors, unjudged = verdict(by_mutant, wanted)
    judged = sum(1 for n in by_mutant if any(fnmatch.fnmatch(n, p) for p in wanted)) - len(unjudged)
    print(f"{judged} mutant(s) judged in {took:.0f} s against {', '.join(tests)}")
    if args.modules:
        run_here = {ms.module_name(m) for m in modules}
        baseline = {m: b for m, b in ms.load_json(ms.BASELINE).items() if m in run_here}
        print(ms.summary(ms.scores(by_mutant), baseline, by_mutant, equivalent))
    for n in survivors:
        print(
            f"SURVIVED {n} ({by_mutant[n]}): test it, or list it in tests/mutation_equivalent.json with why"
        )
    if survivors:
        return 1
    if timed_out or unjudged:
        print(
            f"{len(unjudged)} mutant(s) not judged within --time-limit {args.time_limit:.0f} s",
            file=sys.stderr,
        )
        return UNDECIDED
    return 0


if __name__ == "__main__":
    sys.exit(main())
