#!/usr/bin/env bash
# Evidence for `distbench nightly` (nights measured against a frozen reference, docs/reference-runs.md) on one GPU.
#
# MODE=aa (default): seed 004's strategies at one GPU (single, ddp, fsdp_full, fsdp_grad, zero2, zero3), GPT-2 124M
# in bf16-amp, measured against a reference that is this same checkout (an A/A night), NIGHTS nights back to back.
# Prints per row and night the step-time ratio head/reference, its deviation from the row's median over the nights
# (targets: +-1% on device-bound rows, +-2% on host-bound ones) and head's absolute step time with its deviation
# beside it, then each night's wall time (target: at most 10 minutes). Not timed on a GPU yet: planned from a bisect
# probe's pairs on one H200 (27 s each for GPT-2 355M with 20 timed steps; fresh rank processes for both sides, a
# build and a warm-up are most of it), about 20 s a pair here, so 6 rows x 3 pairs take 6-7 minutes a night and
# three nights 18-20 minutes; ROWS="ddp fsdp_full zero2" halves it, NIGHTS=2 takes a third off.
#
# MODE=plant: a 3% host-side slowdown (scripts/plants/host-step-3pct.patch: a busy loop on the training thread at the
# optimizer step, on the step's critical path in a host-bound row) planted in revision 1 of a repository made from
# this checkout's src under OUT/repo. BEFORE short nights of revision 0 and AFTER of revision 1, each one row
# (PLANT_ROW, default fsdp_full: device busy 0.67-0.85) against a frozen reference (a worktree of revision 0), then
# `distbench history --nights PATH` on the ratio series must find the change at revision 1. Planned: 5 + 5 nights
# of about 70 s (two servers' start and 3 pairs), 11-12 minutes on one H200; BEFORE=4 AFTER=4 takes 9 minutes, but
# then a perfect separation's p is 0.03-0.044 against --alpha 0.05 (5 + 5: 0.009-0.017, docs/history.md). The
# after-nights' mean ratio over the before-nights' is the plant's
# slowdown as measured side by side (15 pairs a side); LONG_AB=1 adds a `distbench ab` of revision 1 against 0.
#
# Usage: scripts/relative_nightly_gpu.sh OUT     writes OUT/nights/ (every night.json and its runs), OUT/summary.md,
# OUT/junit.xml, OUT/machine.txt, OUT/nightly.log; prints the summary table last; exit 0 when every check passed.
# Knobs: NIGHTS (3), PAIRS (3), NIGHT_BUDGET (900 s: a night's pairs stop there), ROWS, CONFIG (the workload flags; on CPU: CONFIG="-n 1 -m gpt2-tiny --precision fp32
# --micro-batch 2 --steps 4 --windows 2 --warmup 1 --device cpu", as tests/test_relative.py runs it), BEFORE (5),
# AFTER (5), PLANT_ROW, DISTBENCH_PLANT_SHARE (0.03), HISTORY (more `distbench history` flags; default --alpha 0.05:
# 5 + 5 nights cannot reach p < 0.01, docs/history.md "How much it takes").
set -euo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/relative_nightly_gpu.sh OUT}
mode=${MODE:-aa}
root=$(pwd)
[ -f "$root/scripts/plants/host-step-3pct.patch" ] || { echo "run from the distbench checkout" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf "$out/nights" "$out/repo" "$out/ref" "$out"/rev-* "$out/history" "$out/ab"
machine_txt "$out/machine.txt" || true
pairs=${PAIRS:-3}
config=${CONFIG:-"-n 1 -m gpt2-124m --precision bf16-amp --micro-batch 8 --steps 16 --windows 8 --warmup 4"}
: > "$out/nightly.log"
distbench() {  # the runner's own distbench (this checkout), whatever head and reference are
  PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m distbench.cli "$@"
}
night() {  # night NAME FLAGS...: one `distbench nightly` into OUT/nights/NAME, its wall time in OUT/nights/NAME.s
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  # shellcheck disable=SC2086  # CONFIG is a flag list
  distbench nightly $config --pairs "$pairs" --budget "${NIGHT_BUDGET:-900}" "$@" -o "$out/nights/$name" 2>&1 |
    tee -a "$out/nightly.log" || rc=$?
  echo "$(($(date +%s) - t0))" > "$out/nights/$name.s"
  [ "$rc" = 0 ] || echo "night $name: exit $rc" | tee -a "$out/nightly.log"
}

if [ "$mode" = aa ]; then
  rows=${ROWS:-"single ddp fsdp_full fsdp_grad zero2 zero3"}
  for n in $(seq 1 "${NIGHTS:-3}"); do
    night "night-$n" -s "${rows// /,}" --reference "tree=$root"
  done
elif [ "$mode" = plant ]; then
  export DISTBENCH_PLANT_SHARE=${DISTBENCH_PLANT_SHARE:-0.03}
  export GIT_AUTHOR_NAME="distbench evidence" GIT_AUTHOR_EMAIL="evidence@distbench.invalid"
  export GIT_COMMITTER_NAME="$GIT_AUTHOR_NAME" GIT_COMMITTER_EMAIL="$GIT_AUTHOR_EMAIL"
  export GIT_AUTHOR_DATE="2026-01-01T00:00:00Z" GIT_COMMITTER_DATE="2026-01-01T00:00:00Z"
  repo=$out/repo
  mkdir -p "$repo"
  tar -C "$root" --exclude=__pycache__ --exclude='*.pyc' -cf - src | tar -C "$repo" -xf -
  (
    cd "$repo"
    git init -q -b main
    git add -A && git commit -q -m "revision 0: this checkout's src"
    patch -sp1 < "$root/scripts/plants/host-step-3pct.patch"
    git add -A && git commit -q -m "revision 1: host-step-3pct"
  )
  git -C "$repo" worktree add -q --detach "$out/ref" main~1  # the frozen reference: revision 0
  git -C "$repo" worktree add -q --detach "$out/rev-0" main~1
  git -C "$repo" worktree add -q --detach "$out/rev-1" main
  row=${PLANT_ROW:-fsdp_full}
  before=${BEFORE:-5}
  after=${AFTER:-5}
  for n in $(seq 1 "$((before + after))"); do
    rev=$([ "$n" -le "$before" ] && echo 0 || echo 1)
    night "$(printf 'night-%02d' "$n")" -s "$row" --head "tree=$out/rev-$rev" --reference "tree=$out/ref"
  done
  rc=0
  # shellcheck disable=SC2086  # HISTORY is a flag list
  distbench history --nights "$out/nights" --metric step_time_s --repo "$repo" ${HISTORY:---alpha 0.05} \
    -o "$out/history" 2>&1 | tee -a "$out/nightly.log" || rc=$?
  if [ "${LONG_AB:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    distbench ab --base "tree=$out/rev-0" --head "tree=$out/rev-1" -s "$row" $config --bind-cpus --numerics off \
      --min-pairs 6 --max-pairs 12 --budget 300 -o "$out/ab" 2>&1 | tee -a "$out/nightly.log" || true
  fi
  for d in ref rev-0 rev-1; do git -C "$repo" worktree remove --force "$out/$d"; done
else
  echo "MODE is aa or plant, not $mode" >&2
  exit 2
fi

PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" python3 - "$out" "$mode" <<'PY'
import json, statistics, subprocess, sys
from pathlib import Path
from xml.sax.saxutils import escape

from distbench.gate.relative import find_nights

out, mode = Path(sys.argv[1]), sys.argv[2]
nights = find_nights([out / "nights"])
walls = {p.stem: int(p.read_text()) for p in sorted((out / "nights").glob("*.s"))}
cases, lines = [], []


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
            ((lambda r: r.ratios["step_time_s"].ratio if "step_time_s" in r.ratios else None, "C0", "ratio"),
             (lambda r: r.head.get("step_time_s"), "C1", "absolute"))
        ):
            xs = [pick(r) for r in rows if r is not None]
            xs = [x for x in xs if x]
            if xs:
                mid = statistics.median(xs)
                ax.plot([i + 0.15 * (2 * k - 1)] * len(xs), [100 * (x / mid - 1) for x in xs], "o", color=color,
                        label=name if i == 0 else None)
    for band in (1, 2):
        ax.axhline(band, color="grey", linestyle=":", linewidth=0.8)
        ax.axhline(-band, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(labels)), [lb.split(" ")[0] for lb in labels])
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel("off the row's median over the nights (%)")
    ax.set_title("step time per night: ratio to the reference against absolute (targets +-1% / +-2%)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if mode == "aa":
    labels = sorted({r.label for n in nights for r in n.rows})
    lines.append("| row | regime | night | ratio head/ref [interval] | off median | head step ms | off median |")
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
        case(f"{label} ratio within {target:.0%} of its median", len(got) == len(nights) and worst <= target,
             f"ratios {[round(x, 4) for x in got]}: worst {worst:.2%} (absolute: worst {hworst:.2%})")
    plot_repeats(nights, labels, out / "repeats.png")
    lines.append("figure: repeats.png (each night's deviation from the row's median: ratio against absolute)")
    for name, s in walls.items():
        case(f"{name} wall time at most 10 minutes", s <= 600, f"{s} s")
    case("every night stored its rows", len(nights) == len(walls) and bool(labels),
         f"{len(nights)} night.json of {len(walls)} nights, {len(labels)} rows")
    lines.append("")
    lines.append("wall time per night: " + ", ".join(f"{k} {v} s" for k, v in walls.items()))
else:
    revs = subprocess.run(["git", "-C", str(out / "repo"), "log", "--reverse", "--format=%H %s"],
                          capture_output=True, text=True).stdout
    name = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1].split(":")[0] for ln in revs.splitlines()}
    lines.append("| night | head | ratio head/ref [interval] | head step ms | wall s |")
    lines.append("|---|---|---|---|---|")
    per = {}
    for n, (night, s) in zip(nights, sorted(walls.items()), strict=False):
        (r,) = n.rows
        iv = r.ratios.get("step_time_s")
        per.setdefault(name.get(n.commit, n.commit), []).append(iv.ratio if iv else None)
        ratio = f"{iv.ratio:.4f} [{iv.low:.4f}, {iv.high:.4f}]" if iv else (r.error or "missing")
        head = f"{1000 * r.head['step_time_s']:.2f}" if "step_time_s" in r.head else "-"
        lines.append(f"| {night} | {name.get(n.commit, n.commit)} | {ratio} | {head} | {s} |")
    b, a = ([x for x in per.get(k, []) if x] for k in ("revision 0", "revision 1"))
    measured = statistics.mean(a) / statistics.mean(b) - 1 if a and b else float("nan")
    lines.append("")
    lines.append(f"the plant as the nights measured it: {pct(measured)} (mean ratio after / before)")
    changes = json.loads((out / "history" / "history.json").read_text())
    ratio_changes = [c for c in changes if "head/reference" in c["series"]]
    for c in ratio_changes:
        lo, hi = (100 * (x - 1) for x in c["ratio_interval"])
        lines.append(f"change point: {c['series']}: {name.get(c['last_good'])} -> {name.get(c['first_bad'])}, "
                     f"{100 * (c['ratio'] - 1):+.2f}% [{lo:+.2f}%, {hi:+.2f}%], p {c['p_value']:.3f}")
    at = [c for c in ratio_changes if name.get(c["first_bad"]) == "revision 1" and c["regression"]]
    case("the ratio series' change is found at the plant's commit", len(at) == 1 and len(ratio_changes) == 1,
         "; ".join(lines[-len(ratio_changes):]) if ratio_changes else "no change point in the ratio series")
    ab = out / "ab" / "ab.json"
    if ab.exists():
        lines.append(f"long A/B of revision 1 against 0: {ab}")
for name_, ok, detail in cases:
    lines.append(f"- {'PASS' if ok else 'FAIL'}: {name_}: {detail}")
text = "\n".join(lines) + "\n"
(out / "summary.md").write_text(text)
failures = sum(not ok for _, ok, _ in cases)
xml = [f'<testsuite name="relative_nightly_{mode}" tests="{len(cases)}" failures="{failures}">']
for name_, ok, detail in cases:
    xml.append(f'  <testcase classname="relative_nightly.{mode}" name="{escape(name_, {chr(34): "&quot;"})}">')
    if not ok:
        xml.append(f'    <failure message="{escape(detail, {chr(34): "&quot;"})}"/>')
    xml.append("  </testcase>")
xml.append("</testsuite>")
(out / "junit.xml").write_text("\n".join(xml) + "\n")
print(text)
sys.exit(1 if failures or not cases else 0)
PY
