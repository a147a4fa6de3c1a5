"""The tables scripts/seed004_repeats.sh prints last: for every configuration its tokens/s in each repeat, the
largest distance of a repeat from the median of the repeats, its 95% interval in the last repeat, and the
plausibility flags; the same for its device compute floor per step (each compute kernel at its fastest over
the sampled steps: the history's device series, which neither the host's speed nor the other rank's NCCL
kernels move) and the step's idle device time (at one GPU, the wait for the host's launches), with the
share of the step the device was busy; then each repeat's wall time and flagged
rows, and the trace split of the shortfalls.

    python scripts/seed004_repeats.py OUT
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from distbench.gaps import explain, shortfalls
from distbench.plausibility import check
from distbench.results import load_results


def main(out: Path) -> None:
    stages = list(csv.DictReader((out / "stages.tsv").open(), delimiter="\t"))
    print(f"== seed 004 repeats on {(out / 'machine.txt').read_text().splitlines()[0]} ==")
    runs = []
    for st in stages:
        d = out / st["stage"]
        results = [r for r in load_results(d) if r.get("status") == "ok"] if d.exists() else []
        flags = check(results)
        runs.append((st, {(r["config"]["strategy"], r["config"]["world_size"], r["config"]["precision"]): r
                          for r in results}, flags))  # fmt: skip
    keys = sorted({k for _, rs, _ in runs for k in rs}, key=lambda k: (k[2], k[1], k[0]))
    head = " ".join(f"{st['stage']:>10}" for st, _, _ in runs)
    print(f"{'config':25} {head} {'max off':>8} {'95% CI':>14}  flags")
    worst = 0.0
    for key in keys:
        tps = [rs[key]["metrics"]["tokens_per_s"] if key in rs else None for _, rs, _ in runs]
        got = [t for t in tps if t]
        med = statistics.median(got) if got else 0.0
        off = max(abs(t / med - 1) for t in got) if len(got) > 1 else float("nan")
        worst = max(worst, off) if len(got) > 1 else worst
        last = next(rs[key] for _, rs, _ in reversed(runs) if key in rs)
        ci = last["step_time_s"].get("interval")
        st_med = last["metrics"]["step_time_s"]
        ci_txt = f"{(ci[0] / st_med - 1) * 100:+.1f}/{(ci[1] / st_med - 1) * 100:+.1f}%" if ci else "-"
        flagged = sorted(
            {w.split(":")[0] for _, rs, fl in runs if key in rs for w in fl.get(rs[key]["id"], [])}
        )
        cells = " ".join(f"{t:>10,.0f}" if t else f"{'-':>10}" for t in tps)
        print(
            f"{key[0] + ' ws' + str(key[1]) + ' ' + key[2]:25} {cells} {off * 100:>7.1f}% {ci_txt:>14}  {'; '.join(flagged)}"
        )
    print(f"largest distance from a row's median: {worst * 100:.1f}%")
    _ms_table("device floor ms/step", _floor, keys, runs, head)
    _ms_table("device idle ms/step", _idle, keys, runs, head)
    for st, rs, fl in runs:
        n_flag = sum(1 for r in rs.values() if fl.get(r["id"]))
        print(
            f"{st['stage']}: {st['wall_s']} s (limit {st['limit_s']}), exit {st['exit']}, {len(rs)} rows, "
            f"{n_flag} flagged"
        )
    print("shortfalls over 5% at 2 GPUs in the first repeat (ms per traced step, against DDP's)")
    first = list(runs[0][1].values()) if runs else []
    for short in shortfalls(first, [2]):
        why = explain(first, short) or {}
        mine, vs = why, why.get("vs_ddp") or {}
        parts = ", ".join(
            f"{k[:-3]} {mine[k]:.1f} ({vs.get(k, 0):+.1f})"
            for k in ("compute_ms", "non_compute_ms", "idle_ms", "host_wait_ms")
            if mine.get(k) is not None
        )
        print(
            f"  {short.strategy:11} ws{short.world_size} {short.gap:6.1%} below {short.against}: "
            + (
                f"{parts}; grew most: {vs.get('largest')} (from its {mine['source']})"
                if mine
                else "not measured"
            )
        )


def _floor(result: dict) -> float | None:
    return result["metrics"].get("device_compute_floor_s")


def _idle(result: dict) -> float | None:
    """Seconds of the timed step with no work on the device: the step less the device-time sample's busy time
    (NCCL kernels left out) and its communication that ran alone. At one GPU, the wait for the host's
    launches."""
    busy = result["metrics"].get("device_busy_s")
    exposed = (result.get("device_time") or {}).get("exposed_comm_s", 0.0)  # none before distbench had it
    return None if busy is None else max(0.0, result["metrics"]["step_time_s"] - busy - exposed)


def _ms_table(title: str, figure: Callable[[dict], float | None], keys: list, runs: list, head: str) -> None:
    """One row per configuration: `figure` of its result in ms in each repeat, its largest distance from the
    row's median, and the share of the step the device was busy."""
    print(f"\n{title:25} {head} {'max off':>8} {'busy':>10}")
    worst = 0.0
    for key in keys:
        got = [figure(rs[key]) if key in rs else None for _, rs, _ in runs]
        busy = [b for _, rs, _ in runs if key in rs and (b := rs[key]["metrics"].get("busy_ratio"))]
        present = [v for v in got if v is not None]
        if not present:
            continue
        med = statistics.median(present)
        off = max(abs(v - med) for v in present) / med if med else 0.0
        worst = max(worst, off)
        cells = " ".join(f"{v * 1e3:>10.1f}" if v is not None else f"{'-':>10}" for v in got)
        span = f"{min(busy) * 100:.0f}-{max(busy) * 100:.0f}%" if busy else "-"
        print(f"{key[0] + ' ws' + str(key[1]) + ' ' + key[2]:25} {cells} {off * 100:>7.1f}% {span:>10}")
    print(f"largest distance from a row's median: {worst * 100:.1f}%")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
