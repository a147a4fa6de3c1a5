#!/usr/bin/env bash
# The GPU tests that failed at world sizes 2 and 4 (DeepSpeed resharding, fsdp_offload clipping, fp16 pre-clip
# norms, the fidelity loops' accumulation, checkpointing's saving, the harness-overhead claims), then two
# torchrun "nodes" on one machine (1 GPU each, then 2 each: fsdp_hybrid as a 2x2 mesh), parity and a
# resharded resume: scripts/multigpu_fixes.sh OUT. Prints a short table last. PYTEST=0 skips the tests;
# NODES="nodes2x2" runs only the named node layouts (default: nodes2x1 nodes2x2).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/multigpu_fixes.sh OUT}
mkdir -p "$out"
sel=${SELECT:-"test_resharding or accumulation+clip-fsdp_offload or fp16+clip or test_harness_and_bare_loop_do_the_same_work
  or test_activation_checkpointing_frees_the_blocks_activations or test_harness_overhead_at_most_1_percent"}
start=$(date +%s)
if [ "${PYTEST:-1}" = 1 ]; then
# SIGINT at the limit: pytest still prints its summary of failures
timeout -s INT -k 20 "${LIMIT_S:-290}" python3 -m pytest -m gpu --world-sizes "${WORLD_SIZES:-2,4}" -k "$sel" -rfEs \
  --tb=short --junitxml "$out/junit.xml" -o junit_logging=system-out -p no:cacheprovider > "$out/pytest.log" 2>&1
echo "pytest exit $? in $(( $(date +%s) - start )) s" > "$out/summary.txt"
fi
# Two nodes of one GPU each, then of two GPUs each, through torchrun's c10d rendezvous as between hosts.
node_run() {  # node_run NAME NPROC DEVICES_NODE0 DEVICES_NODE1 WORLD_SIZES
  local name=$1 nproc=$2 port=$((29500 + RANDOM % 1000)) t0
  t0=$(date +%s)
  for i in 0 1; do
    local devs=$3; [ "$i" = 1 ] && devs=$4
    CUDA_VISIBLE_DEVICES=$devs NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout "${NODES_LIMIT_S:-110}" python3 -m torch.distributed.run \
      --nnodes 2 --nproc-per-node "$nproc" --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port --rdzv-id "$name" \
      --max-restarts 0 --log-dir "$out/$name-torchrun$i" -m distbench.cli launch --parity -- -s ddp,fsdp_full,fsdp_hybrid,zero2 -n "$5" \
      -m gpt2-124m --steps 3 --warmup 1 --seq-len 256 -o "$out/$name" > "$out/$name-agent$i.log" 2>&1 &
  done
  wait
  echo "$name: $(( $(date +%s) - t0 )) s" >> "$out/summary.txt"
  grep -h "^parity " "$out/$name"-agent*.log | sed "s/^/  /" >> "$out/summary.txt"
}
nodes=" ${NODES:-nodes2x1 nodes2x2} "
[[ $nodes == *" nodes2x1 "* ]] && node_run nodes2x1 1 0 1 1,2
[[ $nodes == *" nodes2x2 "* ]] && node_run nodes2x2 2 0,1 2,3 2,4
[ -f "$out/pytest.log" ] && grep -E "^(FAILED|ERROR|UNDECIDED|E   )|passed|failed" "$out/pytest.log" | cut -c1-300 | tail -40
touch "$out/summary.txt"
grep -h "Segmentation\|SIGSEGV\|job [0-9]*:\|Error\|error" "$out"/nodes*-agent*.log | sort | uniq -c | sort -rn | head -30
cat "$out/summary.txt"
