#!/usr/bin/env bash
# Evidence for distbench bisect on one GPU: a 16-revision history of this checkout's src/ in a temporary
# repository, revision CULPRIT applying a planted slowdown (scripts/plants/PLANT.patch, default device-2pct:
# +2% of device work per step), bisected in the gate's device-bound configuration on one GPU (ddp, world
# size 1, GPT-2 Large, bf16, micro-batch 16, as results/gate-device-h200-2026-11-24 ran it; whole runs
# alternate, as two of its 83 GiB runs do not fit at once).
# Usage: scripts/bisect_evidence.sh OUT   writes OUT/bisect.md, OUT/bisect.json, OUT/probes/, OUT/bisect.log.
# The history is the same on every run (fixed authors and dates), so a run cut short (a time limit, a kill)
# resumes where it stopped when run again with the same OUT.
# CULPRIT=1..16 (default 11); PLANT=host-sleep-5pct for a host-side plant; CONFIG="..." replaces the
# configuration flags (on CPU, to try the script: CONFIG="--device cpu -s ddp -n 1 -m gpt2-tiny"); BISECT="..."
# adds distbench bisect flags (default schedule: 3 to 6 pairs a probe, judged after every pair).
set -euo pipefail
. "$(dirname "$0")/gpu_env.sh"
out=${1:?usage: scripts/bisect_evidence.sh OUT}
culprit=${CULPRIT:-11}
plant=${PLANT:-device-2pct}
root=$(pwd)
[ -f "$root/scripts/plants/$plant.patch" ] || { echo "run from the distbench checkout; no plant $plant" >&2; exit 2; }
mkdir -p "$out"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export GIT_AUTHOR_NAME="distbench evidence" GIT_AUTHOR_EMAIL="evidence@distbench.invalid"
export GIT_COMMITTER_NAME="$GIT_AUTHOR_NAME" GIT_COMMITTER_EMAIL="$GIT_AUTHOR_EMAIL"
export GIT_AUTHOR_DATE="2026-01-01T00:00:00Z" GIT_COMMITTER_DATE="2026-01-01T00:00:00Z"

repo=$(mktemp -d "${TMPDIR:-/tmp}/bisect-evidence-XXXX")
trap 'rm -rf "$repo"' EXIT
# Only what the revisions run, without bytecode: the same commits, and ids, on every run.
tar -C "$root" --exclude=__pycache__ --exclude='*.pyc' -cf - src | tar -C "$repo" -xf -
(
  cd "$repo"
  git init -q -b main
  git add -A && git commit -q -m "revision 0: this checkout's src"
  for i in $(seq 1 16); do
    echo "$i" > REVISION
    msg="revision $i"
    if [ "$i" = "$culprit" ]; then
      patch -sp1 < "$root/scripts/plants/$plant.patch"
      msg="$msg: $plant"
    fi
    git add -A && git commit -q -m "$msg"
  done
)
good=$(git -C "$repo" rev-list --max-parents=0 HEAD)
bad=$(git -C "$repo" rev-parse HEAD)
config="-s ddp -n 1 -m gpt2-large --precision bf16 --micro-batch 16 --interleave runs"
# shellcheck disable=SC2086  # CONFIG and BISECT are flag lists
python3 -m distbench.cli bisect --repo "$repo" --good "$good" --bad "$bad" --bind-cpus ${CONFIG:-$config} \
  --min-pairs 3 --look-every 1 --max-pairs 6 ${BISECT:-} -o "$out" 2>&1 | tee -a "$out/bisect.log"
