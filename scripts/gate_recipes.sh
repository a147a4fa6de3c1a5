#!/usr/bin/env bash
# The upgrade gate's recipe numerics against their budgets (docs/gate.md): scripts/gate_recipes.sh OUT [cpu|gpu]
#   cpu  an A/A `distbench ab --numerics only` of every default strategy at world sizes 1 and 2, gpt2-tiny:
#        every recipe compared or skipped with its reason, all identical, 10 minutes at most
#   gpu  the same at one GPU with the numerics' GPU workload (gpt2-124m, micro-batch 2, 256 tokens): 5 minutes at
#        most; about 6 minutes of device time with the start
# Writes OUT/junit.xml, OUT/pytest.log and OUT/summary-<device>.md (strategies, recipes compared and skipped,
# seconds, against the budget), and prints the table last.
set -uo pipefail
out=${1:?usage: scripts/gate_recipes.sh OUT [cpu|gpu]}
tier=${2:-cpu}
root=$(pwd)
[ -f "$root/tests/test_numerics_recipes.py" ] || { echo "run from the distbench checkout" >&2; exit 2; }
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
export DISTBENCH_RECIPES_OUT=$out
if [ "$tier" = gpu ]; then
  . "$(dirname "$0")/gpu_env.sh"
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  args=(-m gpu --world-sizes 1 -k gpu_budget)
else
  args=(-m nightly -k cpu_budget)
fi
timeout -k 30 3700 python3 -m pytest tests/test_numerics_recipes.py "${args[@]}" -p no:cacheprovider -q -rA -s \
  --junitxml "$out/junit.xml" > "$out/pytest.log" 2>&1
code=$?
tail -n 15 "$out/pytest.log"
cat "$out"/summary-*.md 2>/dev/null
exit $code
