"""The GitHub workflows keep their security and scheduling policy: pinned actions, least privilege, a PR
guard on the self-hosted GPU runner, one job per runner at a time, timeouts, multicast off."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
CI, GPU, BISECT = WORKFLOWS / "ci.yml", WORKFLOWS / "gpu.yml", WORKFLOWS / "bisect.yml"
SCALE, NIGHTLY = WORKFLOWS / "scale.yml", WORKFLOWS / "nightly.yml"
ALL = [CI, GPU, BISECT, SCALE, NIGHTLY]
PINNED = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}$")


def load(path: Path) -> dict:
    wf = yaml.safe_load(path.read_text())
    wf["on"] = wf.pop(True, wf.get("on"))  # YAML 1.1 reads the key `on` as a boolean
    return wf


def steps(wf: dict) -> list[dict]:
    return [s for job in wf["jobs"].values() for s in job.get("steps", [])]


def runs(wf: dict) -> str:
    return "\n".join(s["run"] for s in steps(wf) if "run" in s)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_every_action_is_pinned_to_a_commit_with_its_version(path):
    uses = [s["uses"] for s in steps(load(path)) if "uses" in s]
    assert uses
    for u in uses:
        assert PINNED.match(u), f"{u} is not pinned to a full commit SHA"
    for line in path.read_text().splitlines():
        if "uses:" in line:
            assert re.search(r"@[0-9a-f]{40} # v\d+(\.\d+)*$", line), f"no version comment: {line.strip()}"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_read_only_by_default_and_timeouts_everywhere(path):
    wf = load(path)
    assert wf["permissions"] == {"contents": "read"}
    for name, job in wf["jobs"].items():
        assert job_timeouts(job), f"job {name} has no timeout-minutes"


def job_timeouts(job: dict) -> list[int]:
    """A job's timeout-minutes: a number, or `cond && N || M` (one for pull requests, one otherwise)."""
    t = job.get("timeout-minutes")
    if isinstance(t, int):
        return [t]
    m = re.fullmatch(r"\$\{\{ .+ && (\d+) \|\| (\d+) \}\}", str(t))
    return [int(m[1]), int(m[2])] if m else []


def test_a_pull_requests_gpu_job_holds_what_its_steps_may_take():
    """The pull-request job's limit is its steps' limits and 3 minutes for checkout and install (beside it, what
    is known of the job's wall time on a 4x H100 runner: not yet measured); the gate runs at world size 2 whatever the runner's GPU
    count, and its budget leaves its step 2 minutes to start the variants and write the report (issue 40:
    the PR gate in at most 10 minutes on 2 GPUs)."""
    job = load(GPU)["jobs"]["gpu"]
    assert "pull_request" in job["timeout-minutes"] and "wall time on a 4x H100 runner" in GPU.read_text()
    pr_steps = [s for s in job["steps"] if s.get("if") == "github.event_name == 'pull_request'"]
    assert pr_steps and all("timeout-minutes" in s for s in pr_steps), pr_steps
    assert sum(s["timeout-minutes"] for s in pr_steps) + 3 == job_timeouts(job)[0]
    gate = next(s for s in pr_steps if "distbench ab" in s["run"])
    budget = re.search(r"--budget (\d+)", gate["run"])
    assert " -n 2 " in gate["run"] and gate["timeout-minutes"] <= 10
    assert budget and int(budget[1]) <= (gate["timeout-minutes"] - 2) * 60


def test_only_the_pages_job_may_write():
    for path in ALL:
        for name, job in load(path)["jobs"].items():
            if path == GPU and name == "pages":
                assert job["permissions"] == {"pages": "write", "id-token": "write"}
                assert any("actions/deploy-pages@" in s.get("uses", "") for s in job["steps"])
            else:
                assert "permissions" not in job, f"{path.name}:{name} widens permissions"


def test_ci_matrix_installs_cpu_torch_and_runs_the_linters():
    wf = load(CI)
    test = wf["jobs"]["test"]
    assert test["strategy"]["matrix"]["python-version"] == ["3.10", "3.11", "3.12"]
    assert test["runs-on"] == "ubuntu-latest"
    # the README's lines, read from it by .ci/run under the lock (tests/test_ci_run.py), torch from the CPU index
    (step,) = [s for s in test["steps"] if s.get("run") == "bash .ci/run"]
    assert step["env"]["PIP_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert not _pip_installs(runs({"jobs": {"test": test}})), "the test job installs beside .ci/run"
    newest = [s for s in load(NIGHTLY)["jobs"]["newest"]["steps"] if "run" in s]
    assert [s["run"] for s in newest] == ["bash .ci/run --newest"]
    script = runs(wf)
    assert re.search(r"^ruff check", script, re.M)
    for linter in ("actionlint", "check-jsonschema", "zizmor"):
        assert re.search(rf"^{linter}\b", script, re.M), f"ci.yml does not run {linter}"


def test_ci_builds_the_docs_strictly_with_a_pinned_toolchain():
    """Every pull request and push to main builds the docs site with warnings as errors and every reference
    resolved, from docs/requirements.txt, each of whose lines pins a version; the job is short."""
    job = load(CI)["jobs"]["docs"]
    script = "\n".join(s["run"] for s in job["steps"] if "run" in s)
    assert re.search(r"^sphinx-build -W --keep-going -n -b html docs \S+$", script, re.M)
    assert re.search(r"pip install -r docs/requirements\.txt$", script, re.M)
    lines = (ROOT / "docs" / "requirements.txt").read_text().splitlines()
    pins = [line for line in lines if line.strip() and not line.startswith("#")]
    assert {"sphinx", "myst-parser", "furo"} <= {p.split("==")[0] for p in pins}
    for pin in pins:
        assert re.fullmatch(r"[\w.-]+==[\w.]+", pin), f"docs/requirements.txt: {pin} is unpinned"
    assert job["timeout-minutes"] <= 10


def test_ci_smoke_tests_asv_on_the_cpu_grid():
    script = "\n".join(s["run"] for s in load(CI)["jobs"]["asv-smoke"]["steps"] if "run" in s)
    assert re.search(r"asv run --python=same --quick --set-commit-hash", script)  # results are saved
    assert "asv publish" in script
    assert re.search(
        r"^asv continuous .*origin/main HEAD$", script, re.M
    )  # the README's PR recipe, built fresh


def test_gpu_runs_on_a_runner_chosen_by_need_and_card_one_job_at_a_time():
    """Runners by what the job needs (a self-hosted GPU runner with 2 GPUs or more) and the card the team
    chose (a repository variable, H100 where unset), one job at a time on that card's runners."""
    job = load(GPU)["jobs"]["gpu"]
    card = "${{ vars.DISTBENCH_GPU || 'h100' }}"
    assert job["runs-on"] == ["self-hosted", "linux", "gpu", "gpus-2", card]
    assert job["concurrency"]["group"] == f"gpu-runner-{card}"
    assert job["concurrency"]["cancel-in-progress"] is False


def test_gpu_pull_requests_need_the_label_and_a_branch_of_this_repository():
    wf = load(GPU)
    assert "schedule" in wf["on"] and "pull_request" in wf["on"]
    assert "pull_request_target" not in wf["on"]  # would run fork code with a write token
    guard = " ".join(wf["jobs"]["gpu"]["if"].split())
    assert "github.event_name != 'pull_request' ||" in guard
    assert "contains(github.event.pull_request.labels.*.name, 'gpu') &&" in guard
    assert "github.event.pull_request.head.repo.full_name == github.repository" in guard
    assert "github.event.action != 'labeled' || github.event.label.name == 'gpu'" in guard  # not other labels
    assert (
        wf["jobs"]["pages"]["if"] == "github.event_name != 'pull_request' && github.ref == 'refs/heads/main'"
    )


def test_gpu_multicast_off_and_the_full_pipeline_present():
    wf = load(GPU)
    assert {
        k: wf["env"][k]
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    } == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    script = runs(wf)
    for needle in ("pytest -m gpu", "distbench run", "asv run", "asv publish", "--github-summary"):
        assert needle in script
    # pull requests gate on the interleaved A/B comparison of main against the head, not on asv's factor
    gate = next(s for s in steps(wf) if "distbench ab" in s.get("run", ""))
    assert gate["if"] == "github.event_name == 'pull_request'" and "--base rev=origin/main" in gate["run"]
    assert "--github-summary" in gate["run"] and "asv continuous" not in script
    uses = " ".join(s.get("uses", "") for s in steps(wf))
    for action in ("actions/upload-artifact@", "actions/upload-pages-artifact@", "actions/deploy-pages@"):
        assert action in uses


def test_the_scale_tier_runs_nightly_and_on_demand_never_on_pull_requests():
    """`pytest -m scale` (which the default run deselects) on a hosted runner with CPU torch, as ci.yml installs."""
    wf = load(SCALE)
    assert set(wf["on"]) == {"schedule", "workflow_dispatch"}
    assert (
        "-m 'not gpu and not slow and not scale and not nightly and not trace'"
        in (ROOT / "pyproject.toml").read_text()
    )
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    script = runs(wf)
    assert re.search(r"^pytest -m scale\b", script, re.M)
    assert "--index-url https://download.pytorch.org/whl/cpu" in script


def test_bisect_runs_on_demand_on_the_gpu_runner_with_good_and_bad_as_inputs():
    """workflow_dispatch only (never a pull request's code), the GPU runner's one-job-at-a-time group, the inputs
    passed to the command as environment variables (not spliced into the script: zizmor checks that too), and
    the report uploaded whatever the outcome, without the revisions' checkouts."""
    wf = load(BISECT)
    assert set(wf["on"]) == {"workflow_dispatch"}
    inputs = wf["on"]["workflow_dispatch"]["inputs"]
    assert inputs["good"]["required"] and {"bad", "strategy", "test"} <= set(inputs)
    (job,) = wf["jobs"].values()
    gpu = load(GPU)["jobs"]["gpu"]
    assert job["runs-on"] == gpu["runs-on"] and job["concurrency"] == gpu["concurrency"]
    assert {k: wf["env"][k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")} == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    }
    step = next(s for s in job["steps"] if "distbench bisect" in s.get("run", ""))
    assert "${{" not in step["run"] and step["env"]["GOOD"] == "${{ inputs.good }}"
    assert '--good "$GOOD" --bad "$BAD"' in step["run"] and "--github-summary" in step["run"]
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()" and "!${{ env.OUT }}/checkouts" in upload["with"]["path"]


def test_nightly_shuffles_the_tier_and_ratchets_the_mutation_score():
    """Scheduled (and by hand, never on a pull request's code): the CPU tier with the newest releases (no lock)
    and the property tests' nightly profile (fresh random cases, many more); the CPU tier in a random order
    across modules, so a test that passes only beside another fails, then the nightly cases the per-submission
    runs leave out; mutmut over the decision modules, scored against the committed baseline whatever the run's
    outcome, the survivors in the job summary and the artifact."""
    wf = load(NIGHTLY)
    assert set(wf["on"]) == {"schedule", "workflow_dispatch"}
    (tier,) = [s for s in wf["jobs"]["newest"]["steps"] if "run" in s]  # the README's lines, no lock
    assert tier["run"] == "bash .ci/run --newest" and tier["env"]["DISTBENCH_HYPOTHESIS"] == "nightly"
    shuffled = runs({"jobs": {"j": wf["jobs"]["random-order"]}})
    assert re.search(r"^pytest .*--random-order-bucket=global$", shuffled, re.M)
    assert re.search(r"^pytest .*-m nightly$", shuffled, re.M)
    assert re.search(r"^ +\"pytest -m 'slow and not nightly'\"$", (ROOT / ".ci" / "run").read_text(), re.M)
    mutation = wf["jobs"]["mutation"]
    script = runs({"jobs": {"j": mutation}})
    assert re.search(r"^mutmut run\b", script, re.M) and "mutmut results --all true" in script
    score = next(s for s in mutation["steps"] if "scripts/mutation_score.py" in s.get("run", ""))
    assert score["if"] == "always()" and '--summary "$GITHUB_STEP_SUMMARY"' in score["run"]
    assert "--update" not in score["run"]  # the baseline rises only by a commit
    assert '".[test,mutation]"' in script


LOCK = ".ci/constraints.txt"
CI_RUN = ROOT / ".ci" / "run"


def _pip_installs(text: str) -> list[tuple[list[str], bool]]:
    """Every `pip install` in a script: its package arguments (options and the project itself left out), and
    whether CI's lock constrains it (`-c .ci/constraints.txt`)."""
    out = []
    for line in text.splitlines():
        if "pip install" not in line:
            continue
        words = shlex.split(line.split("pip install", 1)[1].split("||")[0].split("#")[0])
        pkgs, skip, locked = [], False, False
        for i, w in enumerate(words):
            if skip:
                skip = False
            elif w in ("-e", "--index-url", "--extra-index-url", "-r", "-c"):
                skip = True
                locked = locked or (w == "-c" and words[i + 1 : i + 2] == [LOCK])
            elif not w.startswith("-"):
                pkgs.append(w)
        out.append((pkgs, locked))
    return out


def _pinned_scripts() -> list[str]:
    """The scripts whose installs must be pinned: .ci/run and every workflow job but the nightly `newest`,
    whose point is the newest releases."""
    jobs = [(path, name, job) for path in ALL for name, job in load(path)["jobs"].items()]
    return [runs({"jobs": {name: job}}) for path, name, job in jobs if (path, name) != (NIGHTLY, "newest")]


def test_tools_and_torch_are_installed_at_pinned_versions():
    """An unpinned linter or torch changes what CI checks from one day to the next without a commit: every
    package is named with its version, or installed under CI's lock."""
    installs = [p for script in _pinned_scripts() for p in _pip_installs(script)]
    named = [pkg for pkgs, _ in installs for pkg in pkgs]
    assert {"ruff==0.17.6", "zizmor==1.32.0", "torch==2.13.0"} <= set(named)
    for pkgs, locked in installs:
        for pkg in pkgs:
            assert locked or re.fullmatch(r"[\w.-]+==[\w.]+", pkg), f"{pkg} is installed unpinned"
    assert _pip_installs("pip install -q ruff torch==2.13.0 -e .") == [(["ruff", "torch==2.13.0"], False)]
    assert _pip_installs(f"pip install -c {LOCK} pip -e .") == [(["pip"], True)]
    assert _pip_installs("pip install -c other.txt pip") == [(["pip"], False)]


def test_ci_run_installs_into_a_fresh_virtualenv_from_the_lock():
    """.ci/run makes a virtualenv of its own in a fresh temporary folder, removes it when it ends, and installs
    there only through its steps (the README's lines first, tests/test_ci_run.py), after the lock is set in
    pip's own environment: nothing the machine had installed stands in for what a newcomer gets."""
    script = CI_RUN.read_text()
    lines = [
        line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    venv = lines.index('python3 -m venv "$VENV"')
    assert re.search(r'^VENV="\$\(mktemp -d ', script, re.M) and """trap 'rm -rf "$VENV"' EXIT""" in lines
    assert lines[venv + 1] == '. "$VENV/bin/activate"'
    lock = lines.index('export PIP_CONSTRAINT="$root/.ci/constraints.txt"')
    loop = lines.index('for step in "${steps[@]}"; do')
    assert venv < lock < loop
    assert not [ln for ln in lines if re.match(r"(python3? -m )?pip install", ln)], (
        "installs outside its steps"
    )


@pytest.mark.parametrize("path", [GPU, BISECT], ids=lambda p: p.name)
def test_self_hosted_jobs_install_into_a_throwaway_environment(path):
    """The GPU runner persists across jobs: a job installs into a virtualenv in its own temp directory, first."""
    for name, job in load(path)["jobs"].items():
        if "self-hosted" not in job["runs-on"]:
            continue
        scripts = [s.get("run", "") for s in job["steps"]]
        venv = next(
            i
            for i, r in enumerate(scripts)
            if re.search(r'python -m venv --system-site-packages "\$RUNNER_TEMP/', r)
        )
        assert '>> "$GITHUB_PATH"' in scripts[venv], f"{name}: the venv is not put first on PATH"
        first_install = next(i for i, r in enumerate(scripts) if "pip install" in r)
        assert venv < first_install, f"{name} installs before creating its environment"


def test_only_trusted_runs_write_the_published_asv_history():
    """Nothing on the runner carries the history from job to job (a pull request's code could rewrite it): it
    is restored from GitHub's cache by non-PR runs and saved only by runs on main."""
    text = GPU.read_text()
    assert "RUNNER_TOOL_CACHE" not in text and "ln -s" not in text
    for step in steps(load(GPU)):
        uses = step.get("uses", "")
        assert not uses.startswith("actions/cache@"), "actions/cache saves after every job, PRs included"
        if uses.startswith("actions/cache/save@"):
            assert step["if"] == "github.event_name != 'pull_request' && github.ref == 'refs/heads/main'"
        if uses.startswith("actions/cache/restore@") or "asv run" in step.get("run", ""):
            assert "github.event_name != 'pull_request'" in step["if"]


SHELL_STRING = re.compile(r"os\.system\(|os\.popen\(|shell\s*=\s*True")


def test_no_shell_strings_built_from_paths():
    """A path with a space or a quote in it must not become a shell command: argument lists only."""
    sources = [p for d in ("src", "tests", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py")]
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if SHELL_STRING.search(line) and p.name != "test_workflows.py"
    ]
    assert not offenders, f"shell strings: {offenders}"
    assert SHELL_STRING.search('os.system(f"cp -r {a} {b}")') and SHELL_STRING.search("run(cmd, shell=True)")


BROKEN = """\
name: broken
on:
  pull_request_target:
jobs:
  t:
    runs-on: ubuntu-latest
    tiemout-minutes: 5
    steps:
      - uses: actions/checkout@v4
        with:
          ref: ${{ github.event.pull_request.head.sha }}
      - run: echo "${{ github.event.pull_request.title }}"
"""


def installed_tool(name: str) -> str | None:
    """The executable `name` of this interpreter's own environment (its scripts directory, then the folder of
    sys.executable, unresolved: a virtualenv's python is a link out of it), else the first on PATH. Run as
    VENV/bin/python -m pytest without the virtualenv activated, PATH holds none of its tools."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which(name, path=folder)
        if found:
            return found
    return shutil.which(name)


def _lint(tool: str, *args: str) -> subprocess.CompletedProcess:
    exe = installed_tool(tool)
    assert exe, (
        f"{tool} is missing from this interpreter's environment ({sys.executable}) and PATH: "
        "pip install --no-build-isolation -e '.[test]' installs it"
    )
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _schema(*paths: Path) -> subprocess.CompletedProcess:
    return _lint("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *map(str, paths))


def _zizmor(path: Path) -> subprocess.CompletedProcess:
    return _lint("zizmor", "--offline", "--no-progress", str(path))


def test_workflows_match_githubs_schema():
    """The schema check catches typos GitHub would only report once the workflow is pushed."""
    proc = _schema(*ALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_zizmor_finds_no_security_issue():
    proc = _zizmor(WORKFLOWS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow  # the workflow linters as processes (~4 s on 2 cores)
def test_the_linters_catch_a_broken_workflow(tmp_path):
    """Both linters fail on a workflow with a misspelt key, a fork-code trigger, an unpinned action and a
    template injection, so a green lint above means something."""
    bad = tmp_path / "broken.yml"
    bad.write_text(BROKEN)
    schema = _schema(bad)
    assert schema.returncode != 0 and "tiemout-minutes" in schema.stdout
    audit = _zizmor(bad)
    assert audit.returncode != 0
    for finding in ("dangerous-triggers", "unpinned-uses", "template-injection"):
        assert finding in audit.stdout + audit.stderr


def test_pre_commit_runs_ruff_check_ruff_format_and_mypy_at_the_pinned_versions():
    """The hooks run the environment's ruff and mypy: the [lint] extra pins them, at the versions CI installs."""
    hooks = {
        h["id"]: h
        for repo in yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"]
        for h in repo["hooks"]
    }
    assert {"ruff", "ruff-format", "mypy"} <= set(hooks)
    assert hooks["ruff-format"]["entry"] == "ruff format" and hooks["ruff"]["entry"].startswith("ruff check")
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    extra = re.search(r"^lint = \[(.*)\]$", pyproject, re.M)
    assert extra, "pyproject.toml has no [lint] extra"
    lint = dict(re.findall(r'"([\w-]+)==([\w.]+)"', extra.group(1)))
    assert {"ruff", "mypy"} <= set(lint), "the [lint] extra must pin ruff and mypy"
    ci = {
        pkg.split("==")[0]: pkg.split("==")[1]
        for pkgs, _ in _pip_installs(CI.read_text())
        for pkg in pkgs
        if "==" in pkg
    }
    assert ci["ruff"] == lint["ruff"], "CI's ruff and the [lint] extra's differ"
    assert re.search(r"^\[tool\.ruff\.format\]$", pyproject, re.M), (
        "no [tool.ruff.format] for the ruff-format hook"
    )


def test_a_tool_of_the_interpreters_environment_is_found_without_it_on_path(tmp_path, monkeypatch):
    """pytest run as VENV/bin/python -m pytest, the virtualenv not activated: its tools are not on PATH, and
    are found beside the interpreter all the same."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    tool = venv_bin / "check-jsonschema"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path / "none"))
    assert shutil.which("check-jsonschema") is None  # what the test looked up before
    assert installed_tool("check-jsonschema") == str(tool)
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(venv_bin))
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    assert installed_tool("check-jsonschema") == str(tool)  # the scripts directory, first
