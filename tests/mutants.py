"""Deliberately broken trainers, run in the rank pool, to prove each invariant's check can fail.

Each mutation breaks one property a real incident breaks, on top of a correct trainer (DDP unless noted):
  no_grad_sync       ranks never all-reduce gradients (replicas silently diverge)
  sum_not_mean       gradients are summed across ranks instead of averaged (a missing 1/world_size)
  sync_every_micro   gradients are all-reduced on every micro-batch (no_sync forgotten)
  fresh_optimizer    a resume restores the model but silently resets the optimizer state (any torch-native
                     trainer, resharding loads included)
  local_norm_clip    gradients clipped by the norm of this rank's own shard instead of the global norm (FSDP2)
  dropout_global_rng  dropout masks drawn from torch's global RNG instead of each sample's stream (any
                     torch-native trainer)
  dropout_local_index  each sample's dropout stream keyed by its index within the rank's share of the batch
                     instead of its global index (any trainer)
  fp16_no_skip       under fp16, the optimizer steps even when the gradients overflowed (any torch-native
                     trainer; the scaler still backs off)
  bf16_master_weights  master weights held in bf16: rounded to bf16 at the start and after every optimizer
                     step (any torch-native trainer; DTensor shards rounded in place)
  lora_base_trainable  LoRA applied, then the whole model set trainable again before the optimizer is built
                     (any strategy): the base weights train beside the adapters
  bf16_reduce_dtype  FSDP2's MixedPrecisionPolicy built with reduce_dtype bf16 whatever the policy asked for:
                     gradients reduce-scattered in bf16 (fsdp_* strategies)
  bf16_compress_hook  DDP's gradients all-reduced in bf16 through torch's bf16_compress_hook
  ds_bf16_communication  DeepSpeed's communication_data_type set to bf16 in the config it is given (zero*)
  ds_autocast_off    DeepSpeed's torch_autocast section left off under bf16-amp (zero*): the engine turns the
                     autocast around it off, and the strategy trains in fp32 beside strategies in bf16
  all_reduce_twice   every DDP bucket all-reduced a second time (identical values across ranks, so the mean
                     keeps them: only the traffic shows it)
  clip_before_unscale  under fp16, gradients clipped while still multiplied by the loss scale, unscaled after
                     (any torch-native trainer)
  clip_per_micro_batch  gradients clipped after every micro-batch's backward instead of once per step, the
                     step reporting the last micro-batch's norm (any torch-native trainer)
  clip_reports_only  the pre-clip norm computed and reported, the gradients left unclipped (any torch-native
                     trainer)
  ds_clipping_off    DeepSpeed's gradient_clipping left at 0 whatever clip_grad_norm says (DeepSpeed still
                     measures and reports the norm)
  dropout_steps_since_resume  dropout streams keyed by the steps this process ran, not the run's step: a
                     resume draws step 0's masks again (any trainer)
  rng_unrestored_<g>  a resume that leaves global generator <g> (torch: the host's, cuda: every device's,
                     numpy, python; all: every one) where the rebuilt process had it (any strategy)
  rng_rank0_everywhere  a resume that gives every rank rank 0's global generators (any strategy)
  node_local_reduce  gradients averaged within each node of NODE_RANKS ranks, never across nodes: exact at 4
                     ranks, wrong from 8 (DDP)
  even_shard_gather  full parameters and gradients gathered as if every rank held dim 0 / world size rows:
                     exact where the world size divides each dimension, wrong for uneven shards (fsdp_full)
  hybrid_dims_swapped  HSDP's (replicate, shard) read in the wrong order, by the trainer's mesh or the memory
                     model: the same mesh where the two are equal (2 x 2 at 4 ranks), 4 x 2 for 2 x 4 at 8
  second_node_fresh_optimizer  ranks NODE_RANKS and up save a reset (zeroed) optimizer state: a no-op at 4
                     ranks, a checkpoint missing half its moments at 8 (any strategy)

The rank processes import this module by name: spawned ranks inherit the pytest process's sys.path, on which
pytest puts this directory.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor

import distbench.jobs.checks as checks
import distbench.jobs.train as jobs
import distbench.strategies.deepspeed as deepspeed
import distbench.strategies.fsdp as fsdp
import distbench.strategies.lora as lora
from distbench.strategies.ddp import DDPTrainer
from distbench.strategies.fsdp import FSDP2Trainer
from distbench.workloads.dropout import SampleDropout, sample_streams

#: Ranks per node in the mutations that break one node's share: 8 ranks are two such nodes.
NODE_RANKS = 4


def _sum_hook(state, bucket):  # unannotated: DDP rejects the string annotations of `from __future__`
    """DDP comm hook that all-reduces without dividing by the world size."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _twice_hook(state, bucket):  # unannotated, as _sum_hook
    """DDP comm hook that averages the bucket, then averages the (now identical) result once more."""
    buffer = bucket.buffer()
    for _ in range(2):
        dist.all_reduce(buffer.div_(dist.get_world_size()))
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _bf16_compress_hook(state, bucket):  # unannotated, as _sum_hook
    """torch's bf16_compress_hook itself, under a name DDP does not refuse on gloo: register_comm_hook turns the
    hook away by name unless CUDA and NCCL run it, though gloo reduces bf16 too."""
    return default_hooks.bf16_compress_hook(state, bucket)


#: Each global generator's getter and setter, written here rather than taken from the code under test.
_GENERATORS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "torch": (torch.get_rng_state, torch.set_rng_state),
    "cuda": (torch.cuda.get_rng_state_all, torch.cuda.set_rng_state_all),
    "numpy": (np.random.get_state, np.random.set_state),
    "python": (random.getstate, random.setstate),
}


def _wrap_load(trainer: Any, after: Callable[[dict[str, Any]], None]) -> None:
    """trainer.load_checkpoint, then `after(the generators' states from just before the load)`."""
    load = trainer.load_checkpoint

    def load_then(path: str, **kwargs: Any) -> None:
        before = {name: get() for name, (get, _) in _GENERATORS.items()}
        load(path, **kwargs)
        after(before)

    trainer.load_checkpoint = load_then


def _leave_unrestored(names: list[str]) -> Callable[[dict[str, Any]], None]:
    def put_back(before: dict[str, Any]) -> None:
        for name in names:
            _GENERATORS[name][1](before[name])

    return put_back


def _rank0_everywhere(_before: dict[str, Any]) -> None:
    """Every rank takes rank 0's generators as its load left them."""
    states = [{name: get() for name, (get, _) in _GENERATORS.items()}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(states, src=0)
    for name, (_, set_state) in _GENERATORS.items():
        set_state(states[0][name])


def _global_rng_dropout(module: SampleDropout, x: torch.Tensor) -> torch.Tensor:
    """What plain nn.Dropout does: a mask from torch's global RNG, the same stream whichever sample it is."""
    return torch.nn.functional.dropout(x, module.rate, module.training)


def _gather_assuming_even_shards(t: torch.Tensor) -> torch.Tensor:
    """A DTensor sharded on dim 0 of a 1-D mesh gathered as if each rank held dim 0 // world size rows (its own
    first rows, zero-padded where it holds fewer), the full shape kept: FSDP2's last shards are shorter."""
    t = t.detach()
    if not isinstance(t, DTensor):
        return t.float().cpu().clone()
    local, n = t.to_local(), dist.get_world_size()
    rows = t.shape[0] // n
    mine = torch.zeros(rows, *t.shape[1:], dtype=local.dtype)
    mine[: min(rows, local.shape[0])] = local[:rows]
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine)
    full = torch.zeros(t.shape, dtype=torch.float32)
    full[: n * rows] = torch.cat(parts)
    return full


def _zero_optimizer_state(trainer: Any) -> None:
    """Every moment of the rank's optimizer state zeroed (DeepSpeed's engine wraps torch's optimizer)."""
    optimizer = trainer.engine.optimizer.optimizer if hasattr(trainer, "engine") else trainer.optimizer
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    value.zero_()


def _mutate(trainer: Any, mutation: str) -> None:
    """Plant `mutation` in `trainer`. Long: one short branch per defect, side by side."""
    if mutation == "fresh_optimizer":
        load = trainer.load_checkpoint

        def load_but_reset_optimizer(path: str, **kwargs: Any) -> None:
            load(path, **kwargs)
            trainer.optimizer.state.clear()

        trainer.load_checkpoint = load_but_reset_optimizer
        return
    if mutation == "clip_before_unscale":
        assert trainer.scaler is not None, "clip_before_unscale needs precision fp16"
        clip, unscale = trainer.clip_gradients, trainer.unscale_gradients

        def clip_then_unscale() -> torch.Tensor | None:
            norm = clip()
            unscale()
            return norm

        trainer.unscale_gradients = lambda: None
        trainer.clip_gradients = clip_then_unscale
        return
    if mutation == "clip_reports_only":
        report = trainer.clip_gradients

        def norm_without_clipping() -> torch.Tensor | None:
            params = [p for p in trainer.clip_parameters() if p.grad is not None]
            unclipped = [p.grad.detach().clone() for p in params]
            norm = report()
            with torch.no_grad():
                for p, g in zip(params, unclipped, strict=True):
                    p.grad.copy_(g)
            return norm

        trainer.clip_gradients = norm_without_clipping
        return
    if mutation == "clip_per_micro_batch":
        forward_backward, clip = trainer.forward_backward, trainer.clip_gradients
        norms: list[torch.Tensor | None] = []

        def backward_then_clip(batch: Any, sync: bool) -> torch.Tensor:
            loss = forward_backward(batch, sync)
            norms.append(clip())
            return loss

        def last_norm() -> torch.Tensor | None:
            norm = norms[-1]
            norms.clear()
            return norm

        trainer.forward_backward = backward_then_clip
        trainer.clip_gradients = last_norm
        return
    if mutation == "dropout_steps_since_resume":
        load, start = trainer.load_checkpoint, [0]

        def load_and_count_afresh(path: str, **kwargs: Any) -> None:
            load(path, **kwargs)
            start[0] = trainer.steps_done

        trainer.load_checkpoint = load_and_count_afresh
        trainer.sample_streams = lambda batch: sample_streams(
            trainer.cfg.seed, trainer.steps_done - start[0], batch["sample_index"].tolist()
        )
        return
    if mutation.startswith("rng_unrestored_"):
        which = mutation.removeprefix("rng_unrestored_")
        _wrap_load(trainer, _leave_unrestored(list(_GENERATORS) if which == "all" else [which]))
        return
    if mutation == "rng_rank0_everywhere":
        _wrap_load(trainer, _rank0_everywhere)
        return
    if mutation == "local_norm_clip":
        assert isinstance(trainer, FSDP2Trainer), "local_norm_clip is written against the FSDP2 strategies"

        def clip_by_local_shard() -> torch.Tensor:
            grads = [p.grad.to_local() for p in trainer.model.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(grads, trainer.cfg.clip_grad_norm)

        trainer.clip_gradients = clip_by_local_shard
        return
    if mutation == "even_shard_gather":
        assert isinstance(trainer, FSDP2Trainer) and trainer.mesh.ndim == 1, "written against fsdp_full"
        trainer._gather = _gather_assuming_even_shards  # type: ignore[method-assign]
        return
    if mutation == "second_node_fresh_optimizer":
        save = trainer.save_checkpoint

        def save_with_the_second_node_reset(path: str) -> None:
            if trainer.ctx.rank >= NODE_RANKS:
                _zero_optimizer_state(trainer)
            save(path)

        trainer.save_checkpoint = save_with_the_second_node_reset
        return
    if mutation == "dropout_global_rng":
        for module in trainer.model.modules():
            if isinstance(module, SampleDropout):
                module.forward = functools.partial(_global_rng_dropout, module)
        return
    if mutation == "dropout_local_index":
        streams = trainer.sample_streams
        first = trainer.ctx.rank * trainer.cfg.per_rank_batch
        trainer.sample_streams = lambda batch: streams(
            {**batch, "sample_index": batch["sample_index"] - first}
        )
        return
    if mutation == "fp16_no_skip":
        assert trainer.scaler is not None, "fp16_no_skip needs precision fp16"
        trainer.scaler.step = lambda optimizer, *args, **kwargs: optimizer.step()
        return
    if mutation == "bf16_master_weights":

        def round_to_bf16() -> None:
            with torch.no_grad():
                for p in trainer.optimizer_parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.copy_(local.to(torch.bfloat16))

        step = trainer.optimizer_step

        def step_then_round() -> None:
            step()
            round_to_bf16()

        round_to_bf16()
        trainer.optimizer_step = step_then_round
        return
    assert isinstance(trainer, DDPTrainer), f"mutation {mutation!r} is written against the ddp strategy"
    if mutation == "no_grad_sync":
        trainer.forward_backward = lambda batch, sync: DDPTrainer.forward_backward(trainer, batch, False)
    elif mutation == "sync_every_micro":
        trainer.forward_backward = lambda batch, sync: DDPTrainer.forward_backward(trainer, batch, True)
    elif mutation == "sum_not_mean":
        trainer.model.register_comm_hook(None, _sum_hook)
    elif mutation == "bf16_compress_hook":
        trainer.model.register_comm_hook(None, _bf16_compress_hook)
    elif mutation == "all_reduce_twice":
        trainer.model.register_comm_hook(None, _twice_hook)
    elif mutation == "node_local_reduce":
        node, _ = dist.new_subgroups(NODE_RANKS)
        trainer.model.register_comm_hook(node, default_hooks.allreduce_hook)
    else:
        raise ValueError(f"unknown mutation {mutation!r}")


def _apply_lora_leaving_base_trainable(model: Any, cfg: Any) -> Any:
    return _apply_lora(model, cfg).requires_grad_(True)


_apply_lora = lora.apply_lora


_MixedPrecisionPolicy = fsdp.MixedPrecisionPolicy
_build_ds_config = deepspeed.build_ds_config


def _reducing_in_bf16(**policy: Any) -> Any:
    return _MixedPrecisionPolicy(**{**policy, "reduce_dtype": torch.bfloat16})


def _communicating_in_bf16(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {**_build_ds_config(*args, **kwargs), "communication_data_type": "bf16"}


def _ds_config_without_clipping(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {**_build_ds_config(*args, **kwargs), "gradient_clipping": 0.0}


_hybrid_shape = fsdp.hybrid_shape


def _ds_config_without_autocast(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {**_build_ds_config(*args, **kwargs), "torch_autocast": {"enabled": False}}


def _hybrid_dims_swapped(*args: Any, **kwargs: Any) -> tuple[int, int]:
    replicate, shard = _hybrid_shape(*args, **kwargs)
    return shard, replicate


#: Mutations planted where a strategy builds its trainer, before any wrapper sees the model: mutation -> the
#: (module, attribute, replacement) patched for as long as it lasts.
_AT_BUILD: dict[str, tuple[Any, str, Any]] = {
    "lora_base_trainable": (lora, "apply_lora", _apply_lora_leaving_base_trainable),
    "bf16_reduce_dtype": (fsdp, "MixedPrecisionPolicy", _reducing_in_bf16),
    "ds_bf16_communication": (deepspeed, "build_ds_config", _communicating_in_bf16),
    "ds_clipping_off": (deepspeed, "build_ds_config", _ds_config_without_clipping),
    "ds_autocast_off": (deepspeed, "build_ds_config", _ds_config_without_autocast),
    "hybrid_dims_swapped": (fsdp, "hybrid_shape", _hybrid_dims_swapped),
}


@contextlib.contextmanager
def mutated(mutation: str) -> Iterator[None]:
    """Every trainer the jobs build while inside is mutated (the modules hold make_trainer by name)."""
    if mutation in _AT_BUILD:  # before the wrapper and the optimizer see the model
        with mock.patch.object(*_AT_BUILD[mutation]):
            yield
        return

    def make(ctx: Any, cfg: Any) -> Any:
        trainer = original(ctx, cfg)
        _mutate(trainer, mutation)
        return trainer

    original = jobs.make_trainer
    jobs.make_trainer = checks.make_trainer = make
    try:
        yield
    finally:
        jobs.make_trainer = checks.make_trainer = original


def train(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, Any]:
    with mutated(mutation):
        return jobs.train(ctx, **kwargs)


def train_with_an_overflow(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, Any]:
    """recipe_jobs.train_with_an_overflow, mutated."""
    import recipe_jobs

    with mutated(mutation):
        return recipe_jobs.train_with_an_overflow(ctx, **kwargs)


def train_watching_steps(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, Any]:
    """recipe_jobs.train_watching_steps, mutated."""
    import recipe_jobs

    with mutated(mutation):
        return recipe_jobs.train_watching_steps(ctx, **kwargs)


def count_collectives(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, float]:
    with mutated(mutation):
        return checks.count_collectives(ctx, **kwargs)


def record_collectives(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, Any]:
    with mutated(mutation):
        return checks.record_collectives(ctx, **kwargs)


def record_regime(ctx: Any, mutation: str, **kwargs: Any) -> dict[str, list[str]]:
    with mutated(mutation):
        return checks.record_regime(ctx, **kwargs)
