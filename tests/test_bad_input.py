"""Bad input, from every door (flags, a matrix YAML, a ds_config, a model factory, pytest options), is refused
before any rank starts: exit 2 (pytest: its usage-error status), one line that names the fix, no traceback."""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys
from pathlib import Path

import pytest

from distbench.cli import main

pytest_plugins = ["pytester"]

SRC = Path(__file__).resolve().parents[1] / "src"

#: (id, `distbench run` arguments, words the one line must hold). {tmp} is the test's directory, where the
#: files below are written; {tmp}/out is the output directory, which must not appear.
CLI = [
    ("ws-word", ["-n", "two"], "world size 'two' is invalid: input should be a valid integer"),
    ("ws-zero", ["-n", "0"], "greater than or equal to 1"),
    ("ws-blank", ["-n", "1,,2"], "has an empty entry"),
    ("strategy-empty", ["-s", ""], "has an empty entry"),
    ("strategy-case", ["-s", "ZeRO3"], "Did you mean zero3?"),
    ("strategy-typo", ["-s", "zero_3"], "Did you mean zero3"),
    ("strategy-unknown", ["-s", "nope"], "unknown strategy 'nope'"),
    ("model-unknown", ["-m", "gpt5"], "unknown model 'gpt5'"),
    ("model-case", ["-m", "GPT2-Tiny"], "Did you mean gpt2-tiny?"),
    ("model-no-module", ["-m", ":fn"], "must read package.module:function"),
    ("model-markup", ["-m", "user_models:[red]x"], "'user_models:[red]x' must read"),  # printed, not markup
    ("repeats-zero", ["--repeats", "0"], "--repeats: value '0' is invalid"),
    ("windows-zero", ["--windows", "0"], "--windows: value '0' is invalid"),
    ("windows-over-steps", ["--steps", "2", "--windows", "3"], "windows must be at most steps (2), got 3"),
    ("clip-negative", ["--clip-grad-norm", "-1"], "--clip-grad-norm: value '-1' is invalid"),
    ("dropout-one", ["--dropout", "1"], "--dropout: value '1' is invalid: input should be less than 1"),
    ("lora-rank-negative", ["--lora-rank", "-1"], "--lora-rank: value '-1' is invalid"),
    ("lora-alpha-fraction", ["--lora-alpha", "0.5"], "--lora-alpha: value '0.5' is invalid"),
    ("lora-targets-blank", ["--lora-targets", "c_attn,"], "LoRA target 'c_attn,' has an empty entry"),
    ("lora-targets-without-rank", ["--lora-targets", "c_attn"], "given without lora_rank; set lora_rank"),
    (
        "lora-target-typo",
        ["-m", "llama-tiny", "--lora-rank", "4", "--lora-targets", "q_proj,v_prj"],
        "has no module 'v_prj' for LoRA to adapt. Did you mean v_proj",
    ),
    (
        "lora-target-not-linear",
        ["--lora-rank", "4", "--lora-targets", "ln_1"],
        "LoRA targets ['ln_1'] do not fit",
    ),
    ("repeats-negative", ["--repeats", "-1"], "greater than or equal to 1"),
    ("steps-zero", ["--steps", "0"], "--steps: value '0'"),
    ("steps-fraction", ["--steps", "2.5"], "--steps: value '2.5'"),
    ("warmup-negative", ["--warmup", "-1"], "greater than or equal to 0"),
    (
        "timeout-negative",
        ["--timeout", "-5"],
        "--timeout: value '-5' is invalid: input should be greater than 0",
    ),
    ("timeout-nan", ["--timeout", "nan"], "--timeout: value 'nan'"),
    ("global-batch-zero", ["--global-batch", "0"], "--global-batch"),
    ("micro-batch-negative", ["--micro-batch", "-2"], "--micro-batch"),
    ("seq-len-zero", ["--seq-len", "0"], "--seq-len"),
    ("precision", ["--precision", "fp8"], "choose from 'fp32', 'bf16', 'fp16', 'bf16-amp'"),
    ("optimizer", ["--optimizer", "adam"], "choose from 'auto', 'fused', 'foreach', 'forloop'"),
    ("output-is-a-file", ["-o", "{tmp}/results.json"], "exists and is not a directory"),
    ("unknown-flag", ["--stepz", "3"], "unrecognized arguments: --stepz"),
    # refused after parsing, still before any rank
    (
        "seq-len-beyond-positions",
        ["-m", "gpt2-tiny", "--seq-len", "4096"],
        "exceeds model gpt2-tiny's 64 positions",
    ),
    ("batch-indivisible", ["-s", "ddp", "-n", "3", "--global-batch", "8"], "use a global batch of 6 or 12"),
    ("no-gpu", ["--device", "cuda"], "no CUDA device is visible; use --device cpu"),
    ("config-missing", ["--config", "{tmp}/nope.yaml"], "cannot read matrix file"),
    (
        "ds-config-not-zero",
        ["-s", "ddp", "--ds-config", "{tmp}/ds_ok.json"],
        "option 'ds_config' applies to zero0, zero1, zero2, zero3, zero3_offload only",
    ),
    ("ds-config-missing", ["-s", "zero2", "-n", "1", "--ds-config", "{tmp}/nope.json"], "does not exist"),
    (
        "ds-gradient-clipping",
        ["-s", "zero2", "-n", "1", "--ds-config", "{tmp}/ds_clip.json"],
        "key 'gradient_clipping' = 'x' is invalid: input should be a valid number",
    ),
    (
        "ds-typo",
        ["-s", "zero2", "-n", "1", "--ds-config", "{tmp}/ds_typo.json"],
        "did you mean 'zero_optimization'?",
    ),
    (
        "ds-conflict",
        ["-s", "zero2", "-n", "1", "--ds-config", "{tmp}/ds_stage.json"],
        "pick zero0, zero1, zero2 or zero3 instead",
    ),
    ("ds-malformed", ["-s", "zero2", "-n", "1", "--ds-config", "{tmp}/ds_bad.json"], "is not valid JSON"),
]

FILES = {
    "results.json": "{}",
    "ds_ok.json": "{}",
    "ds_clip.json": '{"gradient_clipping": "x"}',
    "ds_typo.json": '{"zero_optimisation": {}}',
    "ds_stage.json": '{"zero_optimization": {"stage": 1}}',
    "ds_bad.json": '{"train_batch_size": 16,}',
}

YAML = [
    ("steps-fraction", "steps: 2.5", "steps = 2.5 is invalid: input should be a valid integer"),
    ("steps-string", 'steps: "5"', "steps = '5' is invalid"),
    ("ws-word", "world_sizes: [two]", "world_sizes[0] = ['two'] is invalid"),
    ("ws-empty", "world_sizes: []", "world_sizes = [] is invalid: list should have at least 1 item"),
    ("repeats-zero", "repeats: 0", "repeats = 0 is invalid: input should be greater than or equal to 1"),
    ("key-typo", "stepz: 3", "unknown config key 'stepz'. Did you mean steps?"),
    ("precision", "precisions: [fp8]", "input should be 'fp32', 'bf16', 'fp16' or 'bf16-amp'"),
    ("lr-negative", "lr: -0.1", "lr = -0.1 is invalid"),
    ("betas", "betas: [0.9, 1.5]", "betas[1]"),
    ("lora-targets-string", "lora_targets: c_attn", "lora_targets = 'c_attn' is invalid"),
    (
        "option-not-taken",
        "options: {reshard_after_forward: false}",
        "option 'reshard_after_forward' applies to no",
    ),
    ("axis-twice", "strategy: ddp", "has both 'strategies' and 'strategy'; keep one"),
    ("not-a-mapping", "- ddp", "must hold a mapping"),
    ("syntax", "steps: [1", "cannot read matrix file"),
]

FACTORIES = [
    (
        "raises-at-import",
        "raise RuntimeError('no GPU here')\n",
        "raised RuntimeError: no GPU here; fix the module",
    ),
    ("no-function", "x = 1\n", "has no attribute 'make'"),
    ("exits", "import sys\ndef make():\n    sys.exit(3)\n", "raised SystemExit: 3; fix the factory"),
    ("factory-raises", "def make():\n    raise ValueError('bad width')\n", "raised ValueError: bad width"),
    (
        "no-vocab",
        "import torch\ndef make():\n    return torch.nn.Linear(2, 2)\n",
        "must expose config.vocab_size",
    ),
]

PYTEST = [
    ("world-sizes-word", ["--world-sizes", "abc"], "--world-sizes 'abc' is invalid"),
    ("world-sizes-zero", ["--world-sizes", "0"], "--world-sizes '0' is invalid"),
    ("job-timeout-negative", ["--job-timeout", "-1"], "--job-timeout '-1' is invalid"),
    ("steps-zero", ["--steps", "0"], "--steps '0' is invalid"),
    ("strategy-case", ["--strategies", "ZeRO3"], "Did you mean zero3?"),
    ("strategy-unknown", ["--strategies", "zero4"], "unknown strategy 'zero4'"),
    ("models-unknown", ["--models", "gpt5"], "unknown model 'gpt5'"),
]


@pytest.fixture
def refused(tmp_path, monkeypatch, capsys):
    """Run `distbench run ARGS` in-process with rank starts forbidden; assert the refusal's shape; return its line."""
    started: list[str] = []

    def no_rank(self):
        started.append(self.name)
        raise AssertionError("a rank was started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_rank)
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)

    def run(argv: list[str]) -> str:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
        try:
            code = main(["run", *argv, "-o", str(tmp_path / "out")] if "-o" not in argv else ["run", *argv])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2, f"exit {code}, not 2\n{out}{err}"
        assert not started, f"ranks started: {started}"
        assert "Traceback" not in out + err, out + err  # stdout may hold DeepSpeed's import-time log line
        lines = err.splitlines()
        assert len(lines) == 1, f"not one line:\n{err}"
        assert not (tmp_path / "out").exists(), "a refused run created its output directory"
        return lines[0]

    return run


@pytest.mark.parametrize("argv,needle", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_bad_flags(refused, argv, needle):
    assert needle in refused(argv)


@pytest.mark.parametrize("line,needle", [c[1:] for c in YAML], ids=[c[0] for c in YAML])
def test_bad_matrix_yaml(refused, tmp_path, line, needle):
    path = tmp_path / "matrix.yaml"
    path.write_text(_matrix(line))
    got = refused(["--config", str(path)])
    assert needle in got and str(path) in got


def _matrix(line: str) -> str:
    """A valid matrix with `line` added, or replacing the key it sets."""
    if line.startswith("- "):
        return line + "\n"
    keep = {
        "strategies": "strategies: [ddp]",
        "world_sizes": "world_sizes: [1]",
        "models": "models: [gpt2-tiny]",
    }
    key = line.split(":")[0]
    keep.pop(key, None)
    return "\n".join([*keep.values(), line]) + "\n"


@pytest.mark.parametrize("source,needle", [c[1:] for c in FACTORIES], ids=[c[0] for c in FACTORIES])
def test_bad_model_factory(refused, tmp_path, monkeypatch, request, source, needle):
    module = f"factory_{request.node.callspec.id.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert needle in refused(["-s", "ddp", "-n", "1", "-m", f"{module}:make"])


@pytest.mark.parametrize("args,needle", [c[1:] for c in PYTEST], ids=[c[0] for c in PYTEST])
def test_bad_pytest_options(pytester, args, needle):
    pytester.makepyfile(test_x="def test_x(strategy, world_size):\n    pass\n")
    result = pytester.runpytest("-p", "distbench.testsuite.plugin", "--collect-only", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = [ln for ln in result.stderr.lines if ln.strip()]
    assert len(err) == 1 and err[0].startswith("ERROR: ") and needle in err[0], result.stderr.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_there_are_at_least_40_bad_inputs():
    assert len(CLI) + len(YAML) + len(FACTORIES) + len(PYTEST) >= 40


@pytest.mark.parametrize("argv", [["run", "-n", "two"], ["run", "-s", "ZeRO3"], ["run", "--repeats", "0"]])
def test_usage_errors_come_before_heavy_imports(argv):
    """A typo costs the parser, not torch's import (~2-5 s on a busy 2-core machine)."""
    code = (
        "import sys\nfrom distbench.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    assert e.code == 2\nheavy = sorted({'torch', 'deepspeed', 'rich', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
