#!/usr/bin/env bash
# The GPU tier as a user types it, with its evidence: scripts/gpu_tier.sh OUT [pytest args...]
# Writes OUT/pytest.log (the whole session: its phase table, lanes and devices, undecided claims),
# OUT/junit.xml (with each test's output: the fidelity rounds' parts), OUT/phases.json and OUT/wall.txt (the
# command's wall seconds, the machine, what was left on the GPUs), and prints the session's last lines. LIMIT_S=SECONDS stops pytest
# with SIGINT at that time, so a session cut short still prints its failures and phase table.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/gpu_tier.sh OUT [pytest args...]}; shift
mkdir -p "$out"
machine_txt "$out/machine.txt"
start=$(date +%s.%N)
timeout -s INT -k 30 "${LIMIT_S:-0}" python3 -m pytest -m gpu -rfEs --durations=30 --junitxml "$out/junit.xml" -o junit_logging=system-out --phases-json "$out/phases.json" \
  --timeline-json "$out/timeline.json" "$@" 2>&1 | tee "$out/pytest.log" | grep -E "^(FAILED|ERROR|UNDECIDED)|passed|failed|distbench lanes" 
status=${PIPESTATUS[0]}
end=$(date +%s.%N)
python3 -c "print(f'wall {float($end) - float($start):.1f} s, exit {$status}')" | tee "$out/wall.txt"
cat "$out/machine.txt" >> "$out/wall.txt"
sleep 2  # then what the session left on the GPUs: nothing, if every rank and lane ended
left=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1)
echo "GPU processes left after the session: ${left:-none}" | tee -a "$out/wall.txt"
sed -n '/distbench: time in tests by phase/,$p' "$out/pytest.log" | head -60
exit "$status"
