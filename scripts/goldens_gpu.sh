#!/usr/bin/env bash
# The H200 goldens, written and then checked, on one GPU (about 4 minutes on an H200; an 80 GB H100 fits it but
# is another machine class, tests/goldens/nvidia-h100-*): scripts/goldens_gpu.sh OUT
#   1  pytest -m gpu -k test_matches_golden --update-goldens: every strategy's golden at one rank, written
#      into tests/goldens/<this GPU>/ with this environment's versions; a golden there before keeps its
#      history and gains an entry for what moved between which versions (testsuite/goldens.py)
#   2  the same tests comparing, as the GPU tier runs them: each must pass, none skip
# Writes OUT/junit-update.xml, OUT/junit-check.xml, OUT/*.log, OUT/goldens/ (commit them from there into
# tests/goldens/) and prints a table of each golden test's outcome and its history's last entry.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/goldens_gpu.sh OUT}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
root=$(pwd)
[ -d "$root/tests/goldens" ] || { echo "run from the distbench checkout" >&2; exit 2; }
mkdir -p "$out"
machine_txt "$out/machine.txt"
start=$(date +%s)
golden_tests() {  # golden_tests NAME [pytest args...]
  local name=$1; shift
  timeout -k 30 400 python3 -m pytest -m gpu tests/test_numerics.py -k test_matches_golden --lanes off \
    -p no:cacheprovider -q -rs --junitxml "$out/junit-$name.xml" "$@" > "$out/$name.log" 2>&1
  echo $? > "$out/$name.exit"
  echo "== $name: exit $(cat "$out/$name.exit") ($(date +%T))"
  grep -E "^golden written|passed|failed" "$out/$name.log" | tail -n 20
}
golden_tests update --update-goldens
golden_tests check
mkdir -p "$out/goldens" && cp -r "$root"/tests/goldens/nvidia-*/ "$out/goldens/" 2>/dev/null
echo "wall $(($(date +%s) - start)) s; $(head -n 1 "$out/machine.txt")"
python3 - "$out" <<'PY'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
for name in ("update", "check"):
    junit = out / f"junit-{name}.xml"
    if not junit.exists():
        print(f"{name}: no junit file (see {name}.log)")
        continue
    for case in ET.parse(junit).iter("testcase"):
        tags = {child.tag for child in case}
        state = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        print(f"{name:7} {case.get('name'):58} {state}")
for f in sorted(out.glob("goldens/*/*.json")):
    d = json.loads(f.read_text())
    last = (d.get("history") or [{}])[-1]
    print(f"{f.parent.name}/{f.name:40} {d['versions'].get('torch')} moved {last.get('values_moved', '-')} "
          f"max ulps {last.get('max_ulps', '-')}")
PY
