#!/usr/bin/env bash
# Evidence for the A/B gate on a GPU machine: planted slowdowns it must flag, identical variants it must pass.
# Usage: scripts/ab_evidence.sh OUT MODE...   MODE: device (2% extra device work, ddp/fsdp_grad/zero2/zero3 at
# micro-batch 16), host (5% host busy loop, fsdp_grad at micro-batch 8), host-sleep (the host sleeps 5% of
# each step: wall time only, no CPU work), aa<N> (A/A of the four), fidelity
# (test_harness_overhead_at_most_1_percent: the harness against bare single/ddp/fsdp_grad/zero2/zero3 loops).
# Writes OUT/<mode>/ (every run's result, ab.json, ab.md) and OUT/<mode>.log; prints each verdict table.
# BUDGET=SECONDS overrides each comparison's time budget (defaults: device 450, host 240, aa 420).
# CONFIG="-s ddp -n 1 -m gpt2-124m --micro-batch 1" replaces a mode's configurations; AB="--max-pairs 8"
# adds distbench ab flags; VARIANT=env.PYTHONHASHSEED=0 is added to both variants.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/ab_evidence.sh OUT MODE...}; shift
mkdir -p "$out"
root=$(pwd)
both=${VARIANT:-}
plants=()
trap 'rm -rf ${plants[@]+"${plants[@]}"}' EXIT  # the planted copies go with the script
planted() {  # sets $tree: a copy of this checkout's src with one plant applied
  tree=$(mktemp -d "/tmp/distbench-plant-$1-XXXX")
  plants+=("$tree")
  cp -r "$root/src" "$tree/src"
  (cd "$tree" && patch -sp1 < "$root/scripts/plants/$1.patch") || exit 1
}
ab() {  # name, default configuration, distbench ab args...
  local name=$1 config=$2; shift 2
  # shellcheck disable=SC2086  # CONFIG and AB are flag lists
  python3 -m distbench.cli ab --bind-cpus --numerics default -o "$out/$name" ${CONFIG:-$config} ${AB:-} "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -E "^(distbench ab|base:|head:)|pair [0-9]|│|FAIL|PASS|UNDECIDED" "$out/$name.log" | cut -c1-200
}
four="-s ddp,fsdp_grad,zero2,zero3"
for mode in "$@"; do
  case $mode in
    device) planted device-2pct
            ab device-2pct "$four" --base "$both" --head "tree=$tree${both:+,$both}" --budget "${BUDGET:-450}" ;;
    host) planted host-5pct
          ab host-5pct "-s fsdp_grad --micro-batch 8" --base "$both" --head "tree=$tree${both:+,$both}" --budget "${BUDGET:-240}" ;;
    host-sleep) planted host-sleep-5pct
                ab host-sleep-5pct "-s fsdp_grad --micro-batch 8" --base "$both" --head "tree=$tree${both:+,$both}" --budget "${BUDGET:-240}" ;;
    aa*) ab "$mode" "$four" --base "$both" --head "$both" --budget "${BUDGET:-420}" ;;
    fidelity) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_benchmarks.py -k harness_overhead -s \
                > "$out/fidelity.log" 2>&1; echo "== fidelity: exit $?"; tail -5 "$out/fidelity.log" ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
