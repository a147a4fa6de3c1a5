"""The DeepSpeed config: the harness's keys, a user's ds_config merged in, conflicts refused.

The harness owns what defines the run (batch sizes, ZeRO stage, offload, precision, optimizer and LR schedule),
so a zero3 result stays comparable with ddp on the same RunConfig. Everything else a user sets (bucket sizes,
overlap_comm, gradient_clipping, ...) passes through to DeepSpeed untouched. "auto" (as in HF Trainer configs)
means "the harness decides": a harness key takes the harness value, any other key is dropped so DeepSpeed's
default applies.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from typing import Any

from ..config import NonNegativeFloat, PositiveFloat, PositiveInt, RunConfig, check_value
from ..errors import ConfigError

AUTO = "auto"
_ADAMW_PARAMS = ("lr", "betas", "eps", "weight_decay")


#: Top-level scalars DeepSpeed 0.19 reads without checking their type: a `"gradient_clipping": "x"` would
#: otherwise pass its config class and fail inside every rank.
_SCALARS: dict[str, Any] = {
    "gradient_clipping": NonNegativeFloat,
    "gradient_predivide_factor": PositiveFloat,
    "steps_per_print": PositiveInt,
    "prescale_gradients": bool,
    "wall_clock_breakdown": bool,
    "memory_breakdown": bool,
    "dump_state": bool,
}

#: DeepSpeed's default reduce/allgather bucket size in elements (deepspeed.runtime.zero.config).
DS_DEFAULT_BUCKET = 500_000_000
#: How DeepSpeed's users run ZeRO for throughput where DeepSpeed's default differs: overlap the gradient
#: reduction with backward (DeepSpeed 0.19 defaults overlap_comm to true at stage 3 only; its ZeRO tutorial's
#: stage 2 config and Transformers' DeepSpeed guide set it at stage 2 too). docs/strategies-tuning.md.
THROUGHPUT = {"overlap_comm": True}


def build_ds_config(
    cfg: RunConfig, stage: int, offload: bool, user: dict | str | None, n_params: int | None = None
) -> dict:
    """The config handed to deepspeed.initialize; raises ConfigError on a conflicting or malformed ds_config.

    `n_params`, the model's parameter count, caps the default bucket sizes (see harness_config).
    """
    source, raw = _load_user(user)
    harness = harness_config(cfg, stage, offload, n_params)
    resolved = _resolve_user(raw, cfg, stage, offload, source)
    merged = _deep_merge(harness, resolved)  # the user's remaining keys equal the harness's where it decides
    _validate(merged, set(raw), source)
    return merged


def check_run_config(cfg: RunConfig) -> None:
    """Build cfg's DeepSpeed config here, so a bad ds_config fails before any rank starts (the `config_check`
    of the zero* registry entries)."""
    from . import get_spec

    options = get_spec(cfg.strategy).options_for(cfg)
    build_ds_config(cfg, options["stage"], options.get("offload", False), options.get("ds_config"))


def harness_config(cfg: RunConfig, stage: int, offload: bool, n_params: int | None = None) -> dict[str, Any]:
    """What distbench sets unless the user's ds_config says otherwise (harness-owned keys: see _controlled),
    with ZeRO's THROUGHPUT settings.

    Bucket sizes default to DeepSpeed's 5e8 elements, capped at the model's parameter count: ZeRO-1/2 allocate
    their reduction buckets eagerly, so a tiny model on CPU spent seconds per step zeroing a 2 GB buffer it
    never fills. A bucket at least as large as the model holds every gradient either way, so the collectives
    (and the numerics) are those of the default; GPU-size models (>= 5e8 parameters) keep the default as is.
    """
    # Stage 0 is DeepSpeed's data parallelism without ZeRO: one all-reduce of every gradient at the boundary,
    # none of ZeRO's buckets or overlap to set
    zero: dict[str, Any] = {"stage": stage, **THROUGHPUT} if stage else {"stage": 0}
    if n_params is not None and stage:
        bucket = max(1, min(DS_DEFAULT_BUCKET, n_params))
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = bucket
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.accum_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": fp16_section(cfg),
        "torch_autocast": torch_autocast_section(cfg),
        # Parity: recent DeepSpeed (0.19.8 here; older releases used 0.0) defaults gradient_clipping to 1.0, so
        # every step's gradient was silently rescaled to global norm 1 while DDP and the reference do not clip.
        # Adam hides it on step 1 (its update is nearly scale-free) but from step 2 on the per-step clip factors
        # differ, the moment estimates mix differently scaled gradients and losses drift (~5e-5 relative by
        # step 6 on gpt2-tiny). Set explicitly from RunConfig.clip_grad_norm (0: off), so either default gives
        # parity; a user's value still overrides.
        "gradient_clipping": cfg.clip_grad_norm,
        # The harness passes torch.optim.AdamW (see deepspeed.py); DeepSpeed refuses it under ZeRO and,
        # with offload, demands its JIT-built DeepSpeedCPUAdam unless told otherwise.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,  # DeepSpeed's progress lines would interleave with the harness's output
    }


def torch_autocast_section(cfg: RunConfig) -> dict[str, Any]:
    """DeepSpeed's torch_autocast section: on for bf16-amp only, so that the engine computes under
    torch.autocast over fp32 parameters as single and DDP do (the engine turns off an autocast entered outside
    it unless this section is on). No module is listed as safe for bf16 gradient communication: every gradient
    is reduced in fp32, as DDP reduces it, so the regime is the same on the wire too."""
    if cfg.precision != "bf16-amp":
        return {"enabled": False}
    return {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}


def fp16_section(cfg: RunConfig) -> dict[str, Any]:
    """DeepSpeed's fp16 section: off unless precision is fp16, then dynamic loss scaling by torch GradScaler's
    rule as far as DeepSpeed's DynamicLossScaler can follow it. It starts at 2**loss_scale_power and, with
    hysteresis 1, halves on every overflow (skipping that step and its LR step). It grows after window + 1 clean
    steps the first time after a start or an overflow and every window steps after that, where GradScaler grows
    every growth_interval steps: a window of loss_scale_window - 1 makes the first growth agree (the one a short
    run sees; from a loss_scale_window of 2 up), later ones in the same clean stretch come a step early. min_loss_scale stays DeepSpeed's 1."""
    if cfg.precision != "fp16":
        return {"enabled": False}
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": cfg.loss_scale_power,
        "loss_scale_window": max(1, cfg.loss_scale_window - 1),
        "hysteresis": 1,
        "consecutive_hysteresis": False,
    }


def _controlled(cfg: RunConfig, stage: int, offload: bool) -> dict[tuple[str, ...], tuple[Any, str]]:
    """Harness-owned leaves: path -> (harness value, how a user changes it instead)."""
    device = "cpu" if offload else "none"
    off_fix = (
        "use the zero3_offload strategy for CPU offload (NVMe offload is not supported), or remove the key"
    )
    prec_fix = f"set RunConfig.precision (now {cfg.precision!r}) instead, or remove the key"
    scale_fix = "set RunConfig.loss_scale_power / loss_scale_window instead, or remove the key"
    return {
        ("train_batch_size",): (cfg.global_batch, "set RunConfig.global_batch instead, or remove the key"),
        ("train_micro_batch_size_per_gpu",): (
            cfg.micro_batch,
            "set RunConfig.micro_batch instead, or remove the key",
        ),
        ("gradient_accumulation_steps",): (
            cfg.accum_steps,
            "it follows from global_batch / (world_size x micro_batch); remove the key",
        ),
        ("zero_optimization", "stage"): (
            stage,
            "the strategy sets the stage: pick zero0, zero1, zero2 or zero3 instead, or remove the key",
        ),
        ("zero_optimization", "offload_optimizer", "device"): (device, off_fix),
        ("zero_optimization", "offload_param", "device"): (device, off_fix),
        ("bf16", "enabled"): (cfg.precision == "bf16", prec_fix),
        **{("fp16", k): (v, prec_fix if k == "enabled" else scale_fix) for k, v in fp16_section(cfg).items()},
        **{("torch_autocast", k): (v, prec_fix) for k, v in torch_autocast_section(cfg).items()},
        ("zero_allow_untested_optimizer",): (True, "distbench passes torch.optim.AdamW; remove the key"),
        ("zero_force_ds_cpu_optimizer",): (False, "distbench passes torch.optim.AdamW; remove the key"),
    }


def _load_user(user: dict | str | os.PathLike | None) -> tuple[str, dict[str, Any]]:
    """(a name for messages, the user's config as a dict)."""
    if user is None:
        return "no ds_config", {}
    if isinstance(user, dict):
        return "RunConfig.options['ds_config']", copy.deepcopy(user)
    if not isinstance(user, str | os.PathLike):
        raise ConfigError(f"ds_config must be a dict or a path to a JSON file, got {type(user).__name__}")
    path = os.fspath(user)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise ConfigError(f"ds_config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"ds_config file {path} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except (OSError, UnicodeDecodeError, ConfigError) as e:
        raise ConfigError(f"cannot read ds_config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"ds_config file {path} must hold a JSON object at the top level, got {type(data).__name__}"
        )
    return path, data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """DeepSpeed refuses duplicate keys too; JSON alone would silently keep the last one."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _resolve_user(
    raw: dict[str, Any], cfg: RunConfig, stage: int, offload: bool, source: str
) -> dict[str, Any]:
    """The user's config with conflicts refused, "auto" resolved and the optimizer/scheduler sections vetted."""
    user = copy.deepcopy(raw)
    if "bfloat16" in user:  # DeepSpeed's alias for "bf16"
        if "bf16" in user:
            raise ConfigError(f"ds_config ({source}) has both 'bf16' and its alias 'bfloat16'; keep one")
        user["bf16"] = user.pop("bfloat16")
    for key, annotation in _SCALARS.items():
        if key in user and user[key] != AUTO:
            check_value(annotation, user[key], f"ds_config ({source}) key {key!r}")
    _check_optimizer(user.pop("optimizer", None), cfg, source)
    _check_scheduler(user.pop("scheduler", None), source)
    for path, (ours, fix) in _controlled(cfg, stage, offload).items():
        node = user
        for part in path[:-1]:
            node = node.get(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"ds_config ({source}) key {'.'.join(path[:-1])!r} must be an object, got {node!r}"
                )
        theirs = node.get(path[-1], AUTO)
        if theirs != AUTO and not _same(theirs, ours):
            raise ConfigError(
                f"ds_config ({source}) key {'.'.join(path)!r} = {theirs!r} conflicts with distbench's "
                f"{ours!r} for this run; {fix}"
            )
    return _drop_auto(user)


def _check_optimizer(section: Any, cfg: RunConfig, source: str) -> None:
    """Accept an optimizer section only if it says what the harness's AdamW does anyway."""
    if section is None:
        return
    if cfg.algorithm != "adamw":
        raise ConfigError(
            f"ds_config ({source}) has an 'optimizer' section but the run's algorithm is "
            f"{cfg.algorithm!r}: distbench passes its own torch.optim optimizer; remove the section"
        )
    ours = {"lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    fix = (
        "distbench passes torch.optim.AdamW built from RunConfig (lr, betas, eps, weight_decay); set those "
        "instead, or remove the 'optimizer' section"
    )
    if not isinstance(section, dict):
        raise ConfigError(f"ds_config ({source}) key 'optimizer' must be an object, got {section!r}; {fix}")
    kind = section.get("type", AUTO)
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw", AUTO):
        raise ConfigError(
            f"ds_config ({source}) key 'optimizer.type' = {kind!r} conflicts with distbench's 'AdamW'; {fix}"
        )
    for k, v in (section.get("params") or {}).items():
        if v == AUTO or (k in _ADAMW_PARAMS and _same(v, ours[k])):
            continue
        want = repr(ours[k]) if k in ours else "nothing (no such AdamW setting)"
        raise ConfigError(
            f"ds_config ({source}) key 'optimizer.params.{k}' = {v!r} conflicts with distbench's "
            f"{want}; {fix}"
        )


def _check_scheduler(section: Any, source: str) -> None:
    """Accept a scheduler section only if every parameter is "auto": the harness steps its own LinearLR."""
    if section is None:
        return
    params = section.get("params") if isinstance(section, dict) else None
    if not isinstance(params, dict) or not params or any(v != AUTO for v in params.values()):
        raise ConfigError(
            f"ds_config ({source}) key 'scheduler' = {section!r} conflicts with distbench's LinearLR warm-up; "
            "set RunConfig.lr_warmup_steps instead, or remove the 'scheduler' section (one whose params are "
            'all "auto" is accepted and ignored)'
        )


def _same(a: Any, b: Any) -> bool:
    """Equal as config values: 8 == 8.0 and [0.9, 0.95] == (0.9, 0.95), but True != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _drop_auto(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_auto(v) if isinstance(v, dict) else v for k, v in d.items() if v != AUTO}


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _ReadRecorder(dict):
    """A dict that remembers which keys were looked up: DeepSpeed ignores top-level keys it never reads."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, k: str) -> Any:
        self.read.add(k)
        return super().__getitem__(k)

    def get(self, k: str, default: Any = None) -> Any:
        self.read.add(k)
        return super().get(k, default)

    def __contains__(self, k: object) -> bool:
        self.read.add(str(k))
        return super().__contains__(k)


def _validate(merged: dict[str, Any], user_keys: set[str], source: str) -> None:
    """Parse with DeepSpeed's own config class, so what it would reject fails here, naming the user's source.

    A top-level key DeepSpeed never reads is most likely a typo ("zero_optimisation") that it would silently
    ignore, so it is refused too, with the nearest key DeepSpeed does read.
    """
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = _ReadRecorder(copy.deepcopy(merged))
    # DeepSpeed checks train_batch_size against the live world size; the harness already made them agree.
    del probe["train_batch_size"]
    probe.read.clear()
    try:
        DeepSpeedConfig(probe)
    except Exception as e:  # DeepSpeedConfigError, pydantic.ValidationError, AssertionError, ValueError
        msg = " ".join(str(e).split())
        raise ConfigError(
            f"DeepSpeed {deepspeed.__version__} rejects the ds_config ({source}): {type(e).__name__}: {msg}"
        ) from None
    unread = sorted(user_keys - probe.read - {"train_batch_size", "optimizer", "scheduler", "bfloat16"})
    if unread:
        hints = []
        for k in unread:
            close = difflib.get_close_matches(k, sorted(probe.read), n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"ds_config ({source}) has top-level keys DeepSpeed {deepspeed.__version__} does not "
            f"know and would silently ignore: {', '.join(hints)}; fix or remove them"
        )
