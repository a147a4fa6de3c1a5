#!/usr/bin/env bash
# GPU evidence for two torchrun "nodes" of one GPU each on a 2-GPU machine (NCCL forced onto sockets, as between
# hosts), in about 8 minutes: scripts/nodes_gpu.sh OUT
#  (a) `distbench launch --parity` for every strategy that runs on GPUs at world size 2, at world sizes 1 and 2,
#      with the resharded resumes (saved at 2 across both nodes, continued at 1);
#  (b) a hang planted in rank 1 of a zero2 job: every rank must print its one line and exit non-zero;
#  (c) the NCCL fault tests (junit), then nvidia-smi for anything left on the GPUs.
# A short table last. STRATEGIES (default: all eleven) narrows (a); MODEL (default gpt2-tiny; gpt2-124m adds
# minutes) and SEQ (the model's default unless set) pick the workload; PARTS (default abc) which parts run.
# Needs `import deepspeed` to work (installed before this runs).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/nodes_gpu.sh OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/src:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
model=${MODEL:-gpt2-tiny}
# the GPU grid's default sequence (1024) is longer than gpt2-tiny's 64 positions: its own length unless SEQ says
seq=()
[ "$model" = gpt2-tiny ] && seq=(--seq-len 64)
[ -n "${SEQ:-}" ] && seq=(--seq-len "$SEQ")
strategies=${STRATEGIES:-ddp,fsdp_full,fsdp_grad,fsdp_hybrid,fsdp_offload,fsdp1_full,fsdp1_grad,zero1,zero2,zero3,zero3_offload}
table="$out/table.txt"
: > "$table"

two_nodes() {  # two_nodes NAME LIMIT_S LAUNCH_FLAGS -- RUN-ARGS: one agent per GPU, each its own "node"
  local name=$1 limit=$2 port=$((29500 + RANDOM % 1000)) flags=() pids=() codes=() i
  shift 2
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout -k 10 "$limit" python3 -m torch.distributed.run \
      --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port --rdzv-id "$name" \
      --rdzv-conf join_timeout=60 --max-restarts 0 --log-dir "$out/$name-torchrun$i" \
      -m distbench.cli launch "${flags[@]}" -- -o "$out/$name" "$@" > "$out/$name-agent$i.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do wait "${pids[$i]}"; codes+=($?); done
  echo "${codes[*]}"  # agent 0's, agent 1's; 124: stopped at the limit
}

parts=${PARTS:-abc}
# (a) parity at world sizes 1 and 2 across the nodes, and the resumes
if [[ $parts == *a* ]]; then
t0=$(date +%s)
# parity.json is written before the launch's benchmark half: a limit that stops the benchmark (124) keeps it
codes=$(two_nodes parity "${PARITY_LIMIT_S:-270}" --parity -- -s "$strategies" -n 1,2 -m "$model" "${seq[@]}" \
  --steps 3 --warmup 1 --repeats 1 --timeout 90)
python3 - "$out/parity/parity.json" "$codes" "$(( $(date +%s) - t0 ))" >> "$table" <<'EOF'
import json, sys
path, codes, secs = sys.argv[1:]
try:
    rows = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"(a) parity: no parity.json ({e}); agents exited {codes} after {secs} s"); sys.exit()
bad = [r["check"] for r in rows if r["status"] != "ok"]
print(f"(a) parity: {len(rows) - len(bad)}/{len(rows)} checks ok, agents exited {codes}, {secs} s")
for r in rows:
    print(f"    {r['status']:5} {r['check']}")
EOF
fi

# (b) a hang planted in rank 1 of a zero2 job, on NCCL
if [[ $parts == *b* ]]; then
t0=$(date +%s)
codes=$(two_nodes hang 150 -- -s zero2 -n 2 -m cluster_models:hangs_in_a_step_on_last_rank --steps 2 --warmup 0 \
  --timeout 30)
{
  echo "(b) planted zero2 hang: agents exited $codes after $(( $(date +%s) - t0 )) s (expect both non-zero, ~60 s)"
  for i in 0 1; do
    n=$(grep -c "^distbench launch rank .*: job 0: .*zero2 ws2.*; exiting 1$" "$out/hang-agent$i.log")
    echo "    agent $i: $n line(s) naming rank, job and wait (expect 1):"
    grep "^distbench launch rank .*; exiting 1$" "$out/hang-agent$i.log" | cut -c1-300 | sed 's/^/      /'
  done
} >> "$table"
fi

# (c) the NCCL fault tests, one pytest session
if [[ $parts == *c* ]]; then
t0=$(date +%s)
timeout -s INT -k 20 "${PYTEST_LIMIT_S:-200}" python3 -m pytest -m "gpu and slow" tests/test_faults.py --lanes off \
  -rfEs --tb=short -p no:cacheprovider --junitxml "$out/faults-junit.xml" -o junit_logging=system-out \
  > "$out/faults-pytest.log" 2>&1
echo "(c) NCCL faults: pytest exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$out/faults-pytest.log")" >> "$table"
fi
sleep 2
nvidia-smi > "$out/nvidia-smi-after.txt" 2>&1
left=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1)
echo "    GPU processes left after all three: ${left:-none}" >> "$table"
cat "$table"
