"""CI runs the README, not a copy of it: `.ci/run` reads the "Run it" lines from the README when it runs and runs
them first, as written, before it installs anything of its own; the per-change run applies the lock through
pip's own environment (PIP_CONSTRAINT), the nightly (`--newest`) does not. `.ci/run --plan` prints the steps
its run takes from the same list, so what the plan says is what runs. Each check is shown failing on a planted
`.ci/run` that stopped reading the README."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from distbench.results import make_result, save_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "strategy": "ddp",
    "world_size": 2,
    "model": "gpt2-tiny",
    "precision": "fp32",
    "seq_len": 32,
    "global_batch": 8,
    "micro_batch": 2,
}
RUN_IT = "## Run it\n\n```bash\n{lines}\n```\n"

_spec = importlib.util.spec_from_file_location("readme_run_it", ROOT / "scripts" / "readme_run_it.py")
assert _spec is not None and _spec.loader is not None
readme_run_it = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_run_it)


def plan(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / ".ci" / "run"), "--plan", *flags], capture_output=True, text=True
    )


def steps(out: str) -> list[tuple[str, str]]:
    return [tuple(line.split("|", 1)) for line in out.splitlines()]  # type: ignore[misc]


def tree(tmp_path: Path, run_script: str | None = None, readme: str | None = None) -> Path:
    """A copy of what `.ci/run --plan` reads: the script, the README's parser, and a README."""
    (tmp_path / ".ci").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / ".ci" / "run").write_text(run_script or (ROOT / ".ci" / "run").read_text())
    shutil.copy(ROOT / "scripts" / "readme_run_it.py", tmp_path / "scripts")
    (tmp_path / "README.md").write_text(readme or (ROOT / "README.md").read_text())
    return tmp_path


def problems(root: Path) -> list[str]:
    """What keeps `.ci/run` at `root` from running the README: each a sentence, none when it does."""
    found = []
    readme = readme_run_it.run_it_lines((root / "README.md").read_text())
    result = plan(root)
    if result.returncode:
        return [f".ci/run --plan failed: {result.stderr}"]
    ran = steps(result.stdout)
    first = [cmd for what, cmd in ran if what.startswith("readme")]
    if first != readme:
        found.append(f"runs {first}, where the README says {readme}")
    order = [what for what, _ in ran if what != "env"]
    if "ci" in order and any(w.startswith("readme") for w in order[order.index("ci") :]):
        found.append("installs its own before the README's lines have run")
    if ("env", f"PIP_CONSTRAINT={root}/.ci/constraints.txt") not in ran:
        found.append("does not apply the lock through PIP_CONSTRAINT")
    if any(what == "env" for what, _ in steps(plan(root, "--newest").stdout)):
        found.append("applies the lock to the nightly's newest releases")
    return found


def test_ci_runs_the_readmes_lines_first_as_written():
    assert problems(ROOT) == []
    lines = readme_run_it.run_it_lines((ROOT / "README.md").read_text())
    assert lines[0].endswith("distbench run") and lines[-1].endswith("&& pytest"), lines  # main job and tier
    ran = steps(plan(ROOT).stdout)
    assert [w for w, _ in ran][:4] == ["env", "readme 1", "results", "readme 2"]  # line 1 wrote its results


def test_ci_reads_the_readme_when_it_runs(tmp_path):
    """A README whose lines changed is what the plan runs; a README without them stops CI, saying so."""
    changed = RUN_IT.format(
        lines="pip install -e . && distbench run --steps 2\npip install -e '.[test]' && pytest -x"
    )
    root = tree(tmp_path, readme="# distbench\n\n" + changed)
    assert problems(root) == []
    assert [c for w, c in steps(plan(root).stdout) if w.startswith("readme")][
        1
    ] == "pip install -e '.[test]' && pytest -x"
    (root / "README.md").write_text("# distbench\n\nNo commands.\n")
    result = plan(root)
    assert result.returncode != 0 and "no '## Run it' section" in result.stderr


def test_the_check_catches_a_ci_run_that_stopped_reading_the_readme(tmp_path):
    script = (ROOT / ".ci" / "run").read_text()
    hard_coded = script.replace(
        "readme_text=$(python3 scripts/readme_run_it.py README.md)",
        "readme_text='pip install -e \".[dev]\" && pytest'",
    )
    assert hard_coded != script
    assert any("where the README says" in p for p in problems(tree(tmp_path / "a", hard_coded)))
    own_first = script.replace('for s in "${own[@]}"; do steps+=("ci|$s"); done', "").replace(
        "steps=()", 'steps=("ci|pip install -e .[dev]")'
    )
    assert own_first != script
    assert any("installs its own" in p for p in problems(tree(tmp_path / "b", own_first)))
    no_lock = script.replace('[ "$lock" = 1 ] && echo "env|PIP_CONSTRAINT=$root/.ci/constraints.txt"', "true")
    assert no_lock != script
    assert any("PIP_CONSTRAINT" in p for p in problems(tree(tmp_path / "c", no_lock)))


def test_the_readme_parser_takes_the_run_it_block_only():
    text = (
        "# x\n\n## Before\n\n```bash\nnot this\n```\n\n"
        + RUN_IT.format(lines="a && b\n\n# a note\nc")
        + "\n## After\n"
    )
    assert readme_run_it.run_it_lines(text) == ["a && b", "c"]
    for broken in ("# x\n", "## Run it\n\nprose only\n", RUN_IT.format(lines="# only a comment")):
        with pytest.raises(readme_run_it.NoRunIt):
            readme_run_it.run_it_lines(broken)


_spec = importlib.util.spec_from_file_location("check_run_results", ROOT / "scripts" / "check_run_results.py")
assert _spec is not None and _spec.loader is not None
check_run_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_run_results)


def check_results(out: Path, marker: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = check_run_results.main([str(out), str(marker)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_results_check_wants_fresh_ok_results(tmp_path, capsys):
    """After the README's first line CI requires what `distbench run` wrote: fresh results, every one ok."""
    out, marker = tmp_path / "distbench-results", tmp_path / "started"
    out.mkdir()
    old = save_result(make_result(CONFIG | {"world_size": 1}), out)
    os.utime(old, (time.time() - 60, time.time() - 60))
    marker.touch()
    assert check_results(out, marker, capsys)[0] == 1  # only an older run's result: this run wrote none
    save_result(make_result(CONFIG | {"world_size": 2}), out)
    code, stdout, stderr = check_results(out, marker, capsys)
    assert code == 0 and "wrote 1 result(s)" in stdout, stderr
    save_result(make_result(CONFIG | {"strategy": "zero3"}, status="error", error="boom"), out)
    code, _, stderr = check_results(out, marker, capsys)
    assert code == 1 and "boom" in stderr
