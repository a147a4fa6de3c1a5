"""The summary of scripts/relative_nightly_gpu.sh's nights: OUT/summary.md, OUT/junit.xml, OUT/repeats.png.

    python scripts/relative_nightly_summary.py OUT aa|plant

Reads every night under OUT/nights (night.json, and NAME.s beside each night's folder: its wall time); in
plant mode also OUT/repo (the two revisions) and OUT/history/history.json (`distbench history` over the
nights). Nights measured in several calls of the script (FIRST=...) are read together. Exit 0 when every
check passed, 1 otherwise.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from distbench.gate.relative import find_night_files

out, mode = Path(sys.argv[1]), sys.argv[2]
#: each night by its folder's name (its wall time is NAME.s beside it), oldest first
named = [(f.parent.name, night) for f, night in find_night_files([out / "nights"])]
nights = [n for _, n in named]
walls = {p.stem: int(p.read_text()) for p in sorted((out / "nights").glob("*.s"))}
cases: list[tuple[str, bool, str]] = []
lines: list[str] = []


def case(name: str, ok: bool, detail: str) -> None:
    cases.append((name, ok, detail))


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def plot_repeats(nights, labels, path: Path) -> None:
    """Per row, each night's step-time ratio and head's absolute step time as deviations from the row's median
    over the nights: what a ratio history holds still that an absolute one does not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, label in enumerate(labels):
        rows = [next((r for r in n.rows if r.label == label), None) for n in nights]
        for k, (pick, color, name) in enumerate(
            (
                (
                    lambda r: r.ratios["step_time_s"].ratio if "step_time_s" in r.ratios else None,
                    "C0",
                    "ratio",
                ),
                (lambda r: r.head.get("step_time_s"), "C1", "absolute"),
            )
        ):
            xs = [pick(r) for r in rows if r is not None]
            xs = [x for x in xs if x]
            if xs:
                mid = statistics.median(xs)
                ax.plot(
                    [i + 0.15 * (2 * k - 1)] * len(xs),
                    [100 * (x / mid - 1) for x in xs],
                    "o",
                    color=color,
                    label=name if i == 0 else None,
                )
    for band in (1, 2):
        ax.axhline(band, color="grey", linestyle=":", linewidth=0.8)
        ax.axhline(-band, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(labels)), [lb.split(" ")[0] for lb in labels])
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel("off the row's median over the nights (%)")
    ax.set_title(
        "step time per night: ratio to the reference against absolute (targets +-1% / +-2%)", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def aa_checks(named: list) -> None:
    """A/A nights of the grid: each row's ratio within its regime's bound of its median over the nights, head's
    absolute step time beside it; each night's wall time at most 10 minutes."""
    nights = [n for _, n in named]
    labels = sorted({r.label for n in nights for r in n.rows})
    lines.append(
        "| row | regime | night | ratio head/ref [interval] | off median | head step ms | off median |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for label in labels:
        rows = [next((r for r in n.rows if r.label == label), None) for n in nights]
        ratios = [r.ratios["step_time_s"].ratio if r and "step_time_s" in r.ratios else None for r in rows]
        heads = [r.head.get("step_time_s") if r else None for r in rows]
        regime = next((r.regime for r in rows if r and r.regime), "?")
        target = 0.01 if regime == "device-bound" else 0.02
        got = [x for x in ratios if x]
        mid = statistics.median(got) if got else float("nan")
        hmid = statistics.median([h for h in heads if h]) if any(heads) else float("nan")
        for i, (r, x, h) in enumerate(zip(rows, ratios, heads, strict=True), 1):
            iv = r.ratios["step_time_s"] if r and "step_time_s" in r.ratios else None
            ratio = f"{x:.4f} [{iv.low:.4f}, {iv.high:.4f}]" if iv else (r.error if r else "missing")
            off = pct(x / mid - 1) if x else "-"
            step, hoff = (f"{1000 * h:.2f}", pct(h / hmid - 1)) if h else ("-", "-")
            lines.append(f"| {label} | {regime} | {i} | {ratio} | {off} | {step} | {hoff} |")
        worst = max((abs(x / mid - 1) for x in got), default=float("inf"))
        hworst = max((abs(h / hmid - 1) for h in heads if h), default=float("nan"))
        case(
            f"{label} ratio within {target:.0%} of its median",
            len(got) == len(nights) and worst <= target,
            f"ratios {[round(x, 4) for x in got]}: worst {worst:.2%} (absolute: worst {hworst:.2%})",
        )
    plot_repeats(nights, labels, out / "repeats.png")
    lines.append("figure: repeats.png (each night's deviation from the row's median: ratio against absolute)")
    for name, _ in named:
        s = walls.get(name, 0)
        case(f"{name} wall time at most 10 minutes", s <= 600, f"{s} s")
    case(
        "every night stored its rows",
        all(name in walls for name, _ in named) and bool(labels),
        f"{len(nights)} night.json, {sum(name in walls for name, _ in named)} wall times, {len(labels)} rows",
    )
    lines.append("")
    lines.append("wall time per night: " + ", ".join(f"{name} {walls.get(name, '?')} s" for name, _ in named))


def plant_checks(named: list) -> None:
    """The plant's row in every night: its ratio per night by revision, the plant's size as the nights measured
    it, and the change `distbench history` found in the ratio series (OUT/history/history.json)."""
    (label,) = set.intersection(*({r.label for r in n.rows} for _, n in named))
    revs = subprocess.run(
        ["git", "-C", str(out / "repo"), "log", "--reverse", "--format=%H %s"], capture_output=True, text=True
    ).stdout
    revision = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1].split(":")[0] for ln in revs.splitlines()}
    size = out / "plant-size.json"
    if size.exists():
        z = json.loads(size.read_text())
        tried = ", ".join(f"{x:g}: {pct(y)}" for x, y in zip(z["shares"][1:], z["slowdown"][1:], strict=True))
        lines.append(
            f"the plant sized in one process ({z['rounds']} rounds of {z['window_steps']}-step windows): "
            f"share -> slowdown {tried}; share {z['share']:.4f} for {z['target']:.0%}"
            + (f" (of a {1000 * z['period_s']:.2f} ms period)" if "period_s" in z else "")
        )
    lines.append(f"{label}:")
    lines.append("| night | head | ratio head/ref [interval] | head step ms | wall s |")
    lines.append("|---|---|---|---|---|")
    per: dict[str, list[float | None]] = {}
    for name, n in named:
        r = next(r for r in n.rows if r.label == label)
        iv = r.ratios.get("step_time_s")
        per.setdefault(revision.get(n.commit, n.commit), []).append(iv.ratio if iv else None)
        ratio = f"{iv.ratio:.4f} [{iv.low:.4f}, {iv.high:.4f}]" if iv else (r.error or "missing")
        head = f"{1000 * r.head['step_time_s']:.2f}" if "step_time_s" in r.head else "-"
        what = f"{revision.get(n.commit, n.commit)}" + (
            f" (grid of {len(n.rows)})" if len(n.rows) > 1 else ""
        )
        lines.append(f"| {name} | {what} | {ratio} | {head} | {walls.get(name, '?')} |")
    b, a = ([x for x in per.get(k, []) if x] for k in ("revision 0", "revision 1"))
    measured = statistics.mean(a) / statistics.mean(b) - 1 if a and b else float("nan")
    lines.append("")
    lines.append(f"the plant as the nights measured it: {pct(measured)} (mean ratio after / before)")
    changes = json.loads((out / "history" / "history.json").read_text())
    ratio_changes = [c for c in changes if "head/reference" in c["series"]]
    for c in ratio_changes:
        lo, hi = (100 * (x - 1) for x in c["ratio_interval"])
        lines.append(
            f"change point: {c['series']}: {revision.get(c['last_good'])} -> {revision.get(c['first_bad'])}, "
            f"{100 * (c['ratio'] - 1):+.2f}% [{lo:+.2f}%, {hi:+.2f}%], p {c['p_value']:.3f}"
        )
    at = [c for c in ratio_changes if revision.get(c["first_bad"]) == "revision 1" and c["regression"]]
    case(
        "the ratio series' change is found at the plant's commit",
        len(at) == 1 and len(ratio_changes) == 1,
        "; ".join(lines[-len(ratio_changes) :]) if ratio_changes else "no change point in the ratio series",
    )
    ab = out / "ab" / "ab.json"
    if ab.exists():
        lines.append(f"long A/B of revision 1 against 0: {ab}")


def spread_lines(nights) -> list[str]:
    """Per row, where its step-time ratio's noise comes from: the pairs' spread about their night's mean (log
    ratios, pooled over the nights) against the windows' spread within a pair divided by the root of the
    windows a pair has (what of the pairs' spread window noise alone would make). Window noise is what more
    windows a pair would average; the rest (each pair's fresh processes) only more pairs do."""
    out = []
    for label in sorted({r.label for n in nights for r in n.rows}):
        between, within, per_pair = [], [], []
        for n in nights:
            iv = next((r.ratios.get("step_time_s") for r in n.rows if r.label == label), None)
            if iv is None or len(iv.pairs) < 2:
                continue
            logs = [math.log(x) for x in iv.pairs]
            mean = statistics.fmean(logs)
            between += [(x - mean) ** 2 for x in logs]
            for w in iv.windows:
                if len(w) >= 2:
                    within.append(statistics.variance([math.log(x) for x in w]))
                    per_pair.append(len(w))
        if not between or not within:
            continue
        pairs_sd = math.sqrt(sum(between) / (len(between) - 1))
        windows_sd = math.sqrt(statistics.fmean(within))
        from_windows = windows_sd / math.sqrt(statistics.fmean(per_pair))
        out.append(
            f"spread of {label}: pairs {pairs_sd:.2%} about their night's mean; windows {windows_sd:.2%} within "
            f"a pair, {from_windows:.2%} over its {statistics.fmean(per_pair):.0f} windows "
            f"({min(1.0, (from_windows / pairs_sd) ** 2):.0%} of the pairs' variance)"
        )
    return out


if mode == "aa":
    aa_checks(named)
else:
    grid = [(k, n) for k, n in named if len(n.rows) > 1]
    if grid:
        aa_checks(grid)
        lines.append("")
    plant_checks(named)

lines += ["", *spread_lines(nights)]
for name_, ok, detail in cases:
    lines.append(f"- {'PASS' if ok else 'FAIL'}: {name_}: {detail}")
text = "\n".join(lines) + "\n"
(out / "summary.md").write_text(text)
failures = sum(not ok for _, ok, _ in cases)
xml = [f'<testsuite name="relative_nightly_{mode}" tests="{len(cases)}" failures="{failures}">']
for name_, ok, detail in cases:
    xml.append(
        f'  <testcase classname="relative_nightly.{mode}" name="{escape(name_, {chr(34): "&quot;"})}">'
    )
    if not ok:
        xml.append(f'    <failure message="{escape(detail, {chr(34): "&quot;"})}"/>')
    xml.append("  </testcase>")
xml.append("</testsuite>")
(out / "junit.xml").write_text("\n".join(xml) + "\n")
print(text)
sys.exit(1 if failures or not cases else 0)
