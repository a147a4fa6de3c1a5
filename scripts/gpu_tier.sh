#!/usr/bin/env bash
# The GPU tier in less wall time: the correctness tests of world sizes 1 and 2 run side by side on disjoint
# GPUs (they are mostly model build, checkpoint and gather time, not GPU time), then world size 4 on four GPUs,
# then the benchmarks alone, so no timing shares the machine. On 4x H200 the whole `pytest -m gpu` in one
# session is about an hour at 10-15 s a case; the first two sessions here overlap.
# Usage: scripts/gpu_tier.sh OUT_DIR [extra pytest args...]   (junit XML and a log per session in OUT_DIR)
set -uo pipefail
out=${1:?usage: scripts/gpu_tier.sh OUT_DIR [pytest args...]}; shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$n" -lt 1 ]; then echo "gpu_tier.sh: no CUDA device here; plain pytest runs the CPU tier" >&2; exit 2; fi
correctness=(tests --ignore=tests/test_benchmarks.py)
session() {  # name, GPUs, pytest args...
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=20 \
    --junitxml="$out/$name.xml" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name (GPUs $gpus): rc $rc, $(tail -n 1 "$out/$name.log")"
  return $rc
}
rc=0
# Test ids carry the world size ("-ws2-", "ws1-to-ws2"); cases without one (the fidelity and OOM-sweep
# benchmarks) belong to the benchmark session.
if [ "$n" -ge 3 ]; then
  session ws1 0 "${correctness[@]}" --world-sizes 1 -k "ws1 and not ws2 and not ws4" "$@" & p1=$!
  session ws2 1,2 "${correctness[@]}" --world-sizes 2 -k "ws2 and not ws4" "$@" & p2=$!
  wait $p1 || rc=1; wait $p2 || rc=1
  all=$(seq -s, 0 $((n - 1)))
  if [ "$n" -ge 4 ]; then session ws4 "$all" "${correctness[@]}" --world-sizes 4 -k "ws4" "$@" || rc=1; fi
else
  all=$(seq -s, 0 $((n - 1)))
  session correctness "$all" "${correctness[@]}" "$@" || rc=1
fi
session benchmarks "$all" tests/test_benchmarks.py "$@" || rc=1
exit $rc
