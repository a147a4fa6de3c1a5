#!/usr/bin/env bash
# Evidence for distbench history on one GPU: a history of GOOD_RUNS runs of one commit and BAD_RUNS runs of a
# later one, in a 3-revision repository made from this checkout's src under OUT/repo, revision 1 applying a
# planted slowdown (scripts/plants/PLANT.patch, default device-2pct: extra device work per step, 5% here unless
# DISTBENCH_PLANT_SHARE says: on an H200 these short runs of one commit spread by 4% within an hour, and a 2%
# plant was not found, results/history-h200-2026-11-28). The nightly
# history skips revision 1, as nights skip commits: its points are runs of revision 0 and of revision 2.
# `distbench history` must find the step time's change between them, and its `--bisect` must name revision 1.
# Each point is a short device-bound run: ddp on one GPU, GPT-2 medium, bf16, micro-batch 16, 20 timed steps
# in 5 windows (8 + 6 runs and a 3-comparison bisect: planned for 5-7 minutes on one H200).
# Usage: scripts/history_gpu.sh OUT   writes OUT/results/ (the history), OUT/history/ (history.json, the
# bisect under bisect-1/), OUT/history.log, and prints a short table last.
# GOOD_RUNS, BAD_RUNS (default 8, 6: with fewer, the permutation test of a perfect separation may not reach
# p < 0.01);
# PLANT; CONFIG="..." replaces the run flags (on CPU: CONFIG="-s ddp -n 1 -m gpt2-tiny --precision fp32
# --micro-batch 2 --global-batch 2 --steps 2 --windows 2 --warmup 2 --device cpu" with PLANT=host-sleep-fixed
# and DISTBENCH_PLANT_SLEEP_S=3, as tests/test_history.py runs it); HISTORY="..." adds distbench history
# flags; BISECT="..." replaces the bisect flags (default: 3 to 5 pairs a probe in at most 150 s: on an H200 the
# first pair of a probe takes 50 s, each later one 27 s).
set -euo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/history_gpu.sh OUT}
good_runs=${GOOD_RUNS:-8}
bad_runs=${BAD_RUNS:-6}
plant=${PLANT:-device-2pct}
root=$(pwd)
[ -f "$root/scripts/plants/$plant.patch" ] || { echo "run from the distbench checkout; no plant $plant" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
export DISTBENCH_PLANT_SHARE=${DISTBENCH_PLANT_SHARE:-0.05}
export GIT_AUTHOR_NAME="distbench evidence" GIT_AUTHOR_EMAIL="evidence@distbench.invalid"
export GIT_COMMITTER_NAME="$GIT_AUTHOR_NAME" GIT_COMMITTER_EMAIL="$GIT_AUTHOR_EMAIL"
export GIT_AUTHOR_DATE="2026-01-01T00:00:00Z" GIT_COMMITTER_DATE="2026-01-01T00:00:00Z"

repo=$out/repo
rm -rf "$repo" "$out/results" "$out/history" "$out"/rev-*
mkdir -p "$repo"
tar -C "$root" --exclude=__pycache__ --exclude='*.pyc' -cf - src | tar -C "$repo" -xf -
(
  cd "$repo"
  git init -q -b main
  git add -A && git commit -q -m "revision 0: this checkout's src"
  patch -sp1 < "$root/scripts/plants/$plant.patch"
  echo 1 > REVISION && git add -A && git commit -q -m "revision 1: $plant"
  echo 2 > REVISION && git add -A && git commit -q -m "revision 2"
)
config=${CONFIG:-"-s ddp -n 1 -m gpt2-355m --precision bf16 --micro-batch 16 --global-batch 16 --steps 20 --windows 5 --warmup 5"}
for rev in 0 2; do  # the nights: each revision's own distbench runs, and its results carry its commit
  runs=$([ "$rev" = 0 ] && echo "$good_runs" || echo "$bad_runs")
  git -C "$repo" worktree add -q --detach "$out/rev-$rev" "main~$((2 - rev))"
  # shellcheck disable=SC2086  # CONFIG is a flag list
  PYTHONPATH="$out/rev-$rev/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m distbench.cli run $config --repeats "$runs" \
    -o "$out/results/rev-$rev" 2>&1 | tee -a "$out/history.log"
done
bisect=${BISECT:-"--bind-cpus --min-pairs 3 --look-every 1 --max-pairs 5 --budget 150"}
rc=0
# shellcheck disable=SC2086  # HISTORY is a flag list
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m distbench.cli history "$out/results" --repo "$repo" --metric step_time_s \
  --bisect --bisect-flags "$bisect" ${HISTORY:-} -o "$out/history" 2>&1 | tee -a "$out/history.log" || rc=$?
for rev in 0 2; do git -C "$repo" worktree remove --force "$out/rev-$rev"; done
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" python3 - "$out" "$repo" <<'PY'
import json, subprocess, sys
from pathlib import Path

out, repo = Path(sys.argv[1]), sys.argv[2]
revs = subprocess.run(["git", "-C", repo, "log", "--reverse", "--format=%H %s"], capture_output=True, text=True).stdout
name = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in revs.splitlines()}
changes = json.loads((out / "history" / "history.json").read_text())
bisect = out / "history" / "bisect-1" / "bisect.json"
named = json.loads(bisect.read_text())["first_bad"] if bisect.exists() else []
print(f"{'what':<34} {'figure':<46}")
for c in changes:
    print(f"{'change point':<34} {c['series']}")
    print(f"{'  last good -> first bad':<34} {name.get(c['last_good'], c['last_good'])} -> {name.get(c['first_bad'], c['first_bad'])}")
    lo, hi = (100 * (x - 1) for x in c["ratio_interval"])
    print(f"{'  change [interval]':<34} {100 * (c['ratio'] - 1):+.2f}% [{lo:+.2f}%, {hi:+.2f}%], p {c['p_value']:.3f}")
print(f"{'bisect named':<34} {', '.join(named) or 'nothing'}")
planted = any("revision 1:" in n for n in named) and len(named) == 1
print(f"{'planted revision 1 named':<34} {'yes' if planted else 'NO'}")
sys.exit(0 if planted and changes else 1)
PY
