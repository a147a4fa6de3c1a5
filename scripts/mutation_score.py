"""The nightly mutation score of the decision modules against the committed baseline, which may only go up.

    mutmut results --all true > mutants/results.txt
    python scripts/mutation_score.py mutants/results.txt [--summary FILE] [--update]
    python scripts/mutation_score.py --table     # docs/mutation-testing.md's table, from the baseline

A module's score is the share of its mutants the tests detect (killed, timed out, crashed or refused by the
type checker) among those that ran or had no test, less the ones tests/mutation_equivalent.json lists as
equivalent (a change no outcome can show, each with its reason): a mutant no test reaches counts against the
score, as it is a change nothing would notice. The job fails when any module's score is below its score in
tests/mutation_baseline.json; a module the baseline does not list yet is reported, not judged. The summary
(GitHub's job summary) holds each module's score beside its baseline and every surviving mutant by name
(`mutmut show NAME` prints its diff). `--update` writes the counts measured into the baseline where the score
is higher and the run judged every mutant of the module, the way to record an improvement in a commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "mutation_baseline.json"
#: mutant name -> why it is equivalent to the original (no outcome can tell them apart)
EQUIVALENT = ROOT / "tests" / "mutation_equivalent.json"
#: the mutated modules' paths -> the tests that guard each ([tool.mutmut] is its keys and the union of its values)
GUARDS = ROOT / "tests" / "mutation_guards.json"
#: docs/mutation-testing.md's table lies between these lines
TABLE_START, TABLE_END = "<!-- mutation-table: start -->", "<!-- mutation-table: end -->"
#: mutmut's statuses that mean the tests noticed the mutant
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
#: statuses that judge nothing: the run was cut short, or the mutant was never tried
UNJUDGED = {"skipped", "not checked", "check was interrupted by user", "suspicious"}


def statuses(results: str, equivalent: dict[str, str] | None = None) -> dict[str, str]:
    """Mutant name -> status, from the lines `mutmut results --all true` prints ("    NAME: STATUS"); a
    survivor listed in `equivalent` is "equivalent"."""
    out = {}
    for line in results.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            out[name] = "equivalent" if equivalent and name in equivalent and status == "survived" else status
    return out


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def module_of(mutant: str) -> str:
    """distbench.gate.stats for distbench.gate.stats.x_verdict__mutmut_3 (a method's name holds no dot)."""
    return mutant.rsplit(".", 1)[0]


def scores(by_mutant: dict[str, str]) -> dict[str, dict[str, float | int]]:
    """Per module: mutants judged (equivalent ones included), detected, equivalent, and the score (detected /
    judged less equivalent; modules with none judged are left out)."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for mutant, status in by_mutant.items():
        counts[module_of(mutant)][status] += 1
    out: dict[str, dict[str, float | int]] = {}
    for module, c in sorted(counts.items()):
        judged = sum(n for s, n in c.items() if s not in UNJUDGED)
        detected = sum(n for s, n in c.items() if s in DETECTED)
        equivalent = c["equivalent"]
        if judged > equivalent:
            out[module] = {
                "judged": judged,
                "detected": detected,
                "equivalent": equivalent,
                "score": round(detected / (judged - equivalent), 4),
            }
    return out


def dropped(measured: dict[str, dict[str, float | int]], baseline: dict[str, Any]) -> list[str]:
    """The modules whose score is below the baseline's, or that the baseline lists and the run judged none of."""
    return [
        m
        for m, floor in sorted(baseline.items())
        if m not in measured or float(measured[m]["score"]) < float(floor["score"])
    ]


def module_name(path: str) -> str:
    """distbench.gate.stats for src/distbench/gate/stats.py."""
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def table(baseline: dict[str, Any], guards: dict[str, list[str]]) -> str:
    """Markdown: each mutated module's recorded counts, or "not yet run" where the baseline has none."""
    lines = ["| module | mutants | killed | equivalent | score |", "| --- | --- | --- | --- | --- |"]
    for m in sorted({module_name(p) for p in guards} | baseline.keys()):
        b = baseline.get(m)
        if b is None:
            lines.append(f"| `{m}` | not yet run | | | |")
        else:
            lines.append(
                f"| `{m}` | {b['judged']} | {b['detected']} | {b['equivalent']} | {float(b['score']):.1%} |"
            )
    return "\n".join(lines) + "\n"


def summary(
    measured: dict[str, dict[str, float | int]],
    baseline: dict[str, Any],
    by_mutant: dict[str, str],
    equivalent: dict[str, str] | None = None,
) -> str:
    """Markdown: the scores against the baseline, the surviving mutants by module, then the mutants listed as
    equivalent that the tests detected: their reason is wrong, or the name now numbers another mutant (one
    whose survival the stale entry would hide), so the entry goes."""
    low = set(dropped(measured, baseline))
    lines = [
        "## Mutation score of the decision modules",
        "",
        "| module | score | baseline | detected / judged less equivalent |",
    ]
    lines.append("| --- | --- | --- | --- |")
    for m in sorted(measured.keys() | baseline.keys()):
        s = measured.get(m)
        score = f"{float(s['score']):.1%}" if s else "not run"
        floor = f"{float(baseline[m]['score']):.1%}" if m in baseline else "not recorded"
        mark = " **dropped**" if m in low else ""
        counts = f"{s['detected']} / {int(s['judged']) - int(s['equivalent'])}" if s else "—"
        lines.append(f"| {m} | {score}{mark} | {floor} | {counts} |")
    survivors = sorted(n for n, st in by_mutant.items() if st not in DETECTED | UNJUDGED | {"equivalent"})
    lines += [
        "",
        f"### Surviving mutants ({len(survivors)}): `mutmut show NAME` prints each one's change",
        "",
    ]
    lines += [f"- `{n}` ({by_mutant[n]})" for n in survivors]
    stale = sorted(n for n, st in by_mutant.items() if st in DETECTED and n in (equivalent or {}))
    if stale:
        lines += ["", f"### Listed equivalent but detected ({len(stale)}): remove from {EQUIVALENT.name}", ""]
        lines += [f"- `{n}` ({by_mutant[n]})" for n in stale]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, nargs="?", help="the output of `mutmut results --all true`")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--equivalent", type=Path, default=EQUIVALENT)
    parser.add_argument("--summary", type=Path, help="append the markdown report to this file")
    parser.add_argument("--update", action="store_true", help="raise the baseline to the scores measured")
    parser.add_argument("--table", action="store_true", help="print the docs' table of the baseline")
    args = parser.parse_args(argv)
    baseline: dict[str, Any] = load_json(args.baseline)
    if args.table:
        print(table(baseline, load_json(GUARDS)), end="")
        return 0
    if args.results is None:
        parser.error("the results file is needed (or --table)")
    equivalent = load_json(args.equivalent)
    by_mutant = statuses(args.results.read_text(), equivalent)
    if not by_mutant:
        print(f"{args.results}: no mutant results (did `mutmut run` run?)", file=sys.stderr)
        return 2
    measured = scores(by_mutant)
    report = summary(measured, baseline, by_mutant, equivalent)
    print(report)
    if args.summary:
        with open(args.summary, "a") as f:
            f.write(report)
    if args.update:
        cut_short = {module_of(n) for n, st in by_mutant.items() if st in UNJUDGED}
        higher = {
            m: s
            for m, s in measured.items()
            if m not in cut_short and float(s["score"]) > float(baseline.get(m, {}).get("score", -1))
        }
        if cut_short:
            print(f"not recorded, their runs judged only some mutants: {', '.join(sorted(cut_short))}")
        raised = {**baseline, **higher}
        args.baseline.write_text(json.dumps(dict(sorted(raised.items())), indent=1) + "\n")
        return 0
    low = dropped(measured, baseline)
    if low:
        print(f"mutation score below the baseline in: {', '.join(low)}", file=sys.stderr)
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
