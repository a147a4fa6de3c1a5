"""The harness-fidelity benchmark: the harness's Trainer against a bare loop doing the same work.

harness_overhead(ctx, cfg, steps) trains cfg's strategy twice in the same ranks, on the same data from the same
weights: once through distbench's Trainer, once through a loop written from the libraries' own documentation,
sharing nothing with distbench/strategies/ but the table that spells each AdamW implementation (and the
teardown of DeepSpeed engines, after the timing). If the harness costs throughput that users would not pay (the
per-parameter AdamW loop once cost 7%), the overhead shows it. It times performance configurations only
(deterministic=False, as users train): the parity settings change what the harness runs (DDP's
find_unused_parameters) and the bare loops do not follow them.

The bare loops, one per strategy:

* single: forward under autocast (bf16), token-mean cross-entropy in fp32, backward scaled for accumulation,
  torch.optim.AdamW, zero_grad.
* ddp: the same through DistributedDataParallel, no_sync() on all but the last micro-batch.
* fsdp_grad / fsdp_full: fully_shard on each transformer block then the root, reshard_after_forward False /
  True, MixedPrecisionPolicy(bf16 parameters, fp32 reduction) under bf16, set_requires_gradient_sync(False)
  on all but the last micro-batch.
* zero2 / zero3: deepspeed.initialize with the torch AdamW and a config of the stage, batch sizes, bf16 and
  no clipping; engine(input_ids), loss, engine.backward(loss), engine.step() per micro-batch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import BF16_COMPUTE, RunConfig
from ..errors import ConfigError
from ..measure.pygc import GcWatch
from ..measure.roundparts import Readings, timed_parts
from ..runtime import worker
from ..runtime.context import RankContext
from ..strategies import build_trainer
from ..strategies.base import IMPL_FLAGS, Trainer
from ..workloads.data import rank_micro_batches
from ..workloads.models import get_model
from .train import set_numerics

Batch = dict[str, torch.Tensor]

STATE_KEY = "fidelity"
#: DeepSpeed's default bucket size in elements; the harness caps it at the model's size (see _zero).
DS_DEFAULT_BUCKET = 500_000_000


@dataclass
class BareLoop:
    """One optimizer step of the bare loop (this rank's mean loss, left on the device), and its teardown."""

    step: Callable[[list[Batch]], torch.Tensor]
    close: Callable[[], None] = lambda: None


@dataclass
class Fidelity:
    """A harness Trainer and its bare loop built side by side in one rank, on the same weights and the same
    `steps` steps of this rank's data, timed in rounds of alternating order (bare first in even rounds)."""

    ctx: RankContext
    cfg: RunConfig
    trainer: Trainer
    bare: BareLoop
    data: list[list[Batch]]
    tokens: int  # per round and side, over every rank
    first_step_loss: dict[str, float]
    done: int = 0  # rounds run so far

    @classmethod
    def build(cls, ctx: RankContext, cfg: RunConfig, steps: int, warmup: int = 2) -> Fidelity:
        """Both loops built and warmed up; their first step's global-batch losses must agree (the same work)."""
        make_bare = _bare_loop_for(cfg)
        if cfg.world_size != ctx.world_size:
            raise ConfigError(
                f"harness_overhead of a world-size-{cfg.world_size} configuration ran in {ctx.world_size} "
                f"rank(s): run it in a pool of {cfg.world_size}"
            )
        set_numerics(cfg)
        spec = get_model(cfg.model)
        seq_len = cfg.seq_len or spec.seq_len
        data = [
            rank_micro_batches(cfg, s, ctx.rank, seq_len, spec.vocab_size, ctx.device) for s in range(steps)
        ]
        # The harness first: building it also points DeepSpeed at the rank's device (its CPU accelerator here).
        trainer = build_trainer(ctx, cfg, spec.build(cfg.seed, ctx.device))
        try:
            bare = make_bare(ctx, cfg, spec.build(cfg.seed, ctx.device), trainer.optimizer_impl)
        except BaseException:
            trainer.close()
            raise
        f = cls(ctx, cfg, trainer, bare, data, steps * cfg.global_batch * seq_len, {})
        try:
            f.first_step_loss = {
                "bare": float(_global_mean(ctx, bare.step(data[0]))),
                "harness": trainer.step(data[0]),
            }
            for i in range(1, warmup):  # the steps again when there are fewer steps than warm-up steps
                bare.step(data[i % steps])
                trainer.step_async(data[i % steps])
        except BaseException:
            f.close()
            raise
        return f

    def rounds(self, n: int) -> list[dict[str, float]]:
        """`n` more rounds: each loop's seconds for the `steps` steps (`bare_s`, `harness_s`), and what explains
        them (measure/roundparts.py), each on the slowest rank."""
        loops = {
            "bare": lambda: [self.bare.step(mbs) for mbs in self.data],
            "harness": lambda: [self.trainer.step_async(mbs) for mbs in self.data],
        }
        got: list[dict[str, float]] = []
        readings = Readings(self.ctx)
        for r in range(self.done, self.done + n):
            row: dict[str, float] = {}
            sides = ("bare", "harness") if r % 2 == 0 else ("harness", "bare")
            # The collector stays out of the round, as out of bench windows: it ran 352 ms in one side of one
            # fsdp_grad round on an H200, a 60% outlier. The watch times what runs anyway (gc.collect calls).
            collector = GcWatch(keep_collector=False).start()
            try:
                readings.start()
                for name in sides:
                    if self.ctx.world_size > 1:
                        dist.barrier()  # every rank starts the round together
                    row.update({f"{name}_{k}": v for k, v in timed_parts(self.ctx, loops[name]).items()})
                    collector.step()
                row.update(readings.stop())
            finally:
                gc_s = collector.stop()["step_seconds"]
            row.update({f"{name}_gc_s": s for name, s in zip(sides, gc_s, strict=True)})
            got.append(row)
        self.done += n
        return _slowest(self.ctx, got)

    def close(self) -> None:
        try:
            self.bare.close()
        finally:
            self.trainer.close()  # after the bare loop's: DDP's close frees both wrappers' finished all-reduces
            gc.collect()
            if self.ctx.is_cuda:
                torch.cuda.empty_cache()

    def summary(self, rounds: list[dict[str, float]]) -> dict[str, Any]:
        """The rounds, their medians as step times and throughputs, and the geometric-mean overhead."""
        steps = len(self.data)
        med = {k: statistics.median(r[f"{k}_s"] for r in rounds) for k in ("bare", "harness")}
        return {
            "strategy": self.cfg.strategy,
            "world_size": self.cfg.world_size,
            "steps": steps,
            "rounds": rounds,
            "bare_step_time_s": med["bare"] / steps,
            "harness_step_time_s": med["harness"] / steps,
            "bare_tokens_per_s": self.tokens / med["bare"],
            "harness_tokens_per_s": self.tokens / med["harness"],
            "overhead": statistics.geometric_mean(r["harness_s"] / r["bare_s"] for r in rounds) - 1.0,
            "first_step_loss": self.first_step_loss,
        }


def harness_overhead(
    ctx: RankContext, cfg: RunConfig, steps: int, rounds: int = 3, warmup: int = 2
) -> dict[str, Any]:
    """Throughput of cfg's strategy through the harness's Trainer against its bare loop, in every rank.

    Both train their own copy of the same model (spec.build(seed)) on the same `steps` steps of this rank's
    data, neither synchronizing inside its timed loop (the harness through Trainer.step_async), in `rounds`
    rounds whose order alternates (bare first, then harness first, ...) so clock and thermal drift cancel. A
    round lasts as long as its slowest rank. overhead = the geometric mean over rounds of harness time / bare
    time in that round, minus 1 (positive: the harness is slower); `rounds` holds every round's pair, from
    which a caller takes the overhead's interval, since a bound holds only where the interval's top is under
    it. `first_step_loss` (global-batch means) must agree between the two: it shows both do the same work.
    To add rounds until a claim is decided, keep the pair in the ranks: fidelity_setup, fidelity_rounds,
    fidelity_finish.
    """
    f = Fidelity.build(ctx, cfg, steps, warmup)
    try:
        return f.summary(f.rounds(rounds))
    finally:
        f.close()


def fidelity_setup(ctx: RankContext, cfg: RunConfig, steps: int, warmup: int = 2) -> dict[str, Any]:
    """Build the pair and keep it in the rank (worker.STATE) for fidelity_rounds; the first step's losses."""
    fidelity_finish(ctx)  # a pair an interrupted test left
    f = worker.STATE[STATE_KEY] = Fidelity.build(ctx, cfg, steps, warmup)
    return {"first_step_loss": f.first_step_loss}


def fidelity_rounds(ctx: RankContext, rounds: int = 1) -> dict[str, Any]:
    """`rounds` more rounds of the kept pair, and the summary of these rounds."""
    f: Fidelity = worker.STATE[STATE_KEY]
    return f.summary(f.rounds(rounds))


def fidelity_finish(ctx: RankContext) -> None:
    """Close the kept pair, if any."""
    f = worker.STATE.pop(STATE_KEY, None)
    if f is not None:
        f.close()


def _bare_loop_for(cfg: RunConfig) -> Callable[[RankContext, RunConfig, nn.Module, str], BareLoop]:
    """The bare loop of cfg's strategy; ConfigError where there is none, or where cfg asks for something the
    bare loops do not do (the two would then not do the same work)."""
    if cfg.strategy not in BARE_LOOPS:
        raise ConfigError(
            f"harness_overhead has no bare loop for {cfg.strategy!r}; it runs {', '.join(BARE_LOOPS)}"
        )
    extras = {
        "deterministic": cfg.deterministic,
        "precision": cfg.precision if cfg.precision not in ("fp32", *BF16_COMPUTE) else None,
        "algorithm": cfg.algorithm if cfg.algorithm != "adamw" else None,
        "compile": cfg.compile,
        "activation_checkpointing": cfg.activation_checkpointing,
        "dropout": cfg.dropout,
        "lora_rank": cfg.lora_rank,
        "clip_grad_norm": cfg.clip_grad_norm,
        "options": cfg.options,
    }
    asked = [f"{k}={v!r}" for k, v in extras.items() if v]
    if asked:
        raise ConfigError(
            "harness_overhead's bare loops train plain AdamW in fp32 or bf16, as users run performance "
            f"configurations; this configuration also sets {', '.join(asked)}: drop them"
        )
    return BARE_LOOPS[cfg.strategy]


def _global_mean(ctx: RankContext, local: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of this rank's loss."""
    out = local.detach().clone()
    if ctx.world_size > 1:
        dist.all_reduce(out)
        out /= ctx.world_size
    return out


def _slowest(ctx: RankContext, rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each round's figures on the slowest rank, field by field (the same list on every rank)."""
    if ctx.world_size == 1:
        return rows
    keys = sorted(rows[0])
    t = torch.tensor([[row[k] for k in keys] for row in rows], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [dict(zip(keys, (float(x) for x in row), strict=True)) for row in t.tolist()]


def _adamw(params: Iterator[nn.Parameter], cfg: RunConfig, impl: str) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **IMPL_FLAGS[impl]
    )


def _loss(model: nn.Module, mb: Batch) -> torch.Tensor:
    """Token-mean next-token cross-entropy of one micro-batch, in fp32 over the logits."""
    out = model(input_ids=mb["input_ids"])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), mb["labels"].reshape(-1))


def _torch_loop(
    ctx: RankContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sync: Callable[[bool], contextlib.AbstractContextManager],
    autocast: bool,
) -> BareLoop:
    """The loop of the torch-native strategies: `sync(last)` wraps each micro-batch's forward and backward
    (the wrapper's switch for skipping gradient sync), autocast to bf16 where the wrapper owns no precision."""

    def amp() -> contextlib.AbstractContextManager:
        return torch.autocast(ctx.device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def step(mbs: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=ctx.device)
        for i, mb in enumerate(mbs):
            with sync(i == len(mbs) - 1):
                with amp():
                    loss = _loss(model, mb)
                (loss / len(mbs)).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(mbs)

    return BareLoop(step)


def _single(ctx: RankContext, cfg: RunConfig, model: nn.Module, impl: str) -> BareLoop:
    opt = _adamw(model.parameters(), cfg, impl)
    return _torch_loop(ctx, model, opt, lambda last: contextlib.nullcontext(), cfg.precision in BF16_COMPUTE)


def _ddp(ctx: RankContext, cfg: RunConfig, model: nn.Module, impl: str) -> BareLoop:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    opt = _adamw(ddp.parameters(), cfg, impl)

    def sync(last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else ddp.no_sync()

    return _torch_loop(ctx, ddp, opt, sync, cfg.precision in BF16_COMPUTE)


def _fsdp(
    ctx: RankContext, cfg: RunConfig, model: nn.Module, impl: str, *, reshard_after_forward: bool
) -> BareLoop:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ConfigError(
            f"the bare FSDP loop shards the transformer blocks a transformers model names in _no_split_modules; "
            f"{cfg.model} names none"
        )
    mesh = init_device_mesh(ctx.device_type, (ctx.world_size,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp}
    for block in blocks:
        fully_shard(block, **kw)
    root = fully_shard(model, **kw)
    opt = _adamw(model.parameters(), cfg, impl)

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        root.set_requires_gradient_sync(last)
        yield

    return _torch_loop(ctx, model, opt, sync, autocast=cfg.precision == "bf16-amp")


def _zero(ctx: RankContext, cfg: RunConfig, model: nn.Module, impl: str, *, stage: int) -> BareLoop:
    """The engine as DeepSpeed's docs build it, around the torch AdamW the harness hands it too (ZeRO wants
    zero_allow_untested_optimizer for that). Bucket sizes as the harness sets them, DeepSpeed's default capped
    at the model's size: the same collectives, without a 2 GB bucket to zero on the CPU tier."""
    os.environ.setdefault("DS_ACCELERATOR", ctx.device_type)
    import deepspeed

    from ..strategies.deepspeed import destroy_engine  # teardown only: DeepSpeed keeps ZeRO-3 engines alive
    from ..strategies.ds_config import torch_autocast_section

    bucket = max(1, min(DS_DEFAULT_BUCKET, sum(p.numel() for p in model.parameters())))
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.accum_steps,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "bf16": {"enabled": cfg.precision == "bf16"},
        "torch_autocast": torch_autocast_section(cfg),
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=_adamw(model.parameters(), cfg, impl), config=config
    )

    def step(mbs: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=ctx.device)
        for mb in mbs:
            loss = _loss(engine, mb)
            engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.detach()
        return total / len(mbs)

    def close() -> None:
        nonlocal engine
        destroy_engine(engine)
        del engine
        gc.collect()

    return BareLoop(step, close)


#: The bare loop of each strategy harness_overhead measures.
BARE_LOOPS: dict[str, Callable[[RankContext, RunConfig, nn.Module, str], BareLoop]] = {
    "single": _single,
    "ddp": _ddp,
    "fsdp_grad": partial(_fsdp, reshard_after_forward=False),
    "fsdp_full": partial(_fsdp, reshard_after_forward=True),
    "zero2": partial(_zero, stage=2),
    "zero3": partial(_zero, stage=3),
}
