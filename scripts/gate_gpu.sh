#!/usr/bin/env bash
# The A/B gate's evidence on one 4-GPU machine: scripts/gate_gpu.sh OUT
#   phase 1  world size 2, a planted 1% of extra device work in head: ddp on GPUs 0,1 and zero3 on 2,3 at once
#   phase 2  world size 2, A/A (head = base): ddp on GPUs 0,1; on 2,3 a planted 2% host busy loop in a
#            host-bound configuration (ddp, GPT-2 124M, micro-batch 1)
#   phase 3  world size 4, the 1% device plant in ddp
#   phase 4  world size 4, the 1% device plant in zero3
# PHASES="1 2" (the default) fits one 10-minute command; PHASES="3 4" is the next. Each comparison gets the
# 5 minutes a pull request's gate allows (B2, B4 seconds; default 280): on 4 H200s a world-size-2 pair costs
# about 40 s (fresh ranks, GPT-2 Large built and warmed), and at 125 s the A/A read +0.18%, -0.11% and +0.14%
# in its 3 pairs and stayed undecided, as the interval over 3 pairs at the family-wise alpha is +/-1.5%.
# Two comparisons at once run on disjoint GPUs and disjoint halves of the CPUs (taskset; --bind-cpus slices
# each half): no timing run shares a GPU. They share the host's memory bandwidth and power, which moves
# both variants of a comparison alike within the few seconds its windows alternate over: more noise in a
# host-bound step time, no bias; a comparison left undecided can be rerun alone (CONCURRENT=0).
# Writes OUT/<name>/ (every run's result, ab.json, ab.md), OUT/<name>.log and OUT/machine.txt, and prints
# a table of the verdicts last. AB="..." adds distbench ab flags to every comparison.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/gate_gpu.sh OUT}
mkdir -p "$out"
root=$(pwd)
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$root/scripts/plants/device-2pct.patch" ] || { echo "run from the distbench checkout" >&2; exit 2; }
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 4 ] || { echo "needs 4 GPUs, found $gpus" >&2; exit 2; }
machine_txt "$out/machine.txt"
plants=()
trap 'rm -rf ${plants[@]+"${plants[@]}"}' EXIT  # the planted copies go with the script
planted() {  # sets $tree: a copy of this checkout's src with one plant applied (scripts/plants/)
  tree=$(mktemp -d "/tmp/distbench-plant-$1-XXXX")
  plants+=("$tree")
  cp -r "$root/src" "$tree/src"
  (cd "$tree" && patch -sp1 < "$root/scripts/plants/$1.patch") || exit 1
}
planted device-2pct; device="tree=$tree,env.DISTBENCH_PLANT_SHARE=0.01"
planted host-5pct; host="tree=$tree,env.DISTBENCH_PLANT_SHARE=0.02"
cpus=$(nproc); half=$((cpus / 2))
low="0-$((half - 1))" high="$half-$((cpus - 1))"
[ "${CONCURRENT:-1}" = 1 ] || { low="0-$((cpus - 1))" high=$low; }
ab() {  # NAME GPUS CPUS BUDGET distbench-ab-args...: one comparison, its exit status in OUT/NAME.exit
  local name=$1 devices=$2 cpuset=$3 budget=$4; shift 4
  # shellcheck disable=SC2086  # AB is a flag list
  CUDA_VISIBLE_DEVICES=$devices timeout -s INT -k 30 $((budget + 90)) taskset -c "$cpuset" \
    python3 -m distbench.cli ab --bind-cpus --numerics default -o "$out/$name" --budget "$budget" ${AB:-} "$@" > "$out/$name.log" 2>&1
  echo $? > "$out/$name.exit"
  echo "== $name: exit $(cat "$out/$name.exit") ($(date +%T))"
}
both() {  # runs two comparisons at once (CONCURRENT=1, the default) or one after the other
  if [ "${CONCURRENT:-1}" = 1 ]; then "$@" & else "$@"; fi
}
start=$(date +%s)
b2=${B2:-280} b4=${B4:-280}
for phase in ${PHASES:-1 2}; do
  case $phase in
    1) both ab ws2-ddp-device1pct 0,1 "$low" "$b2" -s ddp -n 2 --head "$device"
       ab ws2-zero3-device1pct 2,3 "$high" "$b2" -s zero3 -n 2 --head "$device"
       wait ;;
    2) both ab ws2-ddp-aa 0,1 "$low" "$b2" -s ddp -n 2
       ab ws2-host2pct 2,3 "$high" "$b2" -s ddp -n 2 -m gpt2-124m --micro-batch 1 --head "$host"
       wait ;;
    3) ab ws4-ddp-device1pct 0,1,2,3 "0-$((cpus - 1))" "$b4" -s ddp -n 4 --head "$device" ;;
    4) ab ws4-zero3-device1pct 0,1,2,3 "0-$((cpus - 1))" "$b4" -s zero3 -n 4 --head "$device" ;;
    *) echo "no phase $phase (PHASES takes 1 2 3 4)" >&2; exit 2 ;;
  esac
done
echo "wall $(($(date +%s) - start)) s; $(head -n 1 "$out/machine.txt") x$gpus" | tee "$out/wall.txt"
python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def cell(x):
    e = x["effect"]
    return f"{x['metric']} {e['estimate']:+.2%} [{e['low']:+.2%}, {e['high']:+.2%}] (±{e['detectable']:.2%})"
print(f"{'comparison':22} {'exit':>4} {'pairs':>5} {'s':>4} {'mode':7} {'verdict':10} gated: effect [interval] (detectable)")
for log in sorted(out.glob("*.log")):
    f = out / log.stem / "ab.json"
    if not f.exists():
        print(f"{log.stem:22} {(out / (log.stem + '.exit')).read_text().strip():>4}  no ab.json: see {log}")
        continue
    r = json.loads(f.read_text())
    for c in r["configs"]:
        rows = [x for x in c["rows"] if x["effect"] and not x["metric"].startswith("mem_")]
        print(f"{log.stem:22} {r['exit_code']:>4} {len(c['orders']):>5} {r['elapsed_s']:>4.0f} {c['interleave']:7} "
              f"{c['verdict'].upper():10} " + "; ".join(cell(x) for x in rows if x["gated"]))
        # the device-side candidates side by side, the gated one among them (fixed before the first pair)
        print(f"{'':22} device: " + "; ".join(cell(x) for x in rows if x["metric"].startswith("device_compute")))
        print(f"{'':22} {c.get('ruled_out', '')}")
    for line in r.get("sizing", []):
        print(f"{'':22} size: {line}")
EOF
