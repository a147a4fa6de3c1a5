"""Which host-side figure is quiet enough to gate a host-bound configuration? Reads `distbench ab` output
directories (base/ and head/ hold one result per run, each run in fresh rank processes) and prints, per
configuration and candidate figure, the spread across runs of each variant (CV of the run values: the noise
a gate pays per run) and head's change against base (the ratio of the variants' medians), so a planted
host-side slowdown can be read against each figure's noise.

    python scripts/host_noise.py OUT/aa OUT/host-5pct OUT/host-sleep-5pct
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _speed(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in r["host"]["speed"][0] if w]


def _ref(r: dict[str, Any]) -> float:
    """The run's reference time: the median of the readings around its windows (measure/hostspeed.py)."""
    return statistics.median(x for w in _speed(r) for x in w["ref_s"])


def _threads_cpu(r: dict[str, Any]) -> float:
    """CPU seconds per step of the main and autograd threads over the timed windows."""
    ws = _speed(r)
    cpu = sum(w["threads"]["main_cpu_s"] + w["threads"]["autograd_cpu_s"] for w in ws)
    return cpu / len(r["host"]["host_s"])


#: candidate figure -> how a run's value is read from its result
CANDIDATES: dict[str, Any] = {
    "reference launch time": _ref,
    "wall / reference": lambda r: r["metrics"]["step_time_s"] / _ref(r),
    "host issue / reference": lambda r: statistics.median(r["host"]["host_s"]) / _ref(r),
    "main+autograd CPU": _threads_cpu,
    "main+autograd CPU / ref": lambda r: _threads_cpu(r) / _ref(r),
    "run-queue wait (main)": lambda r: sum(w["threads"]["main_wait_s"] for w in _speed(r)),
    "steal share": lambda r: statistics.mean(w["steal"] for w in _speed(r)),
    "wall (step_time_s)": lambda r: r["metrics"]["step_time_s"],
    "wall, fastest window": lambda r: min(r["step_time_s"]["windows"]),
    "host issue, median": lambda r: statistics.median(r["host"]["host_s"]),
    "host issue, p10": lambda r: _pct(r["host"]["host_s"], 0.1),
    "host CPU, median": lambda r: statistics.median(r["host"]["cpu_s"]),
    "host CPU, p10": lambda r: _pct(r["host"]["cpu_s"], 0.1),
    "instructions, median": lambda r: statistics.median(r["host"]["instructions"]),
    "device compute": lambda r: r["metrics"]["device_compute_s"],
    "busy ratio": lambda r: r["metrics"]["busy_ratio"],
}


def runs(side: Path) -> dict[str, list[dict[str, Any]]]:
    """Results of one variant by configuration, in the order they ran."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in sorted(side.glob("*.json")):
        r = json.loads(f.read_text())
        if r.get("status") == "ok":
            c = r["config"]
            by[f"{c['strategy']} ws{c['world_size']} {c['model']} mb{c['micro_batch']}"].append(r)
    for rs in by.values():
        rs.sort(key=lambda r: r["created"])
    return by


def values(rs: list[dict[str, Any]], read: Any) -> list[float] | None:
    try:
        return [float(read(r)) for r in rs]
    except (KeyError, TypeError, ValueError, statistics.StatisticsError):
        return None


def main(dirs: list[str]) -> None:
    for d in map(Path, dirs):
        base, head = runs(d / "base"), runs(d / "head")
        for label in sorted(base):
            b_rs, h_rs = base[label], head.get(label, [])
            regime = b_rs[0].get("regime") or {}
            missing = (b_rs[0].get("host") or {}).get("counters_missing")
            print(
                f"\n{d.name}: {label}, {len(b_rs)} base / {len(h_rs)} head runs, "
                f"regime {regime.get('regime')} (busy {regime.get('busy_ratio', 0):.2f})"
                + (f"; counters: {missing}" if missing else "")
            )
            print(f"  {'figure':24} {'base median':>12} {'base CV':>8} {'head CV':>8} {'head/base':>10}")
            for name, read in CANDIDATES.items():
                b, h = values(b_rs, read), values(h_rs, read)
                if not b or len(b) < 2 or statistics.mean(b) == 0:
                    print(f"  {name:24} {'(none)' if not b else statistics.median(b):>12}")
                    continue
                cv_b = statistics.stdev(b) / statistics.mean(b)
                line = f"  {name:24} {statistics.median(b):12.5g} {cv_b:8.2%}"
                if h and len(h) >= 2 and statistics.median(b) > 0:
                    cv_h = statistics.stdev(h) / statistics.mean(h)
                    line += f" {cv_h:8.2%} {statistics.median(h) / statistics.median(b) - 1:+10.2%}"
                print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
