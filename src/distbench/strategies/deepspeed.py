"""The DeepSpeed engine without ZeRO (stage 0), ZeRO stages 1-3 (and stage 3 with CPU offload) behind the uniform
Trainer interface."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..errors import CheckpointError, ConfigError
from ..runtime.context import RankContext
from .base import Batch, Trainer, build_scheduler, lm_loss, model_logits, place_optimizer_state, torch_load
from .checkpoint_files import verify_manifest, weights_only_loads, write_manifest
from .ds_config import build_ds_config

_META = "distbench_deepspeed.json"


class DeepSpeedTrainer(Trainer):
    """A DeepSpeed engine around torch's AdamW and LinearLR, built exactly as for the torch-native strategies."""

    autocast_bf16 = False  # DeepSpeed's bf16 section owns the precision policy

    def __init__(
        self,
        ctx: RankContext,
        cfg: RunConfig,
        model: nn.Module,
        stage: int,
        offload: bool = False,
        ds_config: dict | str | None = None,
    ) -> None:
        super().__init__(ctx, cfg, model)
        self.stage, self.offload = stage, offload
        self._stage0_norm: torch.Tensor | None = None
        # what DeepSpeed's reported norm is multiplied by (stage 0 in fp16: the loss scale)
        self._norm_scale = 1.0
        deepspeed = _import_deepspeed(ctx)  # first: importing it picks the accelerator
        forget_groups_of_a_gone_world()
        if stage == 3 and ctx.world_size > 1:
            agree_on_zero3_ids(ctx)
        self.ds_config = build_ds_config(
            cfg, stage, offload, ds_config, n_params=sum(p.numel() for p in model.parameters())
        )
        opt = self.make_optimizer(model.parameters(), offload=offload)
        with _parameters_printed_by_shape():
            self.engine, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=opt,
                lr_scheduler=build_scheduler(opt, cfg),
                config=self.ds_config,
                dist_init_required=False,
            )

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        if self.engine.is_gradient_accumulation_boundary() != sync:
            raise ConfigError(
                f"DeepSpeed expects {self.engine.gradient_accumulation_steps()} micro-batches per step "
                "(RunConfig.accum_steps) and got a different number"
            )
        loss = lm_loss(model_logits(self.engine, batch["input_ids"]), batch["labels"])
        self.engine.backward(loss)  # divides by gradient_accumulation_steps itself; reduces at the boundary
        if not sync:
            self.engine.step()  # only counts the micro-step; the boundary's step is optimizer_step()
        return loss.detach()

    def trained_module(self) -> nn.Module:
        return self.engine.module

    def make_grad_scaler(self) -> None:
        """None: under fp16 DeepSpeed scales the loss, unscales, skips and rescales inside its engine (its fp16
        section, written from the run's loss-scale settings in ds_config.py)."""
        return None

    def clip_gradients(self) -> torch.Tensor | None:
        """None: DeepSpeed clips inside engine.step() (its `gradient_clipping`, set from clip_grad_norm)."""
        return None

    def grad_norm_after_step(self) -> torch.Tensor | None:
        """The global norm DeepSpeed measured before it clipped (read after the step that computed it)."""
        if not self.cfg.clip_grad_norm:
            return None
        if self._stage0_norm is not None:
            return self._stage0_norm
        return torch.as_tensor(float(self.engine.get_global_grad_norm()) / self._norm_scale)

    def optimizer_step(self) -> None:
        """At the accumulation boundary engine.step() steps the optimizer and LR schedule and zeroes gradients.

        It runs here rather than in forward_backward so that full_grads() can still see the step's gradients.
        Under fp16 it records the loss scale the step ran with and whether the engine skipped it (an overflow).
        """
        if self._unwrapped() and self.cfg.clip_grad_norm:
            # Stage 0 without a wrapper (fp32, bf16-amp) hands the gradients to torch's optimizer as they are:
            # the engine clips them (clip_fp32_gradients) and keeps no norm, so the norm it clips by is measured
            # here first, from the all-reduced gradients every rank holds whole.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            self._stage0_norm = torch.nn.utils.get_total_norm(grads).detach().float().cpu()
        if self.cfg.precision != "fp16":
            self.engine.step()
            return
        scale, skipped_before = self.engine._get_optimizer_loss_scale(), self.engine.skipped_steps
        if self.stage == 0:
            # The fp16 wrapper without ZeRO (FP16_UnfusedOptimizer) keeps the norm of the still-scaled
            # gradients ("norm is in fact norm*scale", DeepSpeed 0.19); ZeRO's optimizers unscale theirs. Not
            # in bf16, where the scale is 1 in a sound release and a norm 2^16 too large is the defect of the
            # zoo's ds-0.17.6-bf16-stage0-loss-scale.
            self._norm_scale = float(scale)
        self.engine.step()
        self.record_loss_scale(float(scale), self.engine.skipped_steps > skipped_before)

    def _unwrapped(self) -> bool:
        """Whether the engine steps the client optimizer itself, with no DeepSpeed wrapper between (stage 0 in
        fp32 or bf16-amp): then DeepSpeed records no gradient norm."""
        return self.engine.optimizer is self.engine.basic_optimizer

    def _master(self, p: nn.Parameter) -> torch.Tensor:
        """The optimizer's fp32 copy of trainable `p`: ZeRO's and BF16_Optimizer's through DeepSpeed's mapping;
        without ZeRO, the fp16/bf16 optimizer wrapper's fp32 group beside `p` (DeepSpeed maps none), or `p`
        itself when no wrapper keeps a copy (fp32)."""
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(p)
        if full is not None:
            return full
        opt = self.engine.optimizer
        for low, high in zip(getattr(opt, "fp16_groups", ()), getattr(opt, "fp32_groups", ()), strict=False):
            for lp, hp in zip(low, high, strict=False):
                if lp is p:
                    return hp
        return p

    def full_grads(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        # Collective under ZeRO (the owners of each partition contribute), so every rank calls it for every
        # trainable param; frozen ones (LoRA's base) have no gradient. Under fp16 they are still multiplied by
        # the loss scale: DeepSpeed unscales inside its step.
        return {
            n: safe_get_full_grad(p).detach().float().cpu().clone()
            for n, p in self.engine.module.named_parameters()
            if p.requires_grad
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        module = self.engine.module
        # safe_get_full_fp32_param gathers the optimizer's fp32 master copy (a collective under ZeRO-3), so
        # under bf16 this returns what training holds, not the bf16 compute copy; tied weights map to one tensor.
        # A frozen parameter (LoRA's base) has no master copy: the module's own, gathered under ZeRO-3.
        full: dict[int, torch.Tensor] = {}
        out = {}
        for key, t in module.state_dict(keep_vars=True).items():
            if isinstance(t, nn.Parameter):
                if id(t) not in full:
                    full[id(t)] = (self._master(t) if t.requires_grad else _gathered(t)).detach()
                    full[id(t)] = full[id(t)].float().cpu().clone()
                out[key] = full[id(t)]
            else:
                out[key] = t.detach().float().cpu().clone()
        return out

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)  # model, optimizer shards and the LR scheduler's state
        if self.ctx.rank == 0:
            with open(os.path.join(path, _META), "w") as f:
                json.dump(
                    {"world_size": self.ctx.world_size, "stage": self.stage, "offload": self.offload}, f
                )
        self.save_extra_state(path)
        self.seal_checkpoint(path)  # complete on every rank when save returns on any

    def load_checkpoint(self, path: str, *, reshard: bool = False) -> None:
        """Restore a checkpoint of the same stage and offload. One saved at another world size needs
        `reshard=True` and goes through DeepSpeed's universal checkpoint (see _to_universal); RNG is then fresh."""
        verify_manifest(path)
        meta = _read_meta(os.path.join(path, _META))
        if (meta["stage"], meta["offload"]) != (self.stage, self.offload):
            raise CheckpointError(
                f"DeepSpeed checkpoint {path} was saved with ZeRO stage {meta['stage']}, offload {meta['offload']}; "
                f"this run has stage {self.stage}, offload {self.offload}: resume with the strategy that saved it"
            )
        other_ws = meta["world_size"] != self.ctx.world_size
        if other_ws and not reshard:
            raise CheckpointError(
                f"DeepSpeed checkpoint {path} was saved at world size {meta['world_size']}, this run has "
                f"{self.ctx.world_size}; load it with resharding (load_checkpoint(path, reshard=True)), which "
                "converts it to a DeepSpeed universal checkpoint"
            )
        if other_ws and self.stage == 0:
            raise CheckpointError(
                f"DeepSpeed checkpoint {path} was saved without ZeRO (stage 0) at world size {meta['world_size']}; "
                f"it loads at that world size only (DeepSpeed's universal conversion merges ZeRO partitions, "
                f"which stage 0 has none of), not at {self.ctx.world_size}"
            )
        if other_ws:
            self._to_universal(path)
            # The engine reads this at load time; it is a config key only because DeepSpeed expects to know
            # before initialize() whether a resume will be universal.
            self.engine._config.load_universal_checkpoint = True
        try:
            with weights_only_loads():
                loaded, _ = self.engine.load_checkpoint(
                    path, load_optimizer_states=True, load_lr_scheduler_states=True
                )
        except Exception as e:  # DeepSpeed raises assorted errors for damaged files or another model
            raise CheckpointError(f"cannot load DeepSpeed checkpoint {path}: {type(e).__name__}: {e}") from e
        finally:
            self.engine._config.load_universal_checkpoint = False
        if loaded is None:
            raise CheckpointError(
                f"DeepSpeed checkpoint {path} is incomplete: its 'latest' tag file is missing"
            )
        # The universal load writes the torch optimizer's state by hand (`step` on the host), which the fused
        # AdamW of a GPU run refuses at its first step.
        place_optimizer_state(getattr(self.engine.optimizer, "optimizer", self.engine.optimizer))
        if other_ws:
            self.load_progress(torch_load(os.path.join(path, "extra_rank0.pt")))
        else:
            self.restore_extra_state(path)

    def _to_universal(self, path: str) -> None:
        """Convert the checkpoint's latest tag to DeepSpeed's universal format once (rank 0), next to it:
        `<tag>_universal/` and a `latest_universal` file, which is where engine.load_checkpoint looks."""
        latest = os.path.join(path, "latest")
        if not os.path.exists(latest):
            raise CheckpointError(
                f"DeepSpeed checkpoint {path} is incomplete: its 'latest' tag file is missing"
            )
        with open(latest) as f:
            tag = f.read().strip()
        universal = f"{tag}_universal"
        if self.ctx.world_size > 1:
            dist.barrier()  # every rank has checked the files against the manifest before rank 0 adds more
        if self.ctx.rank == 0 and not os.path.exists(os.path.join(path, "latest_universal")):
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            args = argparse.Namespace(
                input_folder=os.path.join(path, tag),
                output_folder=os.path.join(path, universal),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,
            )
            try:
                with weights_only_loads():
                    ds_to_universal(args)
            except Exception as e:
                raise CheckpointError(
                    f"cannot convert DeepSpeed checkpoint {path} to a universal checkpoint: "
                    f"{type(e).__name__}: {e}"
                ) from e
            with open(os.path.join(path, "latest_universal"), "w") as f:
                f.write(universal)
            write_manifest(path)  # the conversion is part of the checkpoint from now on
        if self.ctx.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            destroy_engine(engine)
            del self.engine, engine
        gc.collect()


def destroy_engine(engine: Any) -> None:
    """What giving a DeepSpeed engine back takes: its destroy() (ZeRO hooks and buffers; absent in old
    DeepSpeed), then the references DeepSpeed itself keeps to a ZeRO-3 model (see _forget_zero3_module)."""
    if hasattr(engine, "destroy"):
        engine.destroy()
    _forget_zero3_module(engine.module)
    forget_torch_autocast()


def forget_torch_autocast() -> None:
    """Reset what an engine with a `torch_autocast` section (bf16-amp) sets for the whole process: DeepSpeed
    marks autocast initialized in module globals and never unmarks it, and from then on every ZeRO-1/2 engine
    of the process reduces each gradient in its parameter's dtype, whatever its communication_data_type says.
    In a rank pool a bf16-amp job thus changed the wire of every later DeepSpeed job (the CPU tier's planted
    bf16 communication went unseen after one). DeepSpeed before 0.17.2 has no such section, nor anything to
    reset (the project's floor is 0.16; the zoo's 0.17.1 found the import missing)."""
    try:
        from deepspeed.runtime import torch_autocast
    except ImportError:
        return
    torch_autocast.TORCH_AUTOCAST_INITIALIZED = False
    torch_autocast.TORCH_AUTOCAST_DTYPE = None


def forget_groups_of_a_gone_world() -> None:
    """Drop DeepSpeed's cached process groups when they belong to a world that was destroyed since.

    DeepSpeed clones the default group once per process (`groups._clone_world_group`, ZeRO's data-parallel
    group) and keeps it for good, forgetting it only when the world is destroyed through deepspeed.comm. A
    `distbench launch` forms a new default group for every job and destroys it through torch, so a rank's
    second DeepSpeed job found the first job's clone: of another world size, and no longer registered. On two
    nodes of one rank each, zero2 at world size 2 after zero2 at world size 1 hung: rank 0 took the stale clone
    of its 1-rank world (torch still answers its size, 1; its ranks raise) while rank 1, new to DeepSpeed,
    cloned the 2-rank world and waited in its first collective for a rank 0 that never came. In a rank pool the
    world lives as long as the process, the clone stays registered and is kept."""
    from deepspeed.utils import groups

    cached = [g for g in (groups._WORLD_GROUP, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP) if g is not None]
    if all(_registered(g) for g in cached):
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)  # DeepSpeed's own forgetting, as its destroy_process_group does
    else:
        groups._WORLD_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


def agree_on_zero3_ids(ctx: RankContext) -> None:
    """Start this build's ZeRO-3 parameter and module ids where every rank of the job can: the highest any has.

    ZeRO-3 numbers parameters and modules from process-wide counters (partition_parameters.Init.param_id, and
    the default argument `count` of DeepSpeedZeRoOffload._register_deepspeed_module) and checks at each forward
    that every rank traced the same module ids. Under a launch rank 0 alone runs the world-size-1 jobs, so its
    counters ran ahead and zero3 at world size 2 failed that check ("a disagreement on list contents between
    rank0 and rank1"). Raising them, never lowering, keeps every id of an engine still alive unique."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    module_count = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]
    ids = torch.tensor([Init.param_id, module_count[0]], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(ids, op=dist.ReduceOp.MAX)
    Init.param_id, module_count[0] = int(ids[0]), int(ids[1])


def _registered(group: Any) -> bool:
    """Whether `group` belongs to the live world (torch forgets every group when its world is destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _gathered(p: nn.Parameter) -> torch.Tensor:
    """A copy of the whole of `p`, gathered from its ZeRO-3 partitions (a collective), or `p` itself otherwise."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters([p]):
        return p.detach().clone()


def _read_meta(meta_file: str) -> dict[str, Any]:
    """distbench_deepspeed.json: how the checkpoint was saved; CheckpointError naming the file if malformed."""
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
        world_size, stage, offload = meta["world_size"], meta["stage"], meta["offload"]
        if not (
            type(world_size) is int
            and world_size >= 1
            and stage in (0, 1, 2, 3)
            and isinstance(offload, bool)
        ):
            raise ValueError(f"unexpected values {meta!r}")
    except FileNotFoundError:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {meta_file} is missing; was the checkpoint saved "
            "completely, and by a DeepSpeed strategy?"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {meta_file} is malformed ({type(e).__name__}: {e}); "
            "re-save the checkpoint"
        ) from None
    return meta


def _forget_zero3_module(module: nn.Module) -> None:
    """Drop the two module-level references through which ZeRO-3 keeps every engine alive after destroy().

    DeepSpeed (0.19) pushes each ZeRO-3 model onto `parameter_offload.FWD_MODULE_STACK` when it installs its
    hooks and never pops it, and memoizes `PartitionedParameterCoordinator.__params_to_release` in a
    class-level lru_cache keyed by (coordinator, submodule). Through its hooks the model holds the engine and
    its optimizer: on one H200 each GPT-2 Large ZeRO-3 configuration left 11.6 GiB allocated for the rest of
    the rank's life, in a pool that serves a whole session an OOM a few configurations later.
    """
    try:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:
        return
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    memo = PartitionedParameterCoordinator.__dict__.get("_PartitionedParameterCoordinator__params_to_release")
    # the lru_cache sits under DeepSpeed's NVTX wrapper, which keeps it in a closure cell
    for fn in [memo, *(c.cell_contents for c in getattr(memo, "__closure__", None) or ())]:
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def _parameters_printed_by_shape() -> Iterator[None]:
    """nn.Parameter's repr without its values while DeepSpeed builds an engine.

    ZeRO-3's optimizer and parameter-offload constructors (DeepSpeed 0.19) format f"... {locals()}" for a debug
    line they then drop, and their locals hold a dict keyed by every parameter: each parameter's values were
    formatted, reading CUDA tensors element by element (148 parameters and 22k device reads a GPT-2 124M build,
    1.1 s of a 2 s warm build on an H200). Shape and dtype are all such a line needs."""
    original = nn.Parameter.__repr__

    def by_shape(p: nn.Parameter) -> str:
        return f"Parameter(shape={tuple(p.shape)}, dtype={p.dtype}, device={p.device})"

    nn.Parameter.__repr__ = by_shape  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Parameter.__repr__ = original  # type: ignore[method-assign,assignment]


#: torch 2.13 deprecates the collectives DeepSpeed 0.19's comm backend hands out as its own
#: (deepspeed/comm/torch.py, get_all_gather_function and get_reduce_scatter_function): DeepSpeed's call to change
_DEPRECATED_FOR_DEEPSPEED = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
)
#: what DeepSpeed's build_shm_op prints on stdout in every rank that starts its comm backend
_BUILT = re.compile(r"DeepSpeed \S+ built successfully")


def quiet_deepspeed(comm_torch: Any) -> None:
    """Silence DeepSpeed's chatter at its sources, nothing else: torch's FutureWarnings for the deprecated
    collectives DeepSpeed calls, and the "DeepSpeed ... built successfully" line of `comm_torch.build_shm_op`
    (the module deepspeed.comm.torch), whose other output passes through."""
    warnings.filterwarnings("ignore", message=_DEPRECATED_FOR_DEEPSPEED, category=FutureWarning)
    build = comm_torch.build_shm_op
    if getattr(build, "quiet", False):
        return

    def build_quietly() -> Any:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            op = build()
        sys.stdout.write(
            "".join(ln for ln in out.getvalue().splitlines(True) if not _BUILT.fullmatch(ln.strip()))
        )
        return op

    build_quietly.quiet = True  # type: ignore[attr-defined]
    comm_torch.build_shm_op = build_quietly


def _import_deepspeed(ctx: RankContext) -> Any:
    """deepspeed, with its accelerator matching the rank's device (it would pick CUDA on a GPU host), and
    quiet (quiet_deepspeed)."""
    os.environ.setdefault("DS_ACCELERATOR", ctx.device_type)
    import deepspeed
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != ctx.device_type:
        if ctx.device_type != "cpu":
            raise ConfigError(
                f"DeepSpeed's accelerator is {get_accelerator().device_name()!r} but this rank runs "
                f"on {ctx.device_type!r}; unset DS_ACCELERATOR"
            )
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    quiet_deepspeed(importlib.import_module("deepspeed.comm.torch"))  # deepspeed.comm.torch is torch itself
    return deepspeed
