#!/usr/bin/env bash
# Does the seed-004 table repeat? scripts/seed004_repeats.sh OUT [N] [distbench run args...]
# Runs configs/seed004.yaml at 1 and 2 GPUs (WORLD_SIZES=1 on a 1-GPU machine) N times (default 3) back to back, each repeat a fresh
# `distbench run` process (fresh rank pools) cut at REPEAT_LIMIT_S (300: a repeat, its shortfall traces
# included, must fit in 5 minutes), then prints scripts/seed004_repeats.py's table: every row's tokens/s per
# repeat, its spread around the median of the repeats, the flags, and each repeat's wall time.
# Writes OUT/repeat-K/ (results, traces), OUT/repeat-K.log, OUT/stages.tsv, OUT/machine.txt, OUT/summary.txt.
# FIRST=K numbers the repeats from K (default 1) and adds to OUT's stages.tsv, so that repeats run in separate
# calls make one table.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=$(realpath -m "${1:?usage: scripts/seed004_repeats.sh OUT [N] [distbench run args...]}")
n=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's distbench
machine_txt "$out/machine.txt"
first=${FIRST:-1}
[ "$first" -gt 1 ] && [ -f "$out/stages.tsv" ] || printf 'stage\tstart\twall_s\texit\tlimit_s\n' > "$out/stages.tsv"
for k in $(seq "$first" $((first + n - 1))); do
  s=$(date +%s)
  timeout --signal=INT --kill-after=20 "${REPEAT_LIMIT_S:-300}" python3 -m distbench.cli run \
    --config configs/seed004.yaml --world-size "${WORLD_SIZES:-1,2}" --output "$out/repeat-$k" "$@" > "$out/repeat-$k.log" 2>&1
  rc=$?
  printf 'repeat-%s\t%s\t%s\t%s\t%s\n' "$k" "$s" "$(( $(date +%s) - s ))" "$rc" "${REPEAT_LIMIT_S:-300}" \
    >> "$out/stages.tsv"
done
python3 scripts/seed004_repeats.py "$out" | tee "$out/summary.txt"
