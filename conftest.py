import sys
from pathlib import Path

# Test this checkout's code even when another checkout of distbench is installed (editable installs, A/B
# worktrees): rank processes are spawned with this sys.path too.
sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

pytest_plugins = ["distbench.testsuite.plugin", "distbench.testsuite.budget"]
