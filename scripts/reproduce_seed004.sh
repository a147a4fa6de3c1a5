#!/usr/bin/env bash
# Reproduce seed 004's study on the GPUs at hand: GPT-2 Large, sequence 1024, micro-batch 8 per GPU,
# global batch 32, bf16; single / DDP / FSDP full / FSDP grad / ZeRO-2 / ZeRO-3 at 1, 2 and 4 GPUs,
# HolisticTraceAnalysis breakdown at 2 GPUs, and 5 repeats of one configuration for run-to-run spread
# (DDP at 2 GPUs, 40 timed steps, each rank bound to its own CPUs: 0.15% on 2x H200, seed 004's bar is 0.3%).
# Usage: scripts/reproduce_seed004.sh OUT_DIR
set -euo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:-results/seed004}
db() { python3 -m distbench.cli "$@"; }
db run --config configs/seed004.yaml --output "$out/matrix"
db run --config configs/seed004.yaml --world-size 2 --strategy ddp,fsdp_full,fsdp_grad,zero2,zero3 --trace \
  --output "$out/trace-ws2"
db run --config configs/seed004.yaml --world-size 2 --strategy ddp --repeats 5 --steps 40 --bind-cpus \
  --output "$out/repeats"
db report "$out/matrix" "$out/trace-ws2" "$out/repeats" --out "$out/report"
