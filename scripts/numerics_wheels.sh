#!/usr/bin/env bash
# The wheels scripts/numerics_gpu.sh installs on an offline GPU machine: scripts/numerics_wheels.sh DIR
#   transformers BASE_TRANSFORMERS (default 5.17.0, the GPU image's) and HEAD_TRANSFORMERS (default 5.24.0, the
#   lock's), and a huggingface_hub both accept (HUB, default ">=1.31,<2": 5.17 asks <2, 5.24 >=1.31), for
#   Python 3.12 on manylinux x86_64. Both are pure-Python wheels; tokenizers stays the image's (both ask
#   >=0.23.1,<0.24). Carry DIR to the GPU machine and pass it as numerics_gpu.sh's second argument.
set -euo pipefail
dir=${1:?usage: scripts/numerics_wheels.sh DIR}
mkdir -p "$dir"
get() {
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$dir" "$@"
}
get "transformers==${BASE_TRANSFORMERS:-5.17.0}"
get "transformers==${HEAD_TRANSFORMERS:-5.24.0}"
get "huggingface_hub${HUB:->=1.31,<2}"
ls -l "$dir"
