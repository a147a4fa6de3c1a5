"""The uniform trainer every strategy implements, and what all strategies share.

A strategy turns (model, RunConfig, RankContext) into a Trainer whose `step(micro_batches)` runs one
optimizer step over this rank's share of the global batch and returns the loss averaged over the whole
global batch, defined identically for every strategy: the mean of the per-micro-batch token-mean
cross-entropies (all micro-batches have the same number of tokens).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import RunConfig
from ..errors import CheckpointError, ConfigError, first_line
from ..runtime.context import RankContext
from ..workloads import global_rng
from ..workloads.dropout import sample_streams
from .checkpoint_files import write_manifest

Batch = dict[str, torch.Tensor]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean next-token cross-entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def model_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out


#: The torch.optim keyword arguments that select each implementation (fused, foreach, the per-parameter loop).
IMPL_FLAGS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "forloop": {"foreach": False},
}


def optimizer_impl(
    cfg: RunConfig, device_type: str, *, offload: bool = False, no_fused: str | None = None
) -> str:
    """The optimizer implementation a run uses: cfg.optimizer, with "auto" resolved to what users pick.

    Fused on CUDA (one kernel for the whole update: the usual GPU choice, and FSDP2's DTensors support it
    for AdamW), foreach where parameters or optimizer state live on the host (CPU tier, offload) or where
    fused cannot run (`no_fused` says why); asking for fused there is a ConfigError naming the reason.
    """
    if cfg.optimizer == "fused" and no_fused:
        raise ConfigError(f"--optimizer fused cannot run here: {no_fused}; use auto or foreach")
    if cfg.optimizer != "auto":
        return cfg.optimizer
    return "fused" if device_type == "cuda" and not offload and not no_fused else "foreach"


def build_optimizer(params, cfg: RunConfig, impl: str = "foreach") -> torch.optim.Optimizer:
    """AdamW with the run's hyper-parameters and implementation (see `optimizer_impl`); the same for every
    strategy. The per-parameter loop ("forloop") costs GPT-2 355M about 11 ms a step on an H100 (7% of its
    step time), which the harness-fidelity benchmark caught: it is there to compare, not to default to."""
    flags = IMPL_FLAGS[impl]
    if cfg.algorithm == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **flags
        )
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **flags,
    )


def place_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put every optimizer-state tensor where torch's own load_state_dict would: beside its parameter, and a
    `step` on the parameter's device in float32 where the group is fused or capturable (a host scalar
    otherwise, left as it is). A load that writes state by hand, as DeepSpeed's universal checkpoint does,
    leaves `step` on the host, where torch's fused AdamW refuses the first step ("state_steps is on cpu").
    Every state counts, also of parameters in no group now: ZeRO-3 puts one sub-group's partition at a time
    into the optimizer's groups, and its state stays keyed by the others."""
    flags = [bool(g.get("fused") or g.get("capturable")) for g in optimizer.param_groups]
    on_device = {id(p): f for g, f in zip(optimizer.param_groups, flags, strict=True) for p in g["params"]}
    for p, state in optimizer.state.items():
        if not isinstance(p, torch.Tensor):
            continue
        step_on_device = on_device.get(id(p), bool(flags) and all(flags))
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step":
                if step_on_device:
                    state[key] = value.to(device=p.device, dtype=torch.float32)
            elif value.device != p.device:
                state[key] = value.to(device=p.device)


def build_scheduler(opt: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over `lr_warmup_steps`: makes LR state part of what a checkpoint must restore."""
    return torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=0.25, end_factor=1.0, total_iters=max(1, cfg.lr_warmup_steps)
    )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard or wrap one by one: HF `_no_split_modules` classes, else ModuleList children."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > 1:
                blocks = list(m)
                break
    return blocks


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in backward instead of keeping its activations, the way users of
    transformers models switch it on whatever wraps the model next (DDP, FSDP, DeepSpeed), with torch's
    non-reentrant checkpoint, which composes with all three. transformers 5 names it
    activation_checkpointing_enable; gradient_checkpointing_enable is the older name of the same switch."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    older = getattr(model, "gradient_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    elif older is not None:
        older(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ConfigError(
            f"activation checkpointing needs a transformers model (activation_checkpointing_enable); "
            f"{type(model).__name__} has none: checkpoint its blocks in the factory, or drop the option"
        )


def maybe_compile(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """torch.compile each transformer block in place (the granularity FSDP and DDP both compose with)."""
    if cfg.compile:
        for block in transformer_blocks(model) or [model]:
            block.compile()
    return model


class Trainer(ABC):
    """One rank's view of a model and optimizer wrapped by a strategy."""

    #: True when this strategy runs bf16 through torch.autocast (single, DDP); False when the
    #: wrapper owns the precision policy (FSDP MixedPrecisionPolicy, DeepSpeed's bf16 section). fp16 runs
    #: through torch.autocast over fp32 parameters in every torch-native strategy (see make_grad_scaler).
    autocast_bf16: bool = True
    #: Torch-native strategies set these; optimizer_step uses them.
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    model: nn.Module  # the wrapped model the torch-native strategies train

    def __init__(self, ctx: RankContext, cfg: RunConfig, model: nn.Module) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.steps_done = 0
        self.optimizer_impl = ""  # set by make_optimizer: the AdamW implementation results record
        self.grad_norms: list[torch.Tensor] = []  # per step, before clipping, when the run clips
        self.loss_scales: list[float] = []  # fp16: the loss scale each step ran with
        self.skipped_steps: list[bool] = []  # fp16: whether each step was skipped for an overflow
        self.scaler = self.make_grad_scaler() if cfg.precision == "fp16" else None

    def make_grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16's dynamic loss scaling, the way users of torch-native strategies run it: torch's GradScaler
        (doubling after loss_scale_window clean steps, halving on an overflow, whose step it skips). It serves
        FSDP2 too: unscale_ on DTensor gradients unscales the local shards and max-reduces the found-inf flag
        over the mesh (DTensor's handler of _amp_foreach_non_finite_check_and_unscale_), so every rank skips
        together. FSDP1 takes its ShardedGradScaler; DeepSpeed scales inside its engine (None)."""
        return torch.amp.GradScaler(
            self.ctx.device_type,
            init_scale=2.0**self.cfg.loss_scale_power,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=self.cfg.loss_scale_window,
        )

    def make_optimizer(
        self, params, *, offload: bool = False, no_fused: str | None = None
    ) -> torch.optim.Optimizer:
        """The run's optimizer (cfg.algorithm) over the trainable ones of `params` (see `optimizer_impl`;
        `no_fused` is the strategy's reason fused cannot run), remembering which implementation it is.
        Frozen parameters (LoRA's base weights) get no optimizer state, so checkpoints and ZeRO's partitions
        hold the adapters' alone."""
        trainable = [p for p in params if p.requires_grad]
        if (
            no_fused is None
            and self.cfg.algorithm == "sgd"
            and any(isinstance(p, DTensor) for p in trainable)
        ):
            # torch 2.11 registers no DTensor sharding rule for aten._fused_sgd_ (found on an H200)
            no_fused = "torch's fused SGD has no DTensor (FSDP2) support"
        self.optimizer_impl = optimizer_impl(
            self.cfg, self.ctx.device_type, offload=offload, no_fused=no_fused
        )
        return build_optimizer(trainable, self.cfg, self.optimizer_impl)

    def trained_module(self) -> nn.Module:
        """The module whose parameters this rank trains and computes with (DeepSpeed's is its engine's)."""
        return self.model

    # --- what each strategy provides -------------------------------------------------------------
    @abstractmethod
    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        """Forward and backward one micro-batch, scaled for accumulation; return its detached mean loss.
        `sync` is False on all but the last micro-batch of a step: strategies skip gradient sync then."""

    def clip_gradients(self) -> torch.Tensor | None:
        """Clip the step's gradients to the run's `clip_grad_norm` by their GLOBAL norm, the way the strategy's
        users do (torch's clip_grad_norm_, which handles FSDP2's DTensors; FSDP1 and DeepSpeed override), and
        return that norm before clipping (None when the run does not clip)."""
        if not self.cfg.clip_grad_norm:
            return None
        norm = torch.nn.utils.clip_grad_norm_(self.clip_parameters(), self.cfg.clip_grad_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters whose gradients are clipped together (the wrapped model's)."""
        return self.optimizer_parameters()

    def optimizer_parameters(self) -> Iterator[nn.Parameter]:
        return (p for group in self.optimizer.param_groups for p in group["params"])

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients, step the LR schedule, zero the gradients (torch-native
        strategies; DeepSpeed's engine does all three itself). Under fp16 the scaler skips a step whose
        gradients overflowed, and the LR schedule stays where it was then, as DeepSpeed and HF's Trainer do;
        reading the scale back costs a host sync per step, as it does them."""
        if self.scaler is None:
            self.optimizer.step()
            self.scheduler.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale  # the scale backs off exactly when the step was skipped
            self.record_loss_scale(scale, skipped)
            if not skipped:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def record_loss_scale(self, scale: float, skipped: bool) -> None:
        self.loss_scales.append(float(scale))
        self.skipped_steps.append(bool(skipped))

    def unscale_gradients(self) -> None:
        """Under fp16, divide the step's gradients by the loss scale (noting any overflow) before anything
        reads them: clipping must see the true norm, and captured gradients the reference's."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) model parameters as CPU fp32 tensors, on every rank; keys as in the bare model."""

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients (CPU fp32) keyed like `named_parameters()` of the bare model, taken after the
        last micro-batch and before the optimizer step; every rank gets them."""
        raise NotImplementedError(f"{type(self).__name__} does not expose gradients")

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, scheduler, RNG and data position in this strategy's native format."""

    @abstractmethod
    def load_checkpoint(self, path: str, *, reshard: bool = False) -> None:
        """Restore everything `save_checkpoint` wrote; raise CheckpointError on a bad checkpoint. `reshard`
        accepts a checkpoint saved at another world size, where the strategy's format allows it."""

    def close(self) -> None:  # noqa: B027 - optional hook, most strategies hold nothing to release
        """Release what the strategy holds (engines, process groups it created)."""

    # --- shared ------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision == "fp16":
            return torch.autocast(self.ctx.device_type, dtype=torch.float16)
        if (self.cfg.precision == "bf16" and self.autocast_bf16) or self.cfg.precision == "bf16-amp":
            return torch.autocast(self.ctx.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def accumulate(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Forward and backward one micro-batch through `model` with the loss scaled by 1/accum_steps, so
        the accumulated gradient is the global-batch mean; returns the micro-batch's detached mean loss."""
        with self.autocast():
            logits = model_logits(model, batch["input_ids"])
        loss = lm_loss(logits, batch["labels"])
        scaled = loss / self.cfg.accum_steps
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def step(self, micro_batches: list[Batch], capture_grads: bool = False) -> float:
        """One optimizer step over this rank's micro-batches; returns the global-batch mean loss.
        With `capture_grads`, keeps `full_grads()` of this step in `self.last_grads`."""
        return float(global_mean(self.ctx, self.step_async(micro_batches, capture_grads)).item())

    def step_async(self, micro_batches: list[Batch], capture_grads: bool = False) -> torch.Tensor:
        """`step` without reading the loss back or averaging it over ranks: this rank's mean loss stays a
        device scalar, so timed windows keep the host's run-ahead as a user's training loop does (`.item()`
        every step would drain the queue) and add no collective of their own to the step."""
        total = torch.zeros((), device=self.ctx.device, dtype=torch.float64)
        n = len(micro_batches)
        for i, mb in enumerate(micro_batches):
            with self.sample_streams(mb):
                total += self.forward_backward(mb, sync=(i == n - 1)).double()
        self.unscale_gradients()
        if capture_grads:
            self.last_grads = self.full_grads()  # before clipping: what the step's backward produced
        norm = self.clip_gradients()
        self.optimizer_step()
        if norm is None:
            norm = self.grad_norm_after_step()
        if norm is not None:
            self.grad_norms.append(norm.detach())
        self.steps_done += 1
        return total / n

    def sample_streams(self, batch: Batch) -> contextlib.AbstractContextManager:
        """Under dropout, name the micro-batch's samples by their global index for its forward and backward
        (recomputation included), so each sample's masks come from its own stream whichever rank, micro-batch
        or resume runs it (workloads/dropout.py)."""
        if not self.cfg.dropout:
            return contextlib.nullcontext()
        return sample_streams(self.cfg.seed, self.steps_done, batch["sample_index"].tolist())

    def grad_norm_after_step(self) -> torch.Tensor | None:
        """The pre-clip global norm of a strategy that clips inside its optimizer step (DeepSpeed)."""
        return None

    def extra_state(self) -> dict[str, Any]:
        """Harness state a resume needs besides model and optimizer: data position, this rank's global random
        generators (workloads/global_rng.py), fp16's loss scale."""
        state = {"steps_done": self.steps_done, "rng": global_rng.capture()}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_progress(self, state: dict[str, Any]) -> None:
        """What any resume restores from a rank's extra state, one at another world size included (whose RNG
        is fresh): the data position and fp16's loss scale, the same on every rank."""
        self.steps_done = int(state["steps_done"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])

    def seal_checkpoint(self, path: str) -> None:
        """End of every save: once all ranks have written, rank 0 records each file's digest (see
        checkpoint_files.py), and no rank returns before it has."""
        if self.ctx.world_size > 1:
            dist.barrier()
        if self.ctx.rank == 0:
            write_manifest(path)
        if self.ctx.world_size > 1:
            dist.barrier()

    def save_extra_state(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.extra_state(), os.path.join(path, f"extra_rank{self.ctx.rank}.pt"))

    def restore_extra_state(self, path: str) -> None:
        """This rank's extra state, its random generators last: after the strategy's own load, whatever that
        drew, so training goes on from the generators the save left."""
        f = os.path.join(path, f"extra_rank{self.ctx.rank}.pt")
        state = torch_load(f)
        self.load_progress(state)
        try:
            global_rng.restore(state["rng"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint file {f} holds no usable random generator state ({type(e).__name__}: {e}); "
                "it was saved by an older distbench or damaged: re-save the checkpoint"
            ) from None


def global_mean(ctx: RankContext, value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over ranks (an all-reduce enqueued on the device, no host wait)."""
    if ctx.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= ctx.world_size
    return value


def torch_load(path: str, **kw: Any) -> Any:
    """torch.load with weights_only=True and errors that say which file is bad and why."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing; was the checkpoint saved completely?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except Exception as e:  # torch raises RuntimeError/EOFError/UnpicklingError for damaged files
        raise CheckpointError(
            f"cannot read checkpoint file {path}: {type(e).__name__}: {first_line(str(e))} "
            "(truncated or corrupted; re-save it)"
        ) from e


@contextlib.contextmanager
def no_sync_if(module: nn.Module, skip: bool) -> Iterator[None]:
    """DDP's no_sync() when `skip` is true, else nothing."""
    no_sync = getattr(module, "no_sync", None) if skip else None
    if no_sync is not None:
        with no_sync():
            yield
    else:
        yield
