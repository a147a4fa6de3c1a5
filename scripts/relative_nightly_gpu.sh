#!/usr/bin/env bash
# Evidence for `distbench nightly` (nights measured against a frozen reference, docs/reference-runs.md) on one GPU.
#
# MODE=aa (default): seed 004's strategies at one GPU (single, ddp, fsdp_full, fsdp_grad, zero2, zero3), GPT-2 124M
# in bf16-amp, measured against a reference that is this same checkout (an A/A night), NIGHTS nights back to back.
# Prints per row and night the step-time ratio head/reference, its deviation from the row's median over the nights
# (targets: +-1% on device-bound rows, +-2% on host-bound ones) and head's absolute step time with its deviation
# beside it, then each night's wall time (target: at most 10 minutes). On one H200 (2026-12-02), 6 rows x 3 pairs
# took 245-268 s a night, 14 s a pair (results/relative-nightly-h200-2026-12-02). From the second night on, a
# night gives a row whose pairs spread more pairs (up to MAX_PAIRS, `distbench nightly --max-pairs`), read from
# the nights before it in OUT/nights: over those three nights' spreads, 36 pairs, about 8.5 minutes.
#
# MODE=plant: host work of DISTBENCH_PLANT_SHARE (3%) of the step's period planted in revision 1 of a repository
# made from this checkout's src under OUT/repo: PLANT names it (scripts/plants/PLANT.patch): host-step-3pct (the
# default, the recorded nights' plant: a busy loop on the training thread at the optimizer step) or host-forward
# (busy loops in every block's forward, where the device waits for the host's next launch). BEFORE short nights
# of revision 0 and AFTER of revision 1, each one row (PLANT_ROW, default fsdp_full: device busy 0.67-0.85)
# against a frozen reference (a worktree of revision 0), then
# `distbench history --nights PATH` on the ratio series must find the change at revision 1. A night took 91-100 s
# on one H200 (two servers' start and 3 pairs), so 5 + 5 nights take about 16 minutes, two or more calls there;
# BEFORE=4 AFTER=4 takes 13, but then a perfect separation's p is 0.03-0.044 against --alpha 0.05 (5 + 5:
# 0.009-0.017, docs/history.md). GRID=N makes the first N before-nights nights of the grid (ROWS): A/A nights of
# every row (head revision 0 against the reference, revision 0 too), checked as MODE=aa checks its nights, whose
# plant row is also a before-point of the plant's series.
# The plant's share is sized first: host work overlaps device work already queued (in fsdp_full on one H200 a
# 3% share slowed the step by about 0.7%, results/relative-nightly-h200-2026-12-02/windows-30), so unless
# DISTBENCH_PLANT_SHARE is set, scripts/plant_size.py measures in one process which share slows the row's step by
# SIZE_TARGET (0.03; SIZE_FLAGS: more of its flags, e.g. --shares) and writes OUT/plant-share, which the later
# calls read (host-forward also OUT/plant-period-s, the step's period it spins a share of, or
# DISTBENCH_PLANT_PERIOD_S); SIZE=0 skips it (share 0.03). The after-nights' mean ratio over the before-nights'
# is the plant's slowdown as measured side by side; LONG_AB=1 adds a `distbench ab` of revision 1 against 0
# (AB_BUDGET s, 300).
#
# Usage: scripts/relative_nightly_gpu.sh OUT     writes OUT/nights/ (every night.json and its runs, NAME.s its wall
# time), then, once every night of the mode is there, OUT/summary.md, OUT/junit.xml, OUT/repeats.png (aa),
# OUT/history/ (plant) through scripts/relative_nightly_summary.py, which prints the summary table last; exit 0
# when every check passed. Nights can be spread over several calls (a GPU lease of 10 minutes a command): FIRST
# (1) is the first night this call runs and keeps the nights already in OUT/nights; DEADLINE (seconds) starts
# no night that the longest night of its kind so far would take past it; NIGHTS=0 only writes the summary (and the plant's
# repository and history), e.g. here after copying the nights of several calls into one OUT.
# Knobs: NIGHTS (aa 3, plant BEFORE + AFTER), PAIRS (4, the fewest a row gets), MAX_PAIRS (12), NIGHT_BUDGET
# (900 s: a night's pairs stop there), ROWS,
# CONFIG (the workload flags; the night's own 30 windows of 2 steps and 5 warm-up steps unless it says otherwise;
# on CPU: CONFIG="-n 1 -m gpt2-tiny --precision fp32 --micro-batch 2 --steps 4 --windows 2 --warmup 1
# --device cpu", as tests/test_relative.py runs it), BEFORE (5), AFTER (5), PLANT, PLANT_ROW, DISTBENCH_PLANT_SHARE
# (0.03), PLANT_SRC (the commit whose src/ the plant's repository is made from; default: this checkout's),
# HISTORY (more `distbench history` flags; default --alpha 0.05: 5 + 5 nights cannot reach p < 0.01,
# docs/history.md "How much it takes").
set -euo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/relative_nightly_gpu.sh OUT}
mode=${MODE:-aa}
root=$(pwd)
plant=${PLANT:-host-step-3pct}
[ -f "$root/scripts/plants/$plant.patch" ] || { echo "run from the distbench checkout; no plant $plant" >&2; exit 2; }
first=${FIRST:-1}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf "$out/repo" "$out/ref" "$out"/rev-* "$out/history" "$out/ab"
[ "$first" != 1 ] || rm -rf "$out/nights" "$out/plant-share" "$out/plant-period-s" "$out/plant-size.json"
# the machine the nights ran on: a call that goes on (FIRST > 1), or only writes the summary, keeps it
[ "$first" != 1 ] && [ -s "$out/machine.txt" ] || machine_txt "$out/machine.txt" || true
pairs=${PAIRS:-4}
config=${CONFIG:-"-n 1 -m gpt2-124m --precision bf16-amp --micro-batch 8"}
touch "$out/nightly.log"
t_start=$(date +%s)
declare -A longest=()  # per kind of night (the rows it measures), the longest one so far in this call
kind=grid
distbench() {  # the runner's own distbench (this checkout), whatever head and reference are
  PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m distbench.cli "$@"
}
cut=
fits() {  # fits N: whether night N fits before DEADLINE, judged by the longest night of its kind so far
  [ -z "${DEADLINE:-}" ] || [ $(($(date +%s) - t_start + ${longest[$kind]:-0})) -le "$DEADLINE" ] || {
    cut=$1
    echo "no time left before DEADLINE=$DEADLINE s for night $1 (the longest of its kind took ${longest[$kind]:-0} s): FIRST=$1 goes on" |
      tee -a "$out/nightly.log"
    return 1
  }
}
night() {  # night NAME FLAGS...: one `distbench nightly` into OUT/nights/NAME, its wall time in OUT/nights/NAME.s
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  rm -rf "$out/nights/$name" "$out/nights/$name.s"
  # shellcheck disable=SC2086  # CONFIG is a flag list
  distbench nightly $config --pairs "$pairs" --max-pairs "${MAX_PAIRS:-12}" --budget "${NIGHT_BUDGET:-900}" "$@" -o "$out/nights/$name" 2>&1 |
    tee -a "$out/nightly.log" || rc=$?
  echo "$(($(date +%s) - t0))" > "$out/nights/$name.s"
  local took
  took=$(cat "$out/nights/$name.s")
  [ "$took" -le "${longest[$kind]:-0}" ] || longest[$kind]=$took
  [ "$rc" = 0 ] || echo "night $name: exit $rc" | tee -a "$out/nightly.log"
  # what is left running after a night (a leftover process on the pinned core would slow every later night)
  { echo "processes after night $name:"; ps -eo pid,etimes,pcpu,psr,comm --sort=-pcpu | head -6; } >> "$out/nightly.log"
}

rows=${ROWS:-"single ddp fsdp_full fsdp_grad zero2 zero3"}
if [ "$mode" = aa ]; then
  for n in $(seq "$first" "$((first + ${NIGHTS:-3} - 1))"); do
    fits "$n" || break
    night "night-$n" -s "${rows// /,}" --reference "tree=$root"
  done
elif [ "$mode" = plant ]; then
  # fixed names and dates: every call makes the same two commits, so nights of several calls share them
  export GIT_AUTHOR_NAME="distbench evidence" GIT_AUTHOR_EMAIL="evidence@distbench.invalid"
  export GIT_COMMITTER_NAME="$GIT_AUTHOR_NAME" GIT_COMMITTER_EMAIL="$GIT_AUTHOR_EMAIL"
  export GIT_AUTHOR_DATE="2026-01-01T00:00:00Z" GIT_COMMITTER_DATE="2026-01-01T00:00:00Z"
  repo=$out/repo
  mkdir -p "$repo"
  # the tracked files alone (no build leftovers), so that every machine and call makes the same two commits;
  # PLANT_SRC=COMMIT takes them from that commit instead, so that nights saved from it go on after src/ changed
  if [ -n "${PLANT_SRC:-}" ]; then
    git -C "$root" archive "$PLANT_SRC" src | tar -C "$repo" -xf -
  else
    git -C "$root" ls-files -z src | tar -C "$root" --null -T - -cf - | tar -C "$repo" -xf -
  fi
  (
    cd "$repo"
    git init -q -b main
    git add -A && git commit -q -m "revision 0: this checkout's src"
    patch -sp1 < "$root/scripts/plants/$plant.patch"
    git add -A && git commit -q -m "revision 1: $plant"
  )
  git -C "$repo" worktree add -q --detach "$out/ref" main~1  # the frozen reference: revision 0
  git -C "$repo" worktree add -q --detach "$out/rev-0" main~1
  git -C "$repo" worktree add -q --detach "$out/rev-1" main
  row=${PLANT_ROW:-fsdp_full}
  before=${BEFORE:-5}
  after=${AFTER:-5}
  grid=${GRID:-0}
  [ "$grid" -le "$before" ] || { echo "GRID ($grid) must be at most BEFORE ($before)" >&2; exit 2; }
  if [ -z "${DISTBENCH_PLANT_SHARE:-}" ] && [ ! -s "$out/plant-share" ] && [ "${SIZE:-1}" = 1 ]; then
    # the share that slows the row's step by SIZE_TARGET, measured in one process (scripts/plant_size.py)
    # shellcheck disable=SC2086  # CONFIG and SIZE_FLAGS are flag lists
    PYTHONPATH="$out/rev-1/src${PYTHONPATH:+:$PYTHONPATH}" python3 "$root/scripts/plant_size.py" "$out" -s "$row" \
      $config --target "${SIZE_TARGET:-0.03}" ${SIZE_FLAGS:-} 2>&1 | tee -a "$out/nightly.log" || unsized=1
  fi
  [ -n "${DISTBENCH_PLANT_SHARE:-}" ] || [ ! -s "$out/plant-share" ] || DISTBENCH_PLANT_SHARE=$(cat "$out/plant-share")
  export DISTBENCH_PLANT_SHARE=${DISTBENCH_PLANT_SHARE:-0.03}
  # host-forward's period (plant_size.py measures it): the plant refuses to run without one
  [ -n "${DISTBENCH_PLANT_PERIOD_S:-}" ] || [ ! -s "$out/plant-period-s" ] ||
    export DISTBENCH_PLANT_PERIOD_S=$(cat "$out/plant-period-s")
  echo "the plant's share of the step's period: $DISTBENCH_PLANT_SHARE (period: ${DISTBENCH_PLANT_PERIOD_S:-learned by the plant} s)" |
    tee -a "$out/nightly.log"
  last=$((first + ${NIGHTS:-$((before + after))} - 1))
  [ "$last" -le "$((before + after))" ] || last=$((before + after))
  for n in $(seq "$first" "$last"); do
    rev=$([ "$n" -le "$before" ] && echo 0 || echo 1)
    if [ "$rev" = 1 ] && [ -n "${unsized:-}" ]; then  # the before-nights ran; the plant's nights cannot
      echo "the plant could not be sized: set DISTBENCH_PLANT_SHARE or SIZE_FLAGS=--shares ..." >&2
      exit 1
    fi
    measured=$([ "$n" -le "$grid" ] && echo "${rows// /,}" || echo "$row")
    kind=$measured
    fits "$n" || break
    night "$(printf 'night-%02d' "$n")" -s "$measured" --head "tree=$out/rev-$rev" --reference "tree=$out/ref"
  done
  [ -n "$cut" ] || [ "$last" -ge "$((before + after))" ] || cut=$((last + 1))  # nights left for another call
  if [ -z "$cut" ]; then
    # shellcheck disable=SC2086  # HISTORY is a flag list
    distbench history --nights "$out/nights" --metric step_time_s --repo "$repo" ${HISTORY:---alpha 0.05} \
      -o "$out/history" 2>&1 | tee -a "$out/nightly.log" || true
  fi
  if [ "${LONG_AB:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    # the nights' windows (30 of 2 steps, 5 warm-up steps; `ab`'s own are 6 of 2), unless CONFIG says otherwise
    distbench ab --base "tree=$out/rev-0" --head "tree=$out/rev-1" -s "$row" --windows 30 --steps 60 --warmup 5 \
      $config --bind-cpus --numerics off \
      --min-pairs 6 --max-pairs 12 --budget "${AB_BUDGET:-300}" -o "$out/ab" 2>&1 | tee -a "$out/nightly.log" || true
  fi
  for d in ref rev-0 rev-1; do git -C "$repo" worktree remove --force "$out/$d"; done
else
  echo "MODE is aa or plant, not $mode" >&2
  exit 2
fi

if [ -n "$cut" ]; then  # the summary waits for the nights still to run
  echo "nights from $cut on are still to run: FIRST=$cut goes on (into the same OUT); no summary yet"
  exit 0
fi
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" python3 "$root/scripts/relative_nightly_summary.py" "$out" "$mode"
