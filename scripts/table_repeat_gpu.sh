#!/usr/bin/env bash
# Does the main job's table hold still? scripts/table_repeat_gpu.sh OUT runs `distbench run -o` (the README's
# main job, no other argument) twice back to back on one GPU and compares the two tables row by row (issue 69):
# each row's tokens/s must repeat within +/-5% and its speedup within +/-3%, or the row must be footnoted in
# the table (a note or a flag) in either run. About 6 minutes on one H200 (two runs of 2-3 minutes: six
# strategies resident at once, six rounds of windows); each run is cut at 270 s.
# Writes OUT/run1/ and OUT/run2/ (result JSON), OUT/run1.txt and OUT/run2.txt (the tables as printed),
# OUT/compare.md (row, tok/s run 1 and 2 and how far it moved, speedup run 1 and 2 and how far, footnoted?,
# loss @ step of both runs, verdict), OUT/junit-table-repeat.xml (one case per row) and OUT/machine.txt.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/table_repeat_gpu.sh OUT}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
root=$(pwd)
[ -f "$root/src/distbench/sidebyside.py" ] || { echo "run from the distbench checkout" >&2; exit 2; }
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
machine_txt "$out/machine.txt"
start=$(date +%s)
for n in 1 2; do
  echo "== run $n: distbench run -o $out/run$n ($(date +%T))"
  timeout -k 30 270 python3 -m distbench.cli run -o "$out/run$n" > "$out/run$n.txt" 2>&1
  echo $? > "$out/run$n.exit"
  echo "exit $(cat "$out/run$n.exit") after $(($(date +%s) - start)) s"
done
echo "wall $(($(date +%s) - start)) s"
python3 - "$out" <<'PY'
import sys
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from distbench.plausibility import SPEEDUP_HOLD, TOKENS_HOLD
from distbench.results import load_results

out = Path(sys.argv[1])
runs = []
for n in (1, 2):
    d = out / f"run{n}"
    runs.append({(r["config"]["strategy"], r["config"]["world_size"]): r for r in load_results(d)} if d.exists() else {})


def moved(a, b):
    return None if a is None or b is None else b / a - 1


def pct(x):
    return "—" if x is None else f"{x:+.1%}"


def fig(x, spec):
    return "—" if x is None else format(x, spec)


head = ("row", "tok/s run 1", "tok/s run 2", "moved", "speedup run 1", "speedup run 2", "moved",
        "footnoted?", "loss @ step (1 / 2)", "verdict")
lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
cases = []
for key in sorted(set(runs[0]) | set(runs[1]), key=lambda k: (k[1], k[0] != "single", k[0])):
    a, b = runs[0].get(key), runs[1].get(key)
    name = f"{key[0]} ws{key[1]}"
    if not a or not b or a["status"] != "ok" or b["status"] != "ok":
        verdict = "failed: missing or not ok in a run"
        lines.append(f"| {name} | | | | | | | | | {verdict} |")
        cases.append((name, verdict))
        continue
    ma, mb = a["metrics"], b["metrics"]
    t, s = moved(ma.get("tokens_per_s"), mb.get("tokens_per_s")), moved(ma.get("speedup"), mb.get("speedup"))
    notes = [x for r in (a, b) for x in (r.get("notes") or []) + (r.get("warnings") or [])]
    held = (t is not None and abs(t) <= TOKENS_HOLD) and (s is None or abs(s) <= SPEEDUP_HOLD)
    verdict = "held" if held else "footnoted" if notes else "failed: moved, no footnote"
    loss = " / ".join(fig((r.get("loss") or {}).get("value"), ".4f") for r in (a, b))
    step = (a.get("loss") or {}).get("step")
    lines.append(
        f"| {name} | {fig(ma.get('tokens_per_s'), ',.0f')} | {fig(mb.get('tokens_per_s'), ',.0f')} | {pct(t)} | "
        f"{fig(ma.get('speedup'), '.3f')} | {fig(mb.get('speedup'), '.3f')} | {pct(s)} | "
        f"{'yes: ' + str(len(notes)) if notes else 'no'} | {loss} @ {step} | {verdict} |"
    )
    cases.append((name, None if not verdict.startswith("failed") else verdict))
modes = {(r.get("side_by_side") or {}).get("mode") for run in runs for r in run.values()}
busy = [f"{k[0]} ws{k[1]} {r['metrics'].get('busy_ratio', float('nan')):.2f}" for k, r in sorted(runs[0].items())
        if r["status"] == "ok"]
text = "\n".join(
    [f"Two back-to-back `distbench run` on this machine; bounds +/-{TOKENS_HOLD:.0%} tok/s, "
     f"+/-{SPEEDUP_HOLD:.0%} speedup, else a footnote; measured: {', '.join(sorted(map(str, modes)))}", "",
     *lines, "", "device busy (run 1): " + ", ".join(busy)]
)
(out / "compare.md").write_text(text + "\n")
print(text)
failures = sum(1 for _, f in cases if f)
xml = [f'<testsuite name="table-repeat" tests="{len(cases)}" failures="{failures}">']
for name, failure in cases:
    xml.append(f"  <testcase classname=\"table_repeat\" name={quoteattr(name)}>")
    if failure:
        xml.append(f"    <failure message={quoteattr(failure)}>{escape(failure)}</failure>")
    xml.append("  </testcase>")
xml.append("</testsuite>")
(out / "junit-table-repeat.xml").write_text("\n".join(xml) + "\n")
sys.exit(1 if failures or not cases else 0)
PY
