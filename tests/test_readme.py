"""The README is the front door and docs/ the rest of the house: both stay true to the code they describe.

- Every `distbench` command they show parses with the real parser (commands/parser.py), a launch's run flags
  too; every `pytest` command's options exist in pytest with this checkout's plugins, its markers are
  registered, and the test files and functions it names are defined.
- Every repository path they name exists, every test they name is defined, every relative link and heading
  anchor resolves.
- The README's line of versions is the one scripts/readme_versions.py writes from CI's lock (.ci/constraints.txt).
- The README stays short (its size, its paragraphs, its table cells), and its "bring your own model" example
  builds and maps input_ids to logits (run as written, end to end, in the slow tier).
- The site builds strictly (slow tier; CI's docs job builds it on every pull request and push to main).

Each checker is shown to fail on a planted defect.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import functools
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from extras import need

_spec = importlib.util.spec_from_file_location(
    "readme_versions", Path(__file__).parents[1] / "scripts" / "readme_versions.py"
)
assert _spec is not None and _spec.loader is not None
readme_versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_versions)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: The README's budget: the front door stays short, its prose in short paragraphs and short table cells.
README_MAX_BYTES = 10_000
PARAGRAPH_MAX_WORDS = 40
PARAGRAPH_MEDIAN_MAX_WORDS = 20
CELL_MAX_WORDS = 15

SHELLS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(
    r"^(?P<fence>```+|~~~+)[ \t]*(?P<lang>[^\s`]*)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S
)
INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
PATHLIKE = re.compile(r"^\.?[\w][\w.-]*(/[\w.*<>-]*)*(::[\w*\[\]:.-]+)?$")
TEST_NAME = re.compile(r"^(test_\w*\*?|test_\w+)(\[[^\]]*\])?$")


def pages() -> list[Path]:
    """The README and every page of the docs site."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]


def blocks(text: str) -> list[tuple[str, str, int]]:
    """Fenced code blocks: (language, body, line of the body's first line)."""
    return [(m["lang"], m["body"], text.count("\n", 0, m.start("body")) + 1) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """`text` with fenced blocks blanked, line count kept."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def inline_code(text: str) -> list[tuple[str, int]]:
    """Inline code spans outside fenced blocks, with their line."""
    body = prose(text)
    return [(m[2].strip(), body.count("\n", 0, m.start()) + 1) for m in INLINE.finditer(body)]


def shell_lines(text: str) -> list[tuple[str, int]]:
    """The logical lines of fenced shell blocks (backslash continuations joined, prompts dropped)."""
    out = []
    for lang, body, first in blocks(text):
        if lang not in SHELLS:
            continue
        joined, start = "", first
        for i, line in enumerate(body.splitlines(), first):
            if not joined:
                start = i
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            out.append((joined.strip().removeprefix("$ "), start))
            joined = ""
    return out


def segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line: words split on &&, ||, ; and |, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|", "&"):
            out.append([])
        else:
            out[-1].append(word)
    return [s for s in out if s]


def command(words: list[str]) -> list[tuple[str, list[str]]]:
    """The distbench or pytest invocations in one simple command: ("distbench" | "pytest", its arguments)."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # leading VAR=value
        words = words[1:]
    if not words:
        return []
    if "bash" in words and words[words.index("bash") + 1 : words.index("bash") + 2] == ["-c"]:
        inner = words[words.index("bash") + 2]
        return [found for seg in segments(inner) for found in command(seg)]
    if words[0] == "distbench":
        return [("distbench", words[1:])]
    if words[0] == "pytest":
        return [("pytest", words[1:])]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] in ("distbench.cli", "pytest"):
            return [("distbench" if words[i + 1] == "distbench.cli" else "pytest", words[i + 2 :])]
    return []


def commands(path: Path) -> list[tuple[str, list[str], str]]:
    """Every distbench and pytest command a page shows: (tool, arguments, where), from fenced shell blocks and
    from inline code that starts with `distbench ` or `pytest ` (where ends in "(inline)")."""
    text = path.read_text(encoding="utf-8")
    found = []
    for line, n in shell_lines(text):
        for seg in segments(line):
            found += [(tool, args, f"{_where(path)}:{n}") for tool, args in command(seg)]
    for span, n in inline_code(text):
        if span.startswith(("distbench ", "pytest ", "python -m distbench.cli ", "PYTHONPATH=")):
            for seg in segments(span):
                found += [(tool, args, f"{_where(path)}:{n} (inline)") for tool, args in command(seg)]
    return found


def _where(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


# --- distbench: the real parser --------------------------------------------------------------------------------


@functools.cache
def _distbench_parser() -> argparse.ArgumentParser:
    from distbench.commands import COMMANDS
    from distbench.commands.parser import build_parser

    return build_parser(COMMANDS)


def distbench_error(argv: list[str], inline: bool = False) -> str | None:
    """None if `distbench ARGV` parses (a launch's run flags too), else the parser's message. Inline, a command's
    name alone (`distbench compare`) names it: it must exist, its required arguments may be left out."""
    if inline and len(argv) == 1 and not argv[0].startswith("-"):
        sub = next(a for a in _distbench_parser()._actions if isinstance(a, argparse._SubParsersAction))
        return None if argv[0] in sub.choices else f"no command {argv[0]!r}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = _distbench_parser().parse_args(argv)
    except SystemExit as e:
        return None if e.code == 0 else (err.getvalue().strip() or f"exit status {e.code}")
    if getattr(ns, "command", None) == "launch":
        rest = list(ns.run_args)
        return distbench_error(["run", *(rest[1:] if rest[:1] == ["--"] else rest)])
    return None


# --- pytest: its own parser, with this checkout's conftest and plugins ------------------------------------------

_PYTEST_PARSE = """
import argparse, json, sys
import pytest
from _pytest.config import _prepareconfig

argparse.FileType.__call__ = lambda self, name: name  # name files, never open them (--benchmark-json)

argvs = json.load(sys.stdin)  # before pytest's capture replaces stdin
config = _prepareconfig(["--assert=plain", "-p", "no:cacheprovider"])
out = []
for argv in argvs:
    try:
        ns = config._parser.parse(argv)
        out.append({"positional": [str(p) for p in getattr(ns, "file_or_dir", None) or []],
                    "markexpr": getattr(ns, "markexpr", "")})
    except pytest.UsageError as e:
        out.append({"error": str(e)})
print(json.dumps(out))
"""


def pytest_parse(argvs: list[list[str]]) -> list[dict]:
    """Each argument list parsed by pytest's own parser, built once (in a child process, so this session's
    plugins and import hooks stay as they are) with this checkout's conftest and every installed plugin. The
    pages' commands and the bite test's are parsed together, once."""
    known = _pages_parsed()
    missing = [a for a in argvs if json.dumps(a) not in known]
    parsed = {**known, **(_run_pytest_parse(missing) if missing else {})}
    return [parsed[json.dumps(a)] for a in argvs]


#: What the bite test parses.
_BITE = [["-m", "gpu", "--world-sizes", "1,2", "tests/test_loss_parity.py"], ["--no-such-option"]]


def pytest_commands() -> list[tuple[list[str], str]]:
    return [(args, where) for page in pages() for tool, args, where in commands(page) if tool == "pytest"]


@functools.cache
def _pages_parsed() -> dict[str, dict]:
    return _run_pytest_parse([args for args, _ in pytest_commands()] + _BITE)


def _run_pytest_parse(argvs: list[list[str]]) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _PYTEST_PARSE],
        input=json.dumps(argvs),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(zip(map(json.dumps, argvs), json.loads(proc.stdout.splitlines()[-1]), strict=True))


@functools.cache
def markers() -> frozenset[str]:
    """Every marker registered: pyproject.toml's and the plugin's."""
    from distbench.testsuite.plugin import MARKERS

    ini = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    listed = re.findall(r'"(\w+)', ini.group(1)) if ini else []
    return frozenset(listed) | {re.match(r"\w+", m).group(0) for m in MARKERS}  # type: ignore[union-attr]


def markexpr_error(expr: str) -> str | None:
    unknown = set(re.findall(r"\w+", expr)) - {"and", "or", "not"} - markers()
    return f"-m {expr!r}: no marker {sorted(unknown)}" if unknown else None


# --- what exists in the repository ---------------------------------------------------------------------------


@functools.cache
def top_level() -> frozenset[str]:
    """The repository's top-level names (tracked ones, where git can tell)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = {line.split("/")[0] for line in out.stdout.splitlines()} if out.returncode == 0 else set()
    return frozenset(names or {p.name for p in ROOT.iterdir()})


@functools.cache
def subpackages() -> frozenset[str]:
    return frozenset(
        p.name for p in (ROOT / "src" / "distbench").iterdir() if p.is_dir() and p.name[0] != "_"
    )


@functools.cache
def definitions(path: Path) -> frozenset[str]:
    """Module-level functions and classes of a Python file, and `Class::method` for methods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            out |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return frozenset(out)


@functools.cache
def defined_tests() -> frozenset[str]:
    return frozenset(n.split("::")[-1] for p in (ROOT / "tests").glob("*.py") for n in definitions(p))


def _defined(names: frozenset[str], name: str) -> bool:
    name = re.sub(r"\[.*\]$", "", name)
    return any(fnmatch.fnmatchcase(n, name) for n in names) if "*" in name else name in names


def node_error(node: str) -> str | None:
    """None if a pytest node id's file exists and defines what the node names (`file::func[params]`)."""
    path, _, name = node.partition("::")
    file = ROOT / path
    if not file.exists():
        return f"{path} does not exist"
    if name and not _defined(definitions(file), name):
        return f"{path} defines no {re.sub(r'[[].*', '', name)}"
    return None


def path_error(text: str, base: Path = ROOT) -> str | None:
    """None if `text` does not look like a repository path, or names one that exists: a top-level name of the
    repository, or a subpackage of src/distbench (`runtime/shelf.py`); globs must match, `file::test` must be
    defined there."""
    if not PATHLIKE.match(text) or "/" not in text and "::" not in text:
        return None
    path, _, name = text.partition("::")
    head = path.split("/")[0]
    if head in top_level():
        root = ROOT
    elif head in subpackages():
        root = ROOT / "src" / "distbench"
    else:
        return None
    if "*" in path:
        return None if list(root.glob(path.rstrip("/"))) else f"{text}: nothing matches"
    if not (root / path).exists() and not ignored(root / path):
        return f"{text} does not exist"
    if name:
        return node_error(str((root / path).relative_to(ROOT)) + "::" + name)
    return None


def ignored(path: Path) -> bool:
    """A path git ignores is one a command writes (`docs/_build/html`), not one a page cites."""
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


def slug(heading: str) -> str:
    """A heading's anchor as MyST (myst_heading_anchors) and GitHub make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m[2]) for m in HEADING.finditer(prose(path.read_text(encoding="utf-8")))}


def link_error(target: str, page: Path) -> str | None:
    """None if a relative link from `page` resolves: its file exists, and a heading has its anchor."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
        return f"{target}: {_where(dest)} does not exist"
    if page.resolve().is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
        return f"{target}: the site holds docs/ alone, so a link out of it breaks its build; cite the path in backticks"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading #{anchor} in {_where(dest)}"
    return None


def page_errors(path: Path) -> list[str]:
    """Every path, test name and link of a page that does not resolve."""
    text = path.read_text(encoding="utf-8")
    where = _where(path)
    errors = []
    for span, n in inline_code(text):
        if TEST_NAME.match(span) and not _defined(defined_tests(), span):
            errors.append(f"{where}:{n}: no test {span} in tests/")
        elif error := path_error(span):
            errors.append(f"{where}:{n}: {error}")
    for line, n in shell_lines(text):
        for word in (w for seg in segments(line) for w in seg):
            if error := path_error(word):
                errors.append(f"{where}:{n}: {error}")
    body = prose(text)
    for m in LINK.finditer(body):
        if error := link_error(m[1], path):
            errors.append(f"{where}:{body.count(chr(10), 0, m.start()) + 1}: {error}")
    return errors


# --- the README's budget -------------------------------------------------------------------------------------


def readme_budget(text: str) -> list[str]:
    """What in `text` is over the README's budget: its size, a paragraph (or list item), a table cell."""
    over = []
    if len(text.encode()) > README_MAX_BYTES:
        over.append(f"{len(text.encode())} bytes, over {README_MAX_BYTES}")
    paragraphs, cells = [], []
    for chunk in re.split(r"\n\s*\n", prose(text)):
        lines = [line for line in chunk.splitlines() if line.strip()]
        if not lines or lines[0].startswith("#"):
            continue
        if lines[0].lstrip().startswith("|"):
            cells += [c for line in lines for c in line.strip().strip("|").split("|")]
            continue
        items = re.split(r"\n(?=\s*(?:[-*+]|\d+\.)\s)", "\n".join(lines))
        paragraphs += [len(INLINE.sub("code", item).split()) for item in items]
    if paragraphs and max(paragraphs) > PARAGRAPH_MAX_WORDS:
        over.append(f"a paragraph of {max(paragraphs)} words, over {PARAGRAPH_MAX_WORDS}")
    if paragraphs and statistics.median(paragraphs) > PARAGRAPH_MEDIAN_MAX_WORDS:
        over.append(
            f"median paragraph {statistics.median(paragraphs)} words, over {PARAGRAPH_MEDIAN_MAX_WORDS}"
        )
    longest = max((len(c.split()) for c in cells), default=0)
    if longest > CELL_MAX_WORDS:
        over.append(f"a table cell of {longest} words, over {CELL_MAX_WORDS}")
    return over


def section(text: str, title: str) -> str:
    """The body of the `## title` section of a markdown text."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '## {title}'"
    return m.group(1)


# --- the tests -----------------------------------------------------------------------------------------------


def test_the_readme_names_the_versions_cis_lock_pins():
    """The README's line of versions (between its markers) is the one scripts/readme_versions.py writes from
    .ci/constraints.txt: a lock refreshed without it, or a version typed in by hand, fails here."""
    text = README.read_text(encoding="utf-8")
    lock = readme_versions.LOCK.read_text(encoding="utf-8")
    assert (
        readme_versions.with_line(text, readme_versions.versions_line(readme_versions.pins(lock))) == text
    ), "README.md's versions disagree with .ci/constraints.txt: run python scripts/readme_versions.py"
    assert readme_versions.main(["--check"]) == 0


def test_the_versions_check_catches_a_lock_the_readme_does_not_match():
    text = README.read_text(encoding="utf-8")
    lock = readme_versions.LOCK.read_text(encoding="utf-8")
    newer = re.sub(r"^pytest==\S+", "pytest==99.0", lock, flags=re.M)
    line = readme_versions.versions_line(readme_versions.pins(newer))
    assert "pytest 99.0" in line and readme_versions.with_line(text, line) != text
    with pytest.raises(ValueError, match="pins no hypothesis"):
        readme_versions.pins(re.sub(r"^hypothesis==.*$", "", lock, flags=re.M))
    with pytest.raises(ValueError, match="several versions"):
        readme_versions.pins(lock + "torch==2.99.0 ; python_full_version == '3.11.*'\n")
    other_python = lock + "torch==2.99.0 ; python_full_version < '3.11'\n"  # not CI's: the line names CI's
    assert readme_versions.pins(other_python) == readme_versions.pins(lock)
    with pytest.raises(ValueError, match="markers"):
        readme_versions.with_line(text.replace(readme_versions.END, ""), line)


def test_the_readme_is_within_its_budget():
    assert readme_budget(README.read_text(encoding="utf-8")) == []


def test_every_distbench_command_parses_with_the_real_parser():
    found = [(args, where) for page in pages() for tool, args, where in commands(page) if tool == "distbench"]
    assert len(found) > 20, "the command extraction found too few commands to be working"
    errors = [
        f"{where}: distbench {shlex.join(args)}: {err}"
        for args, where in found
        if (err := distbench_error(args, inline=where.endswith("(inline)")))
    ]
    assert errors == []


def test_every_pytest_command_has_real_options_markers_and_tests():
    found = pytest_commands()
    assert len(found) > 5, "the command extraction found too few commands to be working"
    errors = []
    for (args, where), parsed in zip(found, pytest_parse([args for args, _ in found]), strict=True):
        what = f"{where}: pytest {shlex.join(args)}"
        if "error" in parsed:
            errors.append(f"{what}: {parsed['error']}")
            continue
        errors += [f"{what}: {e}" for e in [markexpr_error(parsed["markexpr"])] if e]
        errors += [f"{what}: {e}" for node in parsed["positional"] if (e := node_error(node))]
    assert errors == []


def test_every_path_test_and_link_they_name_exists():
    assert [e for page in pages() for e in page_errors(page)] == []


def test_the_readme_model_example_builds_and_maps_input_ids_to_logits(tmp_path, monkeypatch):
    """The README's example, as written: the file it shows under the name its comment gives, and the factory the
    commands name. The commands themselves run end to end in the slow tier."""
    import torch

    from distbench.strategies.base import model_logits
    from distbench.workloads.global_rng import preserved
    from distbench.workloads.models import get_model

    body = section(README.read_text(encoding="utf-8"), "Bring your own model")
    (source,) = [b for lang, b, _ in blocks(body) if lang == "python"]
    assert len(source.strip().splitlines()) <= 10, "the example is meant to fit in 10 lines"
    name = re.match(r"# (\w+)\.py", source)
    assert name, "the example's first line names its file: # mymodel.py"
    (tmp_path / f"{name[1]}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    refs = {a for lang, b, _ in blocks(body) if lang == "bash" for a in re.findall(r"--models? (\S+)", b)}
    assert refs and all(r.split(":")[0] == name[1] for r in refs), refs
    try:
        for ref in refs:
            spec = get_model(ref)
            with preserved():
                model = spec.build(0, "cpu")
            logits = model_logits(model, torch.randint(0, spec.vocab_size, (2, 8)))  # as the trainers call it
            assert logits.shape == (2, 8, spec.vocab_size)
    finally:
        sys.modules.pop(name[1], None)


# --- each checker bites --------------------------------------------------------------------------------------


def test_the_command_checks_catch_a_bogus_command(tmp_path):
    assert distbench_error(["run", "--strategy", "ddp", "--world-size", "1,2"]) is None
    assert "unrecognized arguments: --no-such-flag" in (distbench_error(["run", "--no-such-flag"]) or "")
    assert "zero3" in (distbench_error(["run", "-s", "ZeRO4"]) or "")  # did you mean
    assert distbench_error(["launch", "--parity", "--", "-s", "ddp", "-n", "1,8"]) is None
    assert "--bogus" in (distbench_error(["launch", "--", "--bogus"]) or "")  # a launch's run flags count
    assert distbench_error(["frobnicate"]) and distbench_error(["frobnicate"], inline=True)
    assert distbench_error(["compare"]) and distbench_error(["compare"], inline=True) is None
    page = "```bash\nPYTHONPATH=. distbench run --model m:f && pytest -m gpu tests/test_x.py # note\n```\n`distbench ab --x`"
    (tmp_path / "page.md").write_text(page)
    found = [(tool, args) for tool, args, _ in commands(tmp_path / "page.md")]
    assert [(tool, args) for tool, args in found] == [
        ("distbench", ["run", "--model", "m:f"]),
        ("pytest", ["-m", "gpu", "tests/test_x.py"]),
        ("distbench", ["ab", "--x"]),
    ]
    assert command(
        shlex.split("srun bash -c 'torchrun --nnodes 2 -m distbench.cli launch -- -n 1 | tee x'")
    ) == [("distbench", ["launch", "--", "-n", "1"])]


def test_the_pytest_checks_catch_a_bogus_option_marker_and_node():
    ok, bogus = pytest_parse(
        [["-m", "gpu", "--world-sizes", "1,2", "tests/test_loss_parity.py"], ["--no-such-option"]]
    )
    assert ok["positional"] == ["tests/test_loss_parity.py"] and ok["markexpr"] == "gpu"
    assert "--no-such-option" in bogus["error"]
    assert markexpr_error("not gpu and not slow") is None and "gpux" in (markexpr_error("gpux") or "")
    assert node_error("tests/test_loss_parity.py::test_loss_parity[zero3-ws2]") is None
    assert "defines no test_no_such_test" in (
        node_error("tests/test_loss_parity.py::test_no_such_test") or ""
    )
    assert "does not exist" in (node_error("tests/test_nowhere.py") or "")


def test_the_path_checks_catch_a_missing_path_test_and_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n")
    page.write_text(
        "See `src/distbench/metrics.py`, `runtime/shelf.py`, `tests/test_gate.py::test_interleaved_*` and "
        "`test_rerun_is_bitwise_identical`.\n"
        "Missing: `src/distbench/nowhere.py`, `runtime/nowhere.py`, `test_no_such_test`, "
        "`tests/test_gate.py::test_nothing_like_this`.\n\n"
        "```bash\ndistbench run --config configs/nowhere.yaml -o docs/_build/out\n```\n\n"
        "[ok](other.md#a-heading) [gone](nowhere.md) [no anchor](other.md#no-such-heading)\n"
    )
    errors = page_errors(page)
    assert len(errors) == 7, errors
    in_docs = DOCS / "planted-page-that-links-out.md"
    assert link_error("../README.md", in_docs) and "backticks" in str(link_error("../README.md", in_docs))
    assert link_error("index.md", in_docs) is None
    for missing in ("nowhere.py", "runtime/nowhere.py", "test_no_such_test", "test_nothing_like_this"):
        assert any(missing in e for e in errors), (missing, errors)
    assert any("configs/nowhere.yaml" in e for e in errors)
    assert any("nowhere.md does not exist" in e for e in errors) and any(
        "#no-such-heading" in e for e in errors
    )
    assert slug("`bisect.yml`: on demand") == "bisectyml-on-demand"


def test_the_budget_catches_an_oversized_readme():
    text = README.read_text(encoding="utf-8")
    assert readme_budget(text + "x" * README_MAX_BYTES)[0].endswith(f"over {README_MAX_BYTES}")
    long_paragraph = " ".join(["word"] * (PARAGRAPH_MAX_WORDS + 1))
    assert any("a paragraph of" in o for o in readme_budget(f"# t\n\n{long_paragraph}\n"))
    assert any("median paragraph" in o for o in readme_budget("\n\n".join([" ".join(["w"] * 30)] * 3)))
    long_cell = " ".join(["word"] * (CELL_MAX_WORDS + 1))
    assert any("table cell" in o for o in readme_budget(f"| a | b |\n|---|---|\n| {long_cell} | x |\n"))
    assert readme_budget("# t\n\n```text\n" + long_paragraph + "\n```\n") == []  # code is not prose


# --- slow: the site built strictly, the README's example run end to end -----------------------------------------


def _sphinx(src: Path, out: Path) -> subprocess.CompletedProcess:
    need("sphinx")
    need("myst_parser")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(src), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    proc = _sphinx(DOCS, tmp_path / "html")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli = (tmp_path / "html" / "reference" / "cli.html").read_text(encoding="utf-8")
    from distbench.commands import COMMANDS

    for module in COMMANDS:  # the generated reference has every subcommand
        assert f'id="distbench-{module.__name__.rsplit(".", 1)[-1]}"' in cli


@pytest.mark.slow
def test_the_strict_build_fails_on_a_broken_link_an_orphan_and_a_bad_reference(tmp_path):
    """The site's own configuration over a planted page: each defect is a warning, and warnings fail."""
    src = tmp_path / "docs"
    shutil.copytree(DOCS / "_ext", src / "_ext")
    shutil.copy(DOCS / "conf.py", src / "conf.py")
    (src / "index.md").write_text(
        "# T\n\n[gone](nowhere.md), [no anchor](index.md#no-such-heading), {doc}`missing`\n\n"
        "```{toctree}\nreference\n```\n"
    )
    (src / "reference.md").write_text("# R\n\n```{distbench-metrics}\n```\n")
    (src / "orphan.md").write_text("# Orphan\n")
    proc = _sphinx(src, tmp_path / "html")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for warning in ("nowhere.md", "no-such-heading", "missing", "orphan"):
        assert warning in out, (warning, out)


# About 40 s on 2 cores (a whole `distbench run` and a pytest session): nightly. Per submission, the CPU tier
# parses the example's commands with the real parsers (test_every_distbench_command_parses_with_the_real_parser,
# test_every_pytest_command_has_real_options_markers_and_tests), and test_cli.py trains a user's own model file
# at parity through the same loading.
@pytest.mark.slow
@pytest.mark.nightly
def test_the_readme_model_example_runs_as_written(tmp_path):
    """The README's model file in a folder of its own, and its two commands run there as written (`.` on
    PYTHONPATH is that folder; `distbench` and `pytest` are this checkout's), on CPU."""
    body = section(README.read_text(encoding="utf-8"), "Bring your own model")
    (source,) = [b for lang, b, _ in blocks(body) if lang == "python"]
    (tmp_path / "mymodel.py").write_text(source)
    lines = [line for line, _ in shell_lines(body)]
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        assert words[0] == "PYTHONPATH=.", line
        tool, args = words[1], words[2:]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
        if tool == "distbench":  # in the model's folder, where its results land
            argv, cwd = [sys.executable, "-m", "distbench.cli", *args], tmp_path
        else:  # from the checkout, whose tests it names
            argv, cwd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], ROOT
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = list((tmp_path / "distbench-results").glob("*.json"))
    assert results and all(json.loads(p.read_text())["status"] == "ok" for p in results)
