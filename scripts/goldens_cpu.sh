#!/usr/bin/env bash
# The CPU goldens of both instruction-set classes, from one AVX-512 machine (about 3 minutes on 2 cores):
#   scripts/goldens_cpu.sh [--update]
# With --update, writes tests/goldens/cpu-avx512/ natively and tests/goldens/cpu-avx2/ with torch's, MKL's and
# oneDNN's kernels held to AVX2 (testsuite/goldens.py: ISA_ENV); each golden's history records what moved.
# Then runs test_matches_golden under each class, which must pass, not skip. Run from the checkout, in the
# environment whose versions the goldens should record.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qw avx512f /proc/cpuinfo || { echo "needs an AVX-512 machine (it emulates AVX2 from there)" >&2; exit 2; }
update=()
[ "${1:-}" = "--update" ] && update=(--update-goldens)
avx2=$(PYTHONPATH=src python -c "from distbench.testsuite.goldens import ISA_ENV
print(' '.join(f'{k}={v}' for k, v in ISA_ENV['avx2'].items()))")
run() {  # run CLASS [ENV...]: test_matches_golden of the CPU tier under ENV
  local class=$1; shift
  echo "== $class ${update[*]:-(compare)}"
  env "$@" python -m pytest tests/test_numerics.py -k test_matches_golden --lanes off -p no:cacheprovider \
    -q -rs "${update[@]}" | tail -n 4
}
run cpu-avx512
# shellcheck disable=SC2086
run cpu-avx2 $avx2
if [ ${#update[@]} -gt 0 ]; then
  update=()
  run cpu-avx512
  # shellcheck disable=SC2086
  run cpu-avx2 $avx2
fi
