"""Export a training checkpoint to a plain model and a transformers directory, single-process, on CPU.

What users do after training: consolidate ZeRO-3 shards with DeepSpeed's zero_to_fp32, or gather an FSDP2
DCP checkpoint with torch's dcp_to_torch_save, load the result into the bare model and `save_pretrained` it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..config import RunConfig
from ..errors import CheckpointError, first_line
from ..strategies import get_spec
from ..strategies.base import torch_load
from ..strategies.checkpoint_files import SafeFileSystemReader, verify_manifest, weights_only_loads
from ..workloads import get_model
from ..workloads.data import global_batch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _zero_to_fp32(path: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 consolidation of a ZeRO checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(path))


def _ds_module(path: str) -> dict[str, torch.Tensor]:
    """The module of a DeepSpeed checkpoint saved without ZeRO (stage 0): whole in its latest tag's model file,
    which zero_to_fp32 does not read (it merges ZeRO partitions). Under bf16 the file holds the bf16 weights."""
    with open(os.path.join(path, "latest"), encoding="utf-8") as f:
        tag = f.read().strip()
    state = torch_load(os.path.join(path, tag, "mp_rank_00_model_states.pt"))
    return {k: v.float() for k, v in state["module"].items()}


def _dcp(path: str) -> dict[str, torch.Tensor]:
    """The model half of a DCP checkpoint, gathered as torch's dcp_to_torch_save does."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    SafeFileSystemReader(os.path.join(path, "dcp")).read_metadata()  # a refusal names the file
    state: dict = {}  # filled from the checkpoint's own layout
    _load_state_dict(
        state,
        storage_reader=SafeFileSystemReader(os.path.join(path, "dcp")),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state["model"]


#: exporter name (a registry CheckpointFormat's `exporter`) -> checkpoint directory to fp32 full state dict
EXPORTERS: dict[str, Callable[[str], dict[str, torch.Tensor]]] = {
    "zero_to_fp32": _zero_to_fp32,
    "ds_module": _ds_module,
    "dcp": _dcp,
}


def full_state_dict_from_checkpoint(path: str | os.PathLike[str], strategy: str) -> dict[str, torch.Tensor]:
    """fp32 full model state dict from a checkpoint directory `strategy` saved, by the exporter of its
    registry checkpoint format, once its manifest checks out, and without running code from any file in it
    (see strategies/checkpoint_files.py)."""
    path = str(path)
    fmt = get_spec(strategy).checkpoint
    if fmt is None or fmt.exporter not in EXPORTERS:
        raise CheckpointError(
            f"no exporter for strategy {strategy}'s checkpoints "
            f"({fmt.name if fmt else 'no checkpoint format'})"
        )
    verify_manifest(path)
    try:
        with weights_only_loads():
            return EXPORTERS[fmt.exporter](path)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(
            f"cannot export checkpoint {path}: {type(e).__name__}: {first_line(str(e))}"
        ) from e


def load_into_model(state: dict[str, torch.Tensor], model_name: str) -> PreTrainedModel:
    """A fresh bare model holding `state`."""
    model = cast("PreTrainedModel", get_model(model_name).build(seed=0, device="cpu"))
    _load(model, state, model_name)
    return model


def merge_lora(state: dict[str, torch.Tensor], cfg: RunConfig) -> PreTrainedModel:
    """A fresh model with cfg's LoRA holding `state` (a LoRA run's: base weights and adapters), the adapters
    folded into the base weights by peft's merge_and_unload: the plain model users ship after LoRA training."""
    from ..strategies.lora import apply_lora

    model = apply_lora(get_model(cfg.model).build(seed=0, device="cpu"), cfg)
    _load(model, state, f"{cfg.model} with LoRA")
    return cast("PreTrainedModel", cast(Any, model).merge_and_unload())


def _load(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load `state` into `model`; only weights tied to another key may be absent from it."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tie = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    tied = {k for k in missing if tie and (k == "lm_head.weight" or k.endswith(".lm_head.weight"))}
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"exported state does not fit {what}: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    cast(Any, model).tie_weights()


def save_and_reload_pretrained(model: PreTrainedModel, out_dir: str | os.PathLike[str]) -> nn.Module:
    """save_pretrained then from_pretrained, as a user shipping the model would."""
    model.save_pretrained(out_dir)
    return type(model).from_pretrained(str(Path(out_dir)), attn_implementation="sdpa").float()


@torch.no_grad()
def global_batch_loss(model: nn.Module, cfg: RunConfig, step: int) -> float:
    """Mean next-token loss of `model` over the global batch of `step`, micro-batch by micro-batch."""
    spec = get_model(cfg.model)
    tokens = global_batch(cfg, step, cfg.seq_len or spec.seq_len, spec.vocab_size)
    model.eval()
    losses = []
    for chunk in tokens.split(cfg.micro_batch):
        logits = model(input_ids=chunk[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()).item())
    return sum(losses) / len(losses)
