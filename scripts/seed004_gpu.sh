#!/usr/bin/env bash
# Issue 41's evidence in one command, on a 4-GPU machine, in under 9 minutes: scripts/seed004_gpu.sh OUT
#   1. matrix:    configs/seed004.yaml at 1, 2 and 4 GPUs (22 configurations side by side on disjoint GPUs),
#                 the configurations more than 5% below DDP or the seed at 2 GPUs traced beside DDP
#   2. repeat-1, repeat-2: the issue's table (1 and 2 GPUs, no traces) twice more, to count flagged rows
#   3. planted:   ddp and fsdp_grad at 2 GPUs with a CPU-bound job on every CPU beside them: must be flagged
# Writes OUT/<stage>/ (results), OUT/<stage>.log, OUT/report/report.md (the matrix, the seed's figures beside
# it, the shortfalls split by their traces), OUT/stages.tsv (each stage's wall seconds and exit status),
# OUT/machine.txt, and prints the summary (scripts/seed004_summary.py) last. The stages share a budget of
# SEED004_BUDGET_S seconds (530): the matrix gets 360 (issue 41 asks 300 for its configurations; its traces
# come after them), the planted run 60, the repeats the rest. A stage that would overrun its share is cut;
# what it saved still counts, and the summary says it was cut.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=$(realpath -m "${1:?usage: scripts/seed004_gpu.sh OUT}")
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's distbench
machine_txt "$out/machine.txt"
budget=${SEED004_BUDGET_S:-530}
t0=$(date +%s)
printf 'stage\tstart\twall_s\texit\tlimit_s\n' > "$out/stages.tsv"

stage() {  # stage NAME LIMIT_S distbench-run-args...: one `distbench run` into OUT/NAME, cut at LIMIT_S
  local name=$1 limit=$(( $2 > 1 ? $2 : 1 )) s e rc; shift 2  # timeout 0 would mean no limit at all
  s=$(date +%s)
  timeout --signal=INT --kill-after=20 "$limit" python3 -m distbench.cli run --config configs/seed004.yaml \
    --output "$out/$name" "$@" > "$out/$name.log" 2>&1
  rc=$?
  e=$(date +%s)
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$s" "$((e - s))" "$rc" "$limit" >> "$out/stages.tsv"
}
left() { local n=$((budget - ($(date +%s) - t0))); echo $(( n > 1 ? n : 1 )); }

stage matrix 360
for i in 1 2; do  # what is left, less a minute for the planted run, in two
  stage "repeat-$i" "$(( ($(left) - 60) / (3 - i) ))" --world-size 1,2 --no-trace
done
# the planted disturbance: one busy loop per CPU, unbound, for as long as the stage runs
pids=()
for _ in $(seq "$(nproc)"); do timeout "$(left)" sh -c 'while :; do :; done' & pids+=($!); done
stage planted "$(( $(left) - 10 ))" --world-size 2 --strategy ddp,fsdp_grad --no-trace
kill "${pids[@]}" 2>/dev/null
wait "${pids[@]}" 2>/dev/null
python3 -m distbench.cli report "$out/matrix" --out "$out/report" > "$out/report.log" 2>&1
python3 scripts/seed004_summary.py "$out"
