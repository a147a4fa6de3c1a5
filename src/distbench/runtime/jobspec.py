"""What a launch's store carries: jobs by registered name with JSON arguments, and JSON outcomes.

torchrun's store is a TCP endpoint without authentication: whoever reaches its port can write any key, so
nothing read from it may be executable. A job travels as a JSON object, {"job": NAME, "kwargs": {...},
"world_size": N, "timeout": S}, and the end of a launch as {"stop": true, "status": N}. NAME must be one of
the registry's (the jobs `distbench launch` runs, jobs/registry.py); each argument is checked against that
function's own annotation, its one schema (a RunConfig through its pydantic validation, anything else
strictly as annotated); and whatever a job names on this rank's machine must be what this rank's own command
line names (its Admission): a model factory (code the rank would import), a strategy option (a ds_config file
it would read), a path (only inside its --output), and the world size and timeout (at most the launch's). A
job whose parameter takes text other than as a LocalPath cannot be registered, whatever the parameter's
name: text could name a file, which only a LocalPath keeps inside --output. Anything else is a JobSpecError
naming the key and quoting a short start of the value (errors.shown), raised before any of the job runs. A
decoded Job carries the SHA-256 of the bytes it was read from, which its ranks compare before running it
(cluster.py). A rank's outcome comes back as JSON of a fixed shape and is read back the same way.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from ..config import NonNegativeInt, OnRank, PositiveFloat, PositiveInt, RunConfig, check_value
from ..errors import ConfigError, JobSpecError, shown
from .pool import check_configs
from .worker import job_name

_JOB_KEYS = ("job", "kwargs", "world_size", "timeout")
_STOP_KEYS = ("stop", "status")


@dataclass(frozen=True)
class Admission:
    """What a job read from the store may name on this rank's machine, from this rank's own command line:
    the models (a factory is code the rank imports), the strategy options (a ds_config file it reads), the
    directory every path must lie in, and the largest world size and timeout."""

    models: frozenset[str]
    options: Mapping[str, Any]
    output: str
    world_size: int
    timeout: float

    def check_config(self, cfg: RunConfig, key: str) -> None:
        if cfg.model not in self.models:
            raise JobSpecError(
                f"key '{key}.model': {shown(cfg.model)} is not a model this rank's command line names (a "
                "factory is code the rank would import); name it with --model on every node"
            )
        for name, value in cfg.options.items():
            if name not in self.options or self.options[name] != value:
                raise JobSpecError(
                    f"key {shown(f'{key}.options.{name}')}: not the value this rank's command line gives it; "
                    "give every node the same --ds-config / --config"
                )

    def check_path(self, path: str, key: str) -> None:
        root, target = os.path.realpath(self.output), os.path.realpath(path)
        if os.path.commonpath([root, target]) != root:
            raise JobSpecError(f"key '{key}': {shown(path)} lies outside this rank's --output {self.output}")


@dataclass(frozen=True)
class Job:
    """A job read from the store and checked: the function, its arguments, where and how long it runs, and
    the SHA-256 of the bytes it was read from, which every rank of its world must share before any runs it."""

    name: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    world_size: int
    timeout: float
    digest: bytes


@dataclass(frozen=True)
class Stop:
    """The end of the launch: every rank exits with `status`."""

    status: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise JobSpecError(f"key {shown(k)} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise JobSpecError(f"{name} is not a number JSON allows")


def _json_object(data: bytes) -> dict[str, Any]:
    """The JSON object `data` holds; JobSpecError for anything else (a pickle is refused unread)."""
    try:
        msg = json.loads(
            bytes(data).decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant
        )
    except UnicodeDecodeError:
        raise JobSpecError(
            f"not UTF-8 JSON (starts {bytes(data[:8])!r}): distbench sends JSON only, and refuses a pickle unread"
        ) from None
    except (ValueError, RecursionError) as e:
        raise JobSpecError(f"not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict):
        raise JobSpecError(f"a JSON {type(msg).__name__}, not an object")
    return msg


def _exact_keys(msg: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in msg:
        if key not in keys:
            raise JobSpecError(f"unknown key {shown(key)} (a {keys[0]} message has {', '.join(keys)})")
    for key in keys:
        if key not in msg:
            raise JobSpecError(f"key {key!r} is missing")


def _checked(annotation: Any, value: Any, key: str) -> Any:
    try:
        return check_value(annotation, value, f"key '{key}'")
    except ConfigError as e:
        raise JobSpecError(str(e)) from None


def _takes_text(annotation: Any) -> bool:
    """Whether an argument of this annotation can hold free text anywhere in it (a str or Any, not a
    Literal's values): text that could name a file on the rank's machine."""
    if annotation is str or annotation is Any:
        return True
    if typing.get_origin(annotation) is Literal:
        return False
    return any(_takes_text(a) for a in typing.get_args(annotation))


def _is_path(annotation: Any) -> bool:
    """Whether `annotation` is LocalPath or LocalPath | None: the one form of free text a job may take."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    members = [a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)]
    return len(members) == 1 and any(isinstance(m, OnRank) for m in getattr(members[0], "__metadata__", ()))


@dataclass(frozen=True)
class _Param:
    annotation: Any
    required: bool
    path: bool  # a LocalPath: confined to the rank's --output


def _params(fn: Callable[..., Any]) -> dict[str, _Param]:
    """A job's parameters after its RankContext, with their resolved annotations: its signature is the one
    schema its arguments from the network are checked against. TypeError for a parameter that takes free text
    other than as a LocalPath, whatever its name: a path it was not declared to be would escape --output."""
    hints = typing.get_type_hints(fn, include_extras=True)
    out = {}
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name not in hints:
            raise TypeError(
                f"{job_name(fn)} cannot run under a launch: its parameter {p.name} needs a name and an "
                "annotation, which its arguments from the network are checked against"
            )
        path = _is_path(hints[p.name])
        if not path and _takes_text(hints[p.name]):
            raise TypeError(
                f"{job_name(fn)} cannot run under a launch: its parameter {p.name} takes text, which could "
                "name a file; annotate it LocalPath (or LocalPath | None), which each rank confines to its "
                "--output, or a Literal of the values it takes"
            )
        out[p.name] = _Param(hints[p.name], p.default is p.empty, path)
    return out


class JobRegistry:
    """The jobs a launch may run, by the name they travel under, and each one's annotated parameters."""

    def __init__(self, jobs: Iterable[Callable[..., Any]]) -> None:
        self.jobs = {job_name(fn): fn for fn in jobs}
        self._params = {name: _params(fn) for name, fn in self.jobs.items()}

    def encode(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], world_size: int, timeout: float
    ) -> bytes:
        """The message for a job: JobSpecError when it is not registered or its arguments are no JSON."""
        name = job_name(fn)
        if self.jobs.get(name) is not fn:
            raise JobSpecError(
                f"job {name} is not one a launch runs (registered: {', '.join(sorted(self.jobs))}); "
                "add it to distbench.jobs.registry"
            )
        args = {k: v.to_dict() if isinstance(v, RunConfig) else v for k, v in kwargs.items()}
        msg = {"job": name, "kwargs": args, "world_size": world_size, "timeout": timeout}
        try:
            return json.dumps(msg, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise JobSpecError(f"the arguments of job {name} cannot travel as JSON ({e})") from None

    def decode(self, data: bytes, admission: Admission) -> Job | Stop:
        """The job or stop `data` holds, every key checked; JobSpecError naming the first bad one."""
        msg = _json_object(data)
        if "stop" in msg:
            _exact_keys(msg, _STOP_KEYS)
            if msg["stop"] is not True:
                raise JobSpecError(f"key 'stop' must be true, not {shown(msg['stop'])}")
            status = _checked(NonNegativeInt, msg["status"], "status")
            if status > 255:
                raise JobSpecError(f"key 'status': {shown(status)} is no exit status (0-255)")
            return Stop(status)
        _exact_keys(msg, _JOB_KEYS)
        name = msg["job"]
        if not isinstance(name, str) or name not in self.jobs:
            raise JobSpecError(
                f"key 'job': {shown(name)} is not a job a launch runs (registered: "
                f"{', '.join(sorted(self.jobs))})"
            )
        world_size = _checked(PositiveInt, msg["world_size"], "world_size")
        if world_size > admission.world_size:
            raise JobSpecError(
                f"key 'world_size': {shown(world_size)} exceeds the {admission.world_size} ranks of this "
                "launch"
            )
        timeout = _checked(PositiveFloat, msg["timeout"], "timeout")
        if timeout > admission.timeout:
            raise JobSpecError(
                f"key 'timeout': {timeout:g} s exceeds this launch's --timeout {admission.timeout:g} s"
            )
        kwargs = self._kwargs(name, msg["kwargs"], admission)
        try:
            check_configs(kwargs, world_size)
        except ConfigError as e:
            raise JobSpecError(f"key 'kwargs': {e}") from None
        return Job(name, self.jobs[name], kwargs, world_size, timeout, hashlib.sha256(data).digest())

    def _kwargs(self, name: str, raw: Any, admission: Admission) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise JobSpecError(f"key 'kwargs' must be an object, not {type(raw).__name__}")
        params = self._params[name]
        for key in raw:
            if key not in params:
                raise JobSpecError(
                    f"key {shown(f'kwargs.{key}')}: {name} has no such parameter (it takes "
                    f"{', '.join(params) or 'none'})"
                )
        for key, param in params.items():
            if param.required and key not in raw:
                raise JobSpecError(f"key 'kwargs.{key}' is missing: {name} needs it")
        return {k: _argument(params[k], v, f"kwargs.{k}", admission) for k, v in raw.items()}


def _argument(param: _Param, value: Any, key: str, admission: Admission) -> Any:
    """One argument checked against its parameter's annotation and this rank's admission."""
    if param.annotation is RunConfig:
        if not isinstance(value, dict):
            raise JobSpecError(
                f"key '{key}' must be an object of RunConfig fields, not {type(value).__name__}"
            )
        try:
            cfg = RunConfig.from_dict(value)
        except (ConfigError, TypeError) as e:
            raise JobSpecError(f"key '{key}': {e}") from None
        admission.check_config(cfg, key)
        return cfg
    value = _checked(param.annotation, value, key)
    if value is not None and param.path:
        admission.check_path(value, key)
    return value


def encode_outcome(outcome: dict[str, Any], job: str) -> bytes:
    """A follower's outcome as JSON; a reply that is no JSON becomes that rank's error."""
    try:
        return json.dumps(outcome, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        error = {
            "status": "error",
            "exc_type": "TypeError",
            "text": f"{job} returned data that cannot travel as JSON to rank 0 ({e}); return tensors from rank 0 only",
        }
        return json.dumps(error).encode()


def decode_outcome(data: bytes, rank: int) -> dict[str, Any]:
    """An outcome rank `rank` posted: {"status": "ok", "reply": ...} or {"status": "error", "exc_type": str,
    "text": str}; JobSpecError for anything else, which no follower writes."""
    msg = _json_object(data)
    if msg.get("status") == "ok" and set(msg) == {"status", "reply"}:
        return msg
    if (
        msg.get("status") == "error"
        and set(msg) == {"status", "exc_type", "text"}
        and isinstance(msg["exc_type"], str)
        and isinstance(msg["text"], str)
    ):
        return msg
    raise JobSpecError(
        f"the outcome posted for rank {rank} is not one a follower writes (keys {shown(sorted(msg))})"
    )
