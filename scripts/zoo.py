"""The zoo: real upstream regressions that distbench's upgrade gate must catch (docs/zoo.md).

    python scripts/zoo.py [--case ID ...] [--venvs DIR] [--output DIR] [--github-summary]
    python scripts/zoo.py --list

Each case in zoo/cases.yaml names a package (DeepSpeed, transformers), its last good and first bad release, and
the gate's checks. For a case the runner builds two virtualenvs that differ only in that package (cached under
--venvs): each sees this interpreter's packages (torch, distbench's dependencies at whatever this environment
holds, the lock's in CI) behind its own copy of the package at the case's version. Then every check runs on the
good release and on the bad one:

- an `ab` check is `distbench ab` with the good release as base: against itself (an A/A run, which must pass)
  and against the bad release (which must fail with a regression or a divergence);
- a `suite` check is pytest over this checkout's invariant tests under the release's interpreter (must pass
  under the good release, fail under the bad one).

A check marked `must_catch` that passes on the bad release, or any check that fails on the good one, fails the
case; a check not marked is a known gap, run and reported all the same. A case that no check of the gate reaches
yet carries a `gap` of its own: nothing runs for it, and it fails the run until a check catches it. The results table (case, check, verdict
on good, verdict on bad, seconds) is written to --output as zoo.md and zoo.json; the exit status is 1 when any
case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import yaml
from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator, model_validator

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "zoo" / "cases.yaml"
#: Where each package's tracker lives: a case's links must point there (its issue or pull request).
REPOS = {
    "deepspeed": "deepspeedai/DeepSpeed",
    "transformers": "huggingface/transformers",
    "torch": "pytorch/pytorch",
}
#: What a run's exit status says. `distbench ab`: 0 pass, 1 regression, 4 numerics diverged (both a catch);
#: 2 usage and 3 undecided are neither a pass nor a catch. pytest: 0 passed, 1 some test failed.
CAUGHT = {"ab": {1, 4}, "suite": {1}}
Side = Literal["good", "bad"]
Verdict = Literal["pass", "caught", "error"]


class Check(BaseModel):
    """One way of the gate to look at a case: `distbench ab` flags, or the invariant tests to run under head."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9-]+$")
    kind: Literal["ab", "suite"]
    args: list[str] = Field(min_length=1)
    must_catch: bool
    gap: str | None = None

    @model_validator(mode="after")
    def _gap_says_what_would_catch_it(self) -> Check:
        if not self.must_catch and not self.gap:
            raise ValueError(
                f"check {self.name}: a check that need not catch the case is a gap; say in `gap` what would"
            )
        if self.kind == "ab" and any(a in ("--base", "--head") for a in self.args):
            raise ValueError(
                f"check {self.name}: the runner sets --base and --head; give the other flags only"
            )
        return self


class Case(BaseModel):
    """One real upstream regression: where it was reported, between which releases, and how the gate sees it."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9.-]+$")
    package: Literal["deepspeed", "transformers", "torch"]
    good: str
    bad: str
    fixed: str | None = None
    kind: Literal["correctness", "checkpoint", "speed"]
    links: list[HttpUrl] = Field(min_length=1)
    symptom: str = Field(min_length=20)
    checks: list[Check] = []
    gap: str | None = None

    @field_validator("good", "bad", "fixed")
    @classmethod
    def _a_release(cls, v: str | None) -> str | None:
        if v is not None:
            Version(v)  # raises InvalidVersion, which pydantic reports with the field
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Case:
        if not Version(self.good) < Version(self.bad):
            raise ValueError(
                f"{self.id}: the good release {self.good} must come before the bad one {self.bad}"
            )
        if self.fixed and not Version(self.bad) < Version(self.fixed):
            raise ValueError(f"{self.id}: the fix {self.fixed} must come after the bad release {self.bad}")
        prefix = f"https://github.com/{REPOS[self.package]}/"
        if not any(
            str(u).startswith(prefix + "issues/") or str(u).startswith(prefix + "pull/") for u in self.links
        ):
            raise ValueError(f"{self.id}: link the upstream issue or pull request under {prefix}")
        names = [c.name for c in self.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.id}: check names repeat: {names}")
        catching = any(c.must_catch for c in self.checks)
        if not catching and not self.gap:
            raise ValueError(
                f"{self.id}: no check must catch it; give one, or say in `gap` what the gate lacks"
            )
        if catching and self.gap:
            raise ValueError(f"{self.id}: a must-catch check catches it, so it is no gap; drop `gap`")
        return self


class Zoo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cases: list[Case] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Zoo:
        ids = [c.id for c in self.cases]
        if len(set(ids)) != len(ids):
            raise ValueError(f"case ids repeat: {ids}")
        return self


def load(path: Path = CASES) -> list[Case]:
    """The cases, validated (pydantic's error names the case and field)."""
    return Zoo.model_validate(yaml.safe_load(path.read_text())).cases


@dataclass(frozen=True)
class Run:
    """One check on one side: its verdict, exit status and seconds, and where its output went."""

    case: str
    check: str
    side: Side
    verdict: Verdict
    rc: int
    seconds: float
    log: str


def verdict_of(kind: str, rc: int) -> Verdict:
    """pass (exit 0), caught (the check's own failure statuses) or error (anything else: a crash, a usage
    error, an undecided gate), so that a broken environment never counts as a catch."""
    return "pass" if rc == 0 else "caught" if rc in CAUGHT[kind] else "error"


@dataclass(frozen=True)
class Outcome:
    case: str
    ok: bool
    caught_by: tuple[str, ...]
    problems: tuple[str, ...]


def decide(case: Case, runs: Sequence[Run]) -> Outcome:
    """A case holds when every check passes on the good release and every must-catch check catches the bad
    one; a gap check (not must-catch) may pass on the bad release, but not fail on the good one."""
    by = {(r.check, r.side): r for r in runs}
    problems = [f"gap: {case.gap}"] if case.gap else []
    for c in case.checks:
        good, bad = by.get((c.name, "good")), by.get((c.name, "bad"))
        if good is None or bad is None:
            problems.append(f"{c.name}: not run on both releases")
            continue
        if good.verdict != "pass":
            problems.append(f"{c.name}: {good.verdict} on the good release {case.good} (exit {good.rc})")
        if c.must_catch and bad.verdict != "caught":
            problems.append(f"{c.name}: {bad.verdict} on the bad release {case.bad} (exit {bad.rc})")
    caught = tuple(
        c.name for c in case.checks if (c.name, "bad") in by and by[c.name, "bad"].verdict == "caught"
    )
    return Outcome(case.id, not problems, caught, tuple(problems))


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def venv_python(venvs: Path, package: str, version: str) -> Path:
    return venvs / f"{package}-{version}" / "bin" / "python"


def ensure_venv(venvs: Path, package: str, version: str, log: Path) -> Path:
    """A virtualenv holding `package==version` before this interpreter's packages (a .pth adds them after its
    own), built once: the package alone is installed (DeepSpeed from its sdist against the torch here), and
    DeepSpeed's CPU communication op is compiled into the venv's own extension folder, so no check's time holds
    the compile and two DeepSpeed releases never share a build."""
    root = venvs / f"{package}-{version}"
    python = root / "bin" / "python"
    ready = root / ".zoo-ready"
    if ready.exists():
        return python
    # --without-pip: ensurepip's own setuptools (65.5 under Python 3.11) would shadow this environment's, and
    # a --no-build-isolation build of DeepSpeed's sdist then failed without `wheel` (invalid command
    # 'bdist_wheel'); this interpreter's pip and setuptools, reached through the .pth, install into the venv
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(root)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "zz_zoo_base.pth").write_text(f"import site; site.addsitedir({site_packages()!r})\n")
    # DeepSpeed: --no-deps, its dependencies are this environment's; transformers: its own tokenizers and hub
    # where this environment's are out of its range
    deps = ["--no-deps"] if package == "deepspeed" else []
    with log.open("a") as out:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--no-build-isolation", *deps, f"{package}=={version}"],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        if package == "deepspeed":
            build = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"
            subprocess.run(
                [str(python), "-c", build],
                check=True,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env_for(root),
            )
    ready.write_text(f"{package}=={version}\n")
    return python


def env_for(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
        "PYTHONPATH": str(ROOT / "src"),
    }


def variant(python: Path) -> str:
    """`distbench ab`'s variant for a venv: its interpreter, and its own torch extensions folder for the ranks."""
    return f"python={python},env.TORCH_EXTENSIONS_DIR={python.parent.parent / 'torch_extensions'}"


def command(check: Check, good: Path, side: Path, out: Path) -> tuple[list[str], Path]:
    """One check's argument list on one side (`side`: the interpreter under test; for `ab`, head against the
    good release as base), and the venv whose environment it runs in."""
    if check.kind == "ab":
        cli = [sys.executable, "-c", "import sys; from distbench.cli import main; sys.exit(main())"]
        return [
            *cli,
            "ab",
            "--base",
            variant(good),
            "--head",
            variant(side),
            "-o",
            str(out),
            *check.args,
        ], good
    return [str(side), "-m", "pytest", "-p", "no:cacheprovider", "-q", *check.args], side


def run_case(case: Case, venvs: Path, out: Path, timeout: float) -> list[Run]:
    """Build the case's two venvs and run each check on the good release, then on the bad one."""
    if not case.checks:
        return []
    logs = out / "logs" / case.id
    logs.mkdir(parents=True, exist_ok=True)
    good = ensure_venv(venvs, case.package, case.good, logs / "venvs.log")
    bad = ensure_venv(venvs, case.package, case.bad, logs / "venvs.log")
    runs = []
    for check in case.checks:
        sides: tuple[tuple[Side, Path], ...] = (("good", good), ("bad", bad))
        for side, python in sides:
            log = logs / f"{check.name}-{side}.log"
            argv, home = command(check, good, python, logs / f"{check.name}-{side}")
            start = time.monotonic()
            with log.open("w") as f:
                try:
                    rc = subprocess.run(
                        argv,
                        cwd=ROOT,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env_for(home.parent.parent),
                        timeout=timeout,
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
            seconds = time.monotonic() - start
            runs.append(
                Run(
                    case.id,
                    check.name,
                    side,
                    verdict_of(check.kind, rc),
                    rc,
                    round(seconds, 1),
                    str(log.relative_to(out)),
                )
            )
            print(
                f"{case.id} {check.name} on {side}: {runs[-1].verdict} (exit {rc}, {seconds:.0f} s)",
                flush=True,
            )
    return runs


def table(cases: Sequence[Case], runs: Sequence[Run], outcomes: Sequence[Outcome]) -> str:
    """The results as markdown: one row per case and check, then each failing case's problems."""
    by = {(r.case, r.check, r.side): r for r in runs}
    rows = [
        "| case | good -> bad | check | must catch | on good | on bad | seconds (good, bad) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        if case.gap:
            rows.append(
                f"| {case.id} | {case.package} {case.good} -> {case.bad} | none reaches it (gap) | | | | |"
            )
        for c in case.checks:
            g, b = by.get((case.id, c.name, "good")), by.get((case.id, c.name, "bad"))
            if g is None or b is None:
                continue
            rows.append(
                f"| {case.id} | {case.package} {case.good} -> {case.bad} | {c.name} | "
                f"{'yes' if c.must_catch else 'no (gap)'} | {g.verdict} | {b.verdict} | {g.seconds:.0f}, {b.seconds:.0f} |"
            )
    failing = [f"- **{o.case}**: " + "; ".join(o.problems) for o in outcomes if not o.ok]
    held = sum(o.ok for o in outcomes)
    return "\n".join([f"## The zoo: {held} of {len(outcomes)} cases held", "", *rows, "", *failing, ""])


def main(
    argv: Sequence[str] | None = None, runner: Callable[[Case, Path, Path, float], list[Run]] = run_case
) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", help="run only this case (repeat for more; default: all)")
    p.add_argument("--cases", type=Path, default=CASES, help="the case file (default: zoo/cases.yaml)")
    p.add_argument(
        "--venvs",
        type=Path,
        default=Path.home() / ".cache" / "distbench-zoo",
        help="where the cases' virtualenvs are built and kept",
    )
    p.add_argument("--output", "-o", type=Path, default=Path("zoo-results"))
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before one check on one side is cut"
    )
    p.add_argument("--list", action="store_true", help="list the cases and their checks, run nothing")
    p.add_argument("--github-summary", action="store_true", help="append the table to $GITHUB_STEP_SUMMARY")
    args = p.parse_args(argv)
    cases = load(args.cases)
    unknown = set(args.case or ()) - {c.id for c in cases}
    if unknown:
        p.error(f"no such case: {', '.join(sorted(unknown))}; --list names them")
    cases = [c for c in cases if not args.case or c.id in args.case]
    if args.list:
        for c in cases:
            checks = ", ".join(k.name + ("" if k.must_catch else " (gap)") for k in c.checks) or "none (gap)"
            print(f"{c.id}: {c.package} {c.good} -> {c.bad} ({c.kind}); checks: {checks}")
        return 0
    args.output.mkdir(parents=True, exist_ok=True)
    args.venvs.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for case in cases:
        runs += runner(case, args.venvs, args.output, args.timeout)
    outcomes = [decide(c, [r for r in runs if r.case == c.id]) for c in cases]
    md = table(cases, runs, outcomes)
    (args.output / "zoo.md").write_text(md)
    (args.output / "zoo.json").write_text(
        json.dumps({"runs": [asdict(r) for r in runs], "outcomes": [asdict(o) for o in outcomes]}, indent=1)
        + "\n"
    )
    if args.github_summary and os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)
    print(md)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
