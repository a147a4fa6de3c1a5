"""The short summary scripts/seed004_gpu.sh prints last: per stage its wall time and flagged rows, the matrix
beside seed 004's figures, its shortfalls with where their traced time went, and whether the planted host
disturbance was flagged.

    python scripts/seed004_summary.py OUT
"""

from __future__ import annotations

import csv
import sys
from datetime import datetime
from pathlib import Path

from distbench.gaps import explain, shortfalls
from distbench.plausibility import check
from distbench.results import load_results
from distbench.scaling import tokens_per_s


def flagged_rows(results: list[dict]) -> dict[str, list[str]]:
    """'strategy wsN' -> the first words of each warning of its runs, for the flagged configurations."""
    found = check(results)
    rows: dict[str, list[str]] = {}
    for r in results:
        for w in found.get(r["id"], []):
            rows.setdefault(f"{r['config']['strategy']} ws{r['config']['world_size']}", []).append(
                w.split(":")[0]
            )
    return rows


def main(out: Path) -> None:
    stages = list(csv.DictReader((out / "stages.tsv").open(), delimiter="\t"))
    print(f"\n== seed 004 on {(out / 'machine.txt').read_text().splitlines()[0]} ==")
    print(f"{'stage':10} {'wall s':>7} {'exit':>5} {'rows':>5} {'flagged':>8}  flags")
    loaded = {}
    for st in stages:
        d = out / st["stage"]
        results = [r for r in load_results(d) if r.get("status") == "ok"] if d.exists() else []
        loaded[st["stage"]] = results
        rows = {(r["config"]["strategy"], r["config"]["world_size"]) for r in results}
        flags = flagged_rows(results)
        cut = " (cut at its limit)" if st["exit"] in ("124", "130", "137") else ""
        print(f"{st['stage']:10} {st['wall_s']:>7} {st['exit']:>5} {len(rows):>5} {len(flags):>8}  "
              + "; ".join(f"{k}: {', '.join(sorted(set(v)))}" for k, v in flags.items()) + cut)  # fmt: skip
    matrix = loaded.get("matrix", [])
    if matrix:  # the configurations' own time, before the shortfalls' traces
        start = next(float(st["start"]) for st in stages if st["stage"] == "matrix")
        last = max(datetime.fromisoformat(r["created"]).timestamp() for r in matrix)
        print(
            f"\nmatrix: its {len(matrix)} configuration run(s) took {last - start:.0f} s (issue 41: at most 300)"
        )
    print("\nmatrix against seed 004 (tokens/s, median of runs)")
    for r in matrix:
        ref = r.get("reference")
        if ref:
            c = r["config"]
            print(f"  {c['strategy']:11} ws{c['world_size']} {tokens_per_s(r):>9,.0f}  seed {ref['tokens_per_s']:>9,.0f}"
                  f"  x{tokens_per_s(r) / ref['tokens_per_s']:.3f}")  # fmt: skip
    fsdp = {
        (r["config"]["strategy"], r["config"]["world_size"]): tokens_per_s(r)
        for r in matrix
        if r["config"]["strategy"].startswith("fsdp")
    }
    for mode in ("full", "grad"):
        for ws in (1, 2, 4):
            one, two = fsdp.get((f"fsdp1_{mode}", ws)), fsdp.get((f"fsdp_{mode}", ws))
            if one and two:
                print(f"  FSDP2 / FSDP1 {mode} ws{ws}: {two / one:.3f}")
    print("\nshortfalls over 5% (ms per traced step, against DDP's)")
    for short in shortfalls(matrix):
        why = explain(matrix, short) or {}
        vs = why.get("vs_ddp") or {}
        parts = ", ".join(
            f"{k[:-3]} {vs[k]:+.1f}"
            for k in ("compute_ms", "non_compute_ms", "idle_ms", "host_wait_ms")
            if k in vs
        )
        print(f"  {short.strategy:11} ws{short.world_size} {short.gap:6.1%} below {short.against}: "
              + (f"{parts}; grew most: {vs['largest']}" if vs else "not traced"))  # fmt: skip
    planted = loaded.get("planted", [])
    found = check(planted)
    hit = [r for r in planted if any("contended host" in w for w in found.get(r["id"], []))]
    print(f"\nplanted CPU-bound job: {len(hit)} of {len(planted)} run(s) flagged as a contended host")
    quiet = {(r["config"]["strategy"], r["config"]["world_size"]): tokens_per_s(r) for r in matrix}
    for r in planted:
        key = (r["config"]["strategy"], r["config"]["world_size"])
        if quiet.get(key):
            print(
                f"  {key[0]} ws{key[1]}: {tokens_per_s(r):,.0f} tokens/s, x{tokens_per_s(r) / quiet[key]:.3f} of the matrix's"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
