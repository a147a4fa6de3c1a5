#!/usr/bin/env bash
# The numerics comparison's evidence on one GPU (about 6 minutes on an H200): scripts/numerics_gpu.sh OUT WHEELS
#   1  pytest -m gpu tests/test_numerics.py --update-goldens: the SDPA backends' bites (flash, memory-efficient,
#      cuDNN against deterministic mode's math kernel: "diverged", bf16 parity green), and this machine's
#      goldens of every strategy that runs here, written and copied to OUT/goldens/ (commit them to keep them)
#   2  distbench ab --numerics only, head with every SDPA call on flash (tests/plant_site): exit 4 expected
#   3  distbench ab --numerics only, transformers BASE_TRANSFORMERS against HEAD_TRANSFORMERS, each installed
#      from WHEELS (scripts/numerics_wheels.sh DIR, run where the package index is reachable) into its own
#      --target directory and given to its variant as path=
# Writes OUT/junit-numerics.xml, OUT/<comparison>/ab.json and ab.md, OUT/*.log, and prints a table of the
# verdicts last. The machine may be offline: nothing is downloaded.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/numerics_gpu.sh OUT WHEELS}
wheels=${2:?usage: scripts/numerics_gpu.sh OUT WHEELS (scripts/numerics_wheels.sh writes WHEELS)}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
root=$(pwd)
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$root/tests/numerics_plants.py" ] || { echo "run from the distbench checkout" >&2; exit 2; }
mkdir -p "$out"
base_tf=${BASE_TRANSFORMERS:-5.17.0} head_tf=${HEAD_TRANSFORMERS:-5.24.0}
for v in "$base_tf" "$head_tf"; do
  [ -n "$(ls "$wheels"/transformers-"$v"-*.whl 2>/dev/null)" ] \
    || { echo "no transformers $v wheel in $wheels: run scripts/numerics_wheels.sh $wheels" >&2; exit 2; }
done
start=$(date +%s)
echo "== 1: pytest -m gpu tests/test_numerics.py --update-goldens ($(date +%T))"
timeout -k 30 240 python3 -m pytest -m gpu tests/test_numerics.py --update-goldens --lanes off \
  -p no:cacheprovider -q -rs --junitxml "$out/junit-numerics.xml" > "$out/pytest.log" 2>&1
echo $? > "$out/pytest.exit"
tail -n 25 "$out/pytest.log"
mkdir -p "$out/goldens" && cp -r "$root"/tests/goldens/*/ "$out/goldens/" 2>/dev/null
ab() {  # NAME distbench-ab-args...: one numerics-only comparison at one rank, its exit in OUT/NAME.exit
  local name=$1; shift
  timeout -k 30 150 python3 -m distbench.cli ab --numerics only --recipes default -n 1 -o "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo $? > "$out/$name.exit"
  echo "== $name: exit $(cat "$out/$name.exit") ($(date +%T))"
}
echo "== 2: head on SDPA flash ($(date +%T))"
ab sdpa-flash -s ddp -m gpt2-124m --precision bf16 --micro-batch 8 --seq-len 1024 \
  --head "path=$root/tests/plant_site,env.DISTBENCH_NUMERICS_PLANT=sdpa_flash"
echo "== 3: transformers $base_tf against $head_tf ($(date +%T))"
tmp=$(mktemp -d /tmp/distbench-numerics-XXXX)
trap 'rm -rf "$tmp"' EXIT
for v in "$base_tf" "$head_tf"; do
  python3 -m pip install -q --no-deps --no-index --find-links "$wheels" --target "$tmp/tf-$v" \
    "transformers==$v" "huggingface_hub${HUB:->=1.31,<2}" > "$out/install-$v.log" 2>&1 \
    || { echo "install of transformers $v failed: $out/install-$v.log" >&2; }
  PYTHONPATH="$tmp/tf-$v:$PYTHONPATH" python3 -c "import transformers; print('transformers', transformers.__version__)"
done
ab "transformers-$base_tf-vs-$head_tf" -s ddp,fsdp_full -m gpt2-124m --precision bf16 --micro-batch 8 \
  --seq-len 1024 --base "path=$tmp/tf-$base_tf" --head "path=$tmp/tf-$head_tf"
echo "wall $(($(date +%s) - start)) s; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
junit = out / "junit-numerics.xml"
if junit.exists():
    import xml.etree.ElementTree as ET
    for case in ET.parse(junit).iter("testcase"):
        tags = {child.tag for child in case}
        state = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        print(f"pytest {case.get('name'):58} {state}")
print(f"{'comparison':34} {'config':36} {'numerics':17} detail")
for f in sorted(out.glob("*/ab.json")):
    report = json.loads(f.read_text())
    for n in report["numerics"]:
        print(f"{f.parent.name:34} {n['config']:36} {n['verdict']:17} {(n['detail'] or '')[:110]}")
    print(f"{f.parent.name:34} exit {report['exit_code']}")
PY
