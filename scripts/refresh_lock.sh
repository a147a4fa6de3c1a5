#!/usr/bin/env bash
# Refresh CI's lock, .ci/constraints.txt, to the newest releases that pyproject.toml ([dev]) and
# .ci/constraints.in allow, for every Python the project supports, then the README's line of the versions it
# pins (scripts/readme_versions.py). Run it in the project's dev environment with uv (`pip install uv`): it
# holds torch, which DeepSpeed's sdist imports to say what it needs (no build isolation, as .ci/run builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
# --python-version: the oldest Python pyproject.toml's requires-python allows (uv's pip interface starts the
# universal lock at the running one's otherwise, and leaves out what only older ones need)
uv pip compile --upgrade --universal --python-version 3.10 --no-build-isolation --extra dev \
    --custom-compile-command "bash scripts/refresh_lock.sh" \
    -o .ci/constraints.txt pyproject.toml .ci/constraints.in
python scripts/readme_versions.py
