"""The docs' generated pages: each reference is written from the code it describes, at build time, so it cannot
drift from it.

Directives (each takes no arguments and renders MyST markdown in place):

- `distbench-cli`: every `distbench` subcommand, its usage and options, from the real argparse parser
  (src/distbench/commands/parser.py over distbench.commands.COMMANDS);
- `distbench-pytest-options`: the pytest options, ini keys and markers the plugin adds
  (src/distbench/testsuite/plugin.py, pyproject.toml);
- `distbench-config`: RunConfig's fields, types, bounds, defaults and comments (src/distbench/config.py), and
  the keys a matrix YAML adds;
- `distbench-metrics`: the metric glossary, from the registry in src/distbench/metrics.py;
- `distbench-strategies`: the strategy registry (src/distbench/strategies/__init__.py);
- `distbench-layers`: the import layers as tests/test_layers.py holds them, with the imports that cross them.

and `distbench-toctree`, the site's table of contents: the pages its content names, in that order, then every
other page under docs/ (pages added later, in any branch), so that no page is left out of the site.

The functions that write the markdown need no Sphinx; `setup` registers them as directives.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import io
import sys
import tokenize
import typing
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def cell(text: object) -> str:
    """Text safe inside a markdown table cell on one line."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "\\<").replace(">", "\\>")


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows),
        "",
    ]


def code(text: str) -> str:
    """`text` as inline code (backticks inside become a longer fence)."""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}" if fence == "`" else f"{fence} {text} {fence}"


# --- distbench-cli -------------------------------------------------------------------------------------------


def _option(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    if not action.option_strings:
        return code(formatter._format_args(action, action.dest.upper()) or action.dest)
    takes = action.nargs != 0
    arg = formatter._format_args(action, action.dest.upper()) if takes and not action.choices else ""
    return ", ".join(code(f"{s} {arg}".strip()) for s in action.option_strings)


def _meaning(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.choices and action.option_strings:
        text += f" (one of: {', '.join(map(str, action.choices))})"
    default = action.default
    if (
        action.option_strings
        and default not in (None, False, [], argparse.SUPPRESS)
        and "default" not in text
    ):
        text += f" (default: {default})"
    return text


def cli_reference() -> list[str]:
    from distbench.commands import COMMANDS
    from distbench.commands.parser import build_parser

    parser = build_parser(COMMANDS)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out: list[str] = []
    for name, p in sub.choices.items():
        out += [f"## distbench {name}", "", helps.get(name) or "", ""]
        if p.description:
            out += [p.description, ""]
        out += ["```text", p.format_usage().strip(), "```", ""]
        rows = [
            [_option(a, p), _meaning(a, p)]
            for a in p._actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        ]
        out += table(["option", "what it does"], rows)
    return out


# --- distbench-pytest-options --------------------------------------------------------------------------------


def _pyproject() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pytest depends on tomli before 3.11
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def pytest_reference() -> list[str]:
    from _pytest.config.argparsing import Parser

    from distbench.testsuite import plugin

    parser = Parser(_ispytest=True)
    plugin.pytest_addoption(parser)
    rows = []
    for opt in parser.getgroup("distbench").options:
        attrs = opt.attrs()
        if attrs.get("help") == argparse.SUPPRESS:
            continue
        help_text = str(attrs.get("help", "")).replace("%%", "%")
        default = attrs.get("default")
        if default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        rows.append([", ".join(code(f"{n} VALUE") for n in opt.names()), help_text])
    out = ["## Options", "", *table(["option", "what it does"], rows)]
    ini = [
        [code(name), help_text, code(repr(default))]
        for name, (help_text, _, default) in parser._inidict.items()
    ]
    ini_opts = _pyproject()["tool"]["pytest"]["ini_options"]
    out += ["## Ini keys", "", *table(["key", "what it holds", "default"], ini)]
    out += ["Set in `pyproject.toml` (`[tool.pytest.ini_options]`):", ""]
    out += [f"- `{k}`: {code(str(v))}" for k, v in ini_opts.items() if k not in ("markers", "filterwarnings")]
    markers: dict[str, str] = {}
    for line in [*ini_opts.get("markers", []), *plugin.MARKERS]:
        head, _, text = line.partition(":")
        markers.setdefault(head.strip(), text.strip())
    out += ["", "## Markers", "", *table(["marker", "meaning"], [[code(k), v] for k, v in markers.items()])]
    return out


# --- distbench-config ----------------------------------------------------------------------------------------


def _bounds(meta: list[Any]) -> list[str]:
    words = []
    for m in meta:
        for inner in getattr(m, "metadata", [m]):
            for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                if getattr(inner, attr, None) is not None:
                    words.append(f"{sign} {getattr(inner, attr)}")
            if getattr(inner, "min_length", None):
                words.append("not empty")
    return words


def type_text(t: Any) -> str:
    """A field's annotation as a reader wants it: `int ≥ 1`, `"fp32" | "bf16"`, `tuple of float ≥ 0, < 1`."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        base, *meta = args
        return " ".join([type_text(base), ", ".join(_bounds(meta))]).strip()
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin is tuple:
        items = [type_text(a) for a in args if a is not Ellipsis]
        return f"tuple of {items[0]}" if len(set(items)) == 1 else f"({', '.join(items)})"
    if origin is dict:
        return "mapping"
    return getattr(t, "__name__", str(t))


def _comments(path: Path, cls: str) -> dict[str, str]:
    """Field name -> the comment on its lines, or the comment lines right above it, in `cls` of `path`."""
    source = path.read_text(encoding="utf-8")
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#:").strip()
    lines = source.splitlines()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            inline = [
                by_line[i] for i in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if i in by_line
            ]
            above, i = [], stmt.lineno - 1
            while i in by_line and lines[i - 1].lstrip().startswith("#"):
                above.insert(0, by_line[i])
                i -= 1
            out[stmt.target.id] = " ".join(above + inline)
    return out


def module_constant(path: Path, name: str) -> Any:
    """A literal assigned at the top of a module, read without importing it (distbench.matrix imports torch)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} assigns no {name}")


def config_reference() -> list[str]:
    from distbench.commands import run as run_command
    from distbench.config import RunConfig

    flags = {}
    sub = argparse.ArgumentParser().add_subparsers()
    run_command.add_parser(sub)
    for action in sub.choices["run"]._actions:
        if action.option_strings:
            flags[action.dest] = action.option_strings[0]
    hints = typing.get_type_hints(RunConfig, include_extras=True)
    comments = _comments(SRC / "distbench" / "config.py", "RunConfig")
    rows = []
    for f in dataclasses.fields(RunConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flag = code(flags[f.name]) if f.name in flags else ""
        rows.append(
            [code(f.name), type_text(hints[f.name]), code(repr(default)), flag, comments.get(f.name, "")]
        )
    out = table(["field", "type", "default", "`distbench run` flag", "notes"], rows)
    keys = module_constant(SRC / "distbench" / "matrix.py", "MATRIX_KEYS")
    out += [
        "A matrix YAML (`distbench run --config FILE`) holds any of these fields plus the matrix keys "
        + ", ".join(code(k) for k in keys)
        + " (`strategies`, `world_sizes`, `models` and `precisions` may also be given as one value under the "
        "singular key).",
        "",
    ]
    return out


# --- distbench-metrics ---------------------------------------------------------------------------------------

SOURCES = {
    "bench": "the bench job",
    "scaling": "scaling (against 1 GPU)",
    "trace": "the trace (`--trace`)",
    "busbw": "the bus-bandwidth job",
}
AB_ROLES = {
    "gate": "gated by `ab`",
    "gate-host-bound": "gated by `ab` when host-bound",
    "device": "a device-side candidate of `ab`: gated when chosen, else shown",
    "report": "shown by `ab`",
    "": "",
}


def metrics_reference() -> list[str]:
    from distbench.metrics import METRICS

    rows = []
    for m in METRICS.values():
        roles = [AB_ROLES[m.ab], "compared by `compare`" if m.compare else ""]
        roles.append(f"asv: {code(m.asv.benchmark)}" if m.asv else "")
        rows.append(
            [
                code(m.name),
                m.description,
                m.unit,
                "higher" if m.better == "higher" else "lower",
                SOURCES[m.source],
                "; ".join(r for r in roles if r),
            ]
        )
    return table(["metric", "what it is", "unit", "better", "written by", "read by"], rows)


# --- distbench-strategies ------------------------------------------------------------------------------------


def strategies_reference() -> list[str]:
    from distbench.strategies import REGISTRY

    rows = []
    for s in REGISTRY.values():
        sharded = ", ".join(sorted(s.memory.sharded)) or "nothing"
        if s.memory.on_host:
            sharded += f"; on the host: {', '.join(sorted(s.memory.on_host))}"
        where = "CPU and GPU" if s.cpu else f"GPU only: {s.gpu_only_why}"
        if s.max_world_size:
            where += f"; at most {s.max_world_size} rank(s)"
        fp16 = ", ".join(s.fp16_devices) if s.fp16_devices else "no"
        if s.fp16_why:
            fp16 += f" ({s.fp16_why})"
        rows.append([code(s.name), s.description, where, sharded, s.checkpoint.name, fp16])
    return table(["strategy", "what", "runs on", "sharded", "checkpoint", "fp16 on"], rows)


# --- distbench-layers ----------------------------------------------------------------------------------------


def _test_layers() -> Any:
    spec = importlib.util.spec_from_file_location("distbench_test_layers", ROOT / "tests" / "test_layers.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layers_reference() -> list[str]:
    lay = _test_layers()
    names = [title.split(":")[0] for title, _ in lay.LAYERS]
    members: dict[int, list[str]] = {i: [] for i in range(len(names))}
    for module in lay.modules(lay.SRC):
        members[lay.layer_of(module)].append(module)
    crossing: dict[int, Counter[int]] = {i: Counter() for i in range(len(names))}
    for module, targets in lay.imports(lay.SRC).items():
        for target in targets:
            if lay.layer_of(target) != lay.layer_of(module):
                crossing[lay.layer_of(module)][lay.layer_of(target)] += 1
    width = max(len(t) for t, _ in lay.LAYERS) + 6
    art = []
    for i in reversed(range(len(names))):
        title = lay.LAYERS[i][0]
        art += [
            "┌" + "─" * width + "┐",
            f"│ {i + 1}. {title}".ljust(width + 1) + "│",
            "└" + "─" * width + "┘",
        ]
        if i:
            art.append(" " * (width // 2) + "▼ imports only from the layers below")
    out = ["```text", *art, "```", ""]
    rows = []
    for i, (title, prefixes) in enumerate(lay.LAYERS):
        short = sorted(m.removeprefix("distbench.") for m in members[i])
        imports_from = ", ".join(f"{names[j]} ({n})" for j, n in sorted(crossing[i].items()))
        rows.append(
            [f"{i + 1}. {title}", ", ".join(map(code, prefixes)), ", ".join(short), imports_from or "-"]
        )
    out += table(["layer (lowest first)", "prefixes", "modules", "imports from (count)"], rows)
    return out


GENERATORS: dict[str, Callable[[], list[str]]] = {
    "distbench-cli": cli_reference,
    "distbench-pytest-options": pytest_reference,
    "distbench-config": config_reference,
    "distbench-metrics": metrics_reference,
    "distbench-strategies": strategies_reference,
    "distbench-layers": layers_reference,
}


def toctree(caption: str, named: list[str], found: set[str], here: str) -> list[str]:
    """MyST for the site's contents: `named` in order under `caption`, then the rest of `found` (but `here` and
    pages whose name starts with `_`) sorted, under "More"."""
    rest = sorted(d for d in found - set(named) - {here} if not Path(d).name.startswith("_"))
    out = ["```{toctree}", f":caption: {caption}", ":maxdepth: 1", "", *named, "```", ""]
    if rest:
        out += ["```{toctree}", ":caption: More", ":maxdepth: 1", "", *rest, "```", ""]
    return out


def setup(app: Any) -> dict[str, Any]:
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    def directive(generate: Callable[[], list[str]]) -> type:
        class Generated(SphinxDirective):
            has_content = False

            def run(self) -> list[nodes.Node]:
                container = nodes.container()
                lines = generate()
                self.state.nested_parse(
                    StringList(lines, source=self.get_source_info()[0]), 0, container, True
                )
                return container.children

        return Generated

    class Toctree(SphinxDirective):
        has_content = True
        required_arguments = 1
        final_argument_whitespace = True

        def run(self) -> list[nodes.Node]:
            named = [line.strip() for line in self.content if line.strip()]
            lines = toctree(self.arguments[0], named, set(self.env.found_docs), self.env.docname)
            container = nodes.container()
            self.state.nested_parse(StringList(lines, source=self.get_source_info()[0]), 0, container)
            return container.children

    for name, generate in GENERATORS.items():
        app.add_directive(name, directive(generate))
    app.add_directive("distbench-toctree", Toctree)
    # the pages regenerate whenever the code they describe may have changed
    app.connect("env-get-outdated", lambda app, env, added, changed, removed: list(env.found_docs))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
