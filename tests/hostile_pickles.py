"""Hostile pickles written opcode by opcode, and the gadgets they call, for the allow-list and launch tests.

Each gadget creates one marker file when its pickle is loaded by an unrestricted unpickler: that is what a
hostile file's code would do, harmlessly, so "the marker exists" means "the payload ran". `assemble` writes a
call tree as real opcodes of the protocol asked for: GLOBAL below protocol 4, STACK_GLOBAL from 4 on, REDUCE,
NEWOBJ, BUILD, INST and EXT1, so the names reach `find_class` exactly as written (dotted ones included),
which Python's own pickler would not produce for most of these. The gadgets come from builtins, os,
subprocess, functools, operator, copyreg, pickle, logging, numpy and torch's own namespace (its file
writers, torch.load behind functools.partial, os reached through torch.serialization).
"""

from __future__ import annotations

import copyreg
import pickle
import shlex
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Glob:
    """A global by module and name, as GLOBAL or STACK_GLOBAL names it."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """fn(*args) through REDUCE."""

    fn: Any
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Build:
    """`target` with `state` applied through BUILD (its __setstate__, else its attributes)."""

    target: Any
    state: Any


@dataclass(frozen=True)
class New:
    """cls.__new__(cls) through NEWOBJ, then BUILD with `state`: how pickle rebuilds a plain class's object."""

    cls: Any
    state: Any


@dataclass(frozen=True)
class Inst:
    """module.name(*args) through the INST opcode of protocol 0, which any unpickler still reads."""

    module: str
    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Ext:
    """The global registered as copyreg extension `code`, through EXT1."""

    code: int


def _emit(x: Any, proto: int) -> bytes:
    if isinstance(x, Glob):
        if proto >= 4:
            return _emit(x.module, proto) + _emit(x.name, proto) + pickle.STACK_GLOBAL
        return pickle.GLOBAL + f"{x.module}\n{x.name}\n".encode()
    if isinstance(x, Call):
        return _emit(x.fn, proto) + _emit(tuple(x.args), proto) + pickle.REDUCE
    if isinstance(x, Build):
        return _emit(x.target, proto) + _emit(x.state, proto) + pickle.BUILD
    if isinstance(x, New):
        return _emit(x.cls, proto) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + _emit(x.state, proto) + pickle.BUILD
    if isinstance(x, Inst):
        args = b"".join(_emit(a, proto) for a in x.args)
        return pickle.MARK + args + pickle.INST + f"{x.module}\n{x.name}\n".encode()
    if isinstance(x, Ext):
        return pickle.EXT1 + bytes([x.code])
    if isinstance(x, tuple):
        return pickle.MARK + b"".join(_emit(a, proto) for a in x) + pickle.TUPLE
    if isinstance(x, list):
        return pickle.EMPTY_LIST + (
            pickle.MARK + b"".join(_emit(a, proto) for a in x) + pickle.APPENDS if x else b""
        )
    if isinstance(x, dict):
        items = b"".join(_emit(k, proto) + _emit(v, proto) for k, v in x.items())
        return pickle.EMPTY_DICT + (pickle.MARK + items + pickle.SETITEMS if x else b"")
    if x is None or isinstance(x, bool | int | float | str | bytes):
        return pickle.dumps(x, protocol=3)[2:-1]  # the value's own opcodes, without PROTO and STOP
    raise TypeError(f"cannot assemble {x!r}")


def assemble(tree: Any, proto: int) -> bytes:
    """A complete pickle of protocol `proto` whose load evaluates `tree`."""
    return pickle.PROTO + bytes([proto]) + _emit(tree, proto) + pickle.STOP


class SetstateGadget:
    """A class whose __setstate__ runs code: a pickle that rebuilds one (NEWOBJ + BUILD) creates the marker."""

    def __setstate__(self, state: dict[str, str]) -> None:
        Path(state["marker"]).touch()


#: A copyreg extension code the EXT1 gadget registers for os.system while it runs (0xF0: a private range).
EXT_CODE = 0xF0


def _partial(fn: Glob, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """fn(*args, **kwargs) as pickle reaches keyword arguments: functools.partial's __setstate__."""
    return Call(Build(Call(Glob("functools", "partial"), (fn,)), (fn, args, kwargs, None)), ())


def torch_file(path: Path, data_pkl: bytes) -> Path:
    """A file in torch.save's zip format whose pickle is `data_pkl`: what torch.load reads."""
    import torch

    torch.save({}, path)
    with zipfile.ZipFile(path) as z:
        records = {name: z.read(name) for name in z.namelist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            z.writestr(name, data_pkl if name.endswith("/data.pkl") else data)
    return path


def _inner(scratch: Path, marker: str, torch_format: bool = False) -> Path:
    """A hostile pickle on disk (plain, or in torch.save's format), for the gadgets that load a file: it
    creates the marker."""
    data = assemble(Call(Glob("builtins", "open"), (marker, "w")), 2)
    path = scratch / f"inner-{Path(marker).name}.pkl"
    if torch_format:
        return torch_file(path, data)
    path.write_bytes(data)
    return path


def _gadgets() -> dict[str, tuple[int, Callable[[str, Path], Any]]]:
    """name -> (lowest protocol it loads under, tree given (marker path, scratch dir))."""

    def touch(m: str) -> str:
        return f"touch {shlex.quote(m)}"

    def path(m: str) -> Call:
        return Call(Glob("pathlib", "PosixPath"), (m,))

    return {
        "builtins.open": (2, lambda m, s: Call(Glob("builtins", "open"), (m, "w"))),
        "builtins.exec": (2, lambda m, s: Call(Glob("builtins", "exec"), (f"open({m!r}, 'w')",))),
        "builtins.eval": (2, lambda m, s: Call(Glob("builtins", "eval"), (f"open({m!r}, 'w')",))),
        "builtins.getattr+__import__": (
            2,
            lambda m, s: Call(
                Call(Glob("builtins", "getattr"), (Call(Glob("builtins", "__import__"), ("os",)), "system")),
                (touch(m),),
            ),
        ),
        "os.system": (2, lambda m, s: Call(Glob("os", "system"), (touch(m),))),
        "posix.system": (2, lambda m, s: Call(Glob("posix", "system"), (touch(m),))),
        "subprocess.call": (2, lambda m, s: Call(Glob("subprocess", "call"), (["touch", m],))),
        "os.system-inst-opcode": (2, lambda m, s: Inst("os", "system", (touch(m),))),
        "os.system-ext-opcode": (2, lambda m, s: Call(Ext(EXT_CODE), (touch(m),))),
        "torch.save": (2, lambda m, s: Call(Glob("torch", "save"), ({}, m))),
        "torch.serialization.save": (2, lambda m, s: Call(Glob("torch.serialization", "save"), ({}, m))),
        "torch._C.PyTorchFileWriter": (2, lambda m, s: Call(Glob("torch._C", "PyTorchFileWriter"), (m,))),
        "torch.load-weights_only-False": (
            2,
            lambda m, s: _partial(Glob("torch", "load"), (str(_inner(s, m, True)),), {"weights_only": False}),
        ),
        "torch.serialization.os.system": (
            4,
            lambda m, s: Call(Glob("torch.serialization", "os.system"), (touch(m),)),
        ),
        "torch-getattr-serialization.os.system": (
            4,
            lambda m, s: Call(Glob("torch", "serialization.os.system"), (touch(m),)),
        ),
        "dcp.filesystem.os.system": (
            4,
            lambda m, s: Call(Glob("torch.distributed.checkpoint.filesystem", "os.system"), (touch(m),)),
        ),
        "numpy.save": (2, lambda m, s: Call(Glob("numpy", "save"), (m, [1]))),
        "numpy.load-allow_pickle": (
            2,
            lambda m, s: _partial(Glob("numpy", "load"), (str(_inner(s, m)),), {"allow_pickle": True}),
        ),
        "pickle.loads": (
            3,
            lambda m, s: Call(Glob("pickle", "loads"), (_inner(s, m).read_bytes(),)),
        ),
        "functools.partial(open)": (
            2,
            lambda m, s: Call(Call(Glob("functools", "partial"), (Glob("builtins", "open"), m, "w")), ()),
        ),
        "operator.attrgetter+PosixPath": (
            2,
            lambda m, s: Call(Call(Call(Glob("operator", "attrgetter"), ("touch",)), (path(m),)), ()),
        ),
        "operator.methodcaller+PosixPath": (
            2,
            lambda m, s: Call(Call(Glob("operator", "methodcaller"), ("touch",)), (path(m),)),
        ),
        "copyreg._reconstructor+logging.FileHandler": (
            2,
            lambda m, s: Call(
                Glob("copyreg", "_reconstructor"),
                (Glob("logging", "FileHandler"), Glob("logging", "FileHandler"), m),
            ),
        ),
        "class-with-code-in-__setstate__": (
            2,
            lambda m, s: New(Glob(SetstateGadget.__module__, "SetstateGadget"), {"marker": m}),
        ),
    }


GADGETS = _gadgets()


@dataclass(frozen=True)
class Payload:
    """One hostile pickle: what it calls, its protocol, and the marker it creates if it runs."""

    gadget: str
    proto: int
    data: bytes
    marker: Path


def payloads(scratch: Path, protocols: tuple[int, ...] = (2, 3, 4, 5)) -> list[Payload]:
    """Every gadget at every protocol it loads under, each with a marker of its own under `scratch`."""
    out = []
    for name, (lowest, tree) in GADGETS.items():
        for proto in protocols:
            if proto >= lowest:
                # .npy: numpy.save would append it to any other name
                marker = scratch / f"ran-{name.replace('/', '_')}-p{proto}.npy"
                out.append(Payload(name, proto, assemble(tree(str(marker), scratch), proto), marker))
    return out


class extension_registered:
    """Context manager: EXT_CODE stands for os.system while it is open (the EXT1 gadget's registry entry)."""

    def __enter__(self) -> None:
        copyreg.add_extension("os", "system", EXT_CODE)

    def __exit__(self, *exc: object) -> None:
        copyreg.remove_extension("os", "system", EXT_CODE)
