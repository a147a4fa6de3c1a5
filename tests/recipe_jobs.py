"""Rank jobs for the recipe tests: the train job (and the reference), watched or disturbed from outside the code
under test.

The rank processes import this module by name (pytest puts this directory on the spawned ranks' sys.path)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

import distbench.jobs.train as jobs
from distbench.config import RunConfig
from distbench.invariants.reference import reference_run

#: The LoRA the tests train: rank 4 on the family's default targets, alpha 8 (scale 2, not 1, so a scale
#: applied twice or not at all shows), 4 steps (the CPU tier's time): the half-way checkpoint, after step 2,
#: holds optimizer state for B and A alike (A's first gradient comes at step 2, B starting at zero).
LORA: dict[str, Any] = {"lora_rank": 4, "lora_alpha": 8, "steps": 4}


#: bf16 runs: a learning rate below half an ulp of a bf16 weight of GPT-2's initial scale (0.02: ulp 2^-13 =
#: 1.2e-4): fp32 master weights keep every update, bf16 master weights round most of them away.
BF16: dict[str, Any] = {"precision": "bf16", "lr": 3e-5}


def refuses_lora(strategy: str, world_size: int) -> bool:
    """Where the strategy refuses LoRA (strategies/fsdp1.py LORA_ONE_RANK_WHY): FSDP1 on one rank."""
    from distbench.strategies import get_spec

    return get_spec(strategy).trainer_module == "fsdp1" and world_size == 1


def train_counting_attention_forwards(ctx: Any, **kwargs: Any) -> dict[str, Any]:
    """jobs.train, plus how often each attention module ran forward (a global forward hook, so no trainer code
    is involved): once per micro-batch, and again in backward where activation checkpointing recomputes the
    block (torch's non-reentrant checkpoint stops recomputing once it has what backward needs, so the
    attention, early in the block, is the module that always runs again)."""
    calls: dict[int, int] = {}

    def count(module: torch.nn.Module, args: Any, out: Any) -> None:
        if type(module).__name__.endswith("Attention"):
            calls[id(module)] = calls.get(id(module), 0) + 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        out = jobs.train(ctx, **kwargs)
    finally:
        handle.remove()
    return {**out, "attention_modules": len(calls), "attention_forwards": sorted(set(calls.values()))}


def train_recording_forward_end_memory(ctx: Any, **kwargs: Any) -> dict[str, Any]:
    """jobs.train, plus the device memory allocated when the LM head is about to run: every block's forward
    has run and what autograd keeps of it is held, and nothing of backward exists yet. Also the step's peak.
    A global forward pre-hook on the head (the Linear whose outputs are the vocabulary), outside the trainer."""
    from distbench.workloads import get_model

    vocab = get_model(kwargs["cfg"].model).vocab_size
    seen: list[int] = []

    def record(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, torch.nn.Linear) and module.out_features == vocab:
            seen.append(torch.cuda.memory_allocated(ctx.device))

    torch.cuda.reset_peak_memory_stats(ctx.device)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        out = jobs.train(ctx, **kwargs)
    finally:
        handle.remove()
    assert seen, "the LM head never ran: no Linear with the vocabulary as its outputs"
    return {**out, "forward_end_bytes": seen[-1], "peak_bytes": torch.cuda.max_memory_allocated(ctx.device)}


def _inf_at_first_element(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[(0,) * grad.dim()] = math.inf
    return grad


@contextlib.contextmanager
def _overflow_at(forward: int | None) -> Iterator[None]:
    """Inside, the `forward`-th run (0-based; None: none) of the first nn.Embedding to run puts inf into one
    element of its output's gradient, so one token's embedding row gets an inf gradient: an fp16 overflow in
    one micro-batch, on one rank, planted without the code under test knowing."""
    seen: dict[str, Any] = {"module": None, "count": 0}

    def plant(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if not isinstance(module, torch.nn.Embedding) or seen["module"] not in (None, id(module)):
            return
        seen["module"] = id(module)
        if seen["count"] == forward:
            out.register_hook(_inf_at_first_element)
        seen["count"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(plant)
    try:
        yield
    finally:
        handle.remove()


def _global_norm(grads: list[torch.Tensor], sharded: bool) -> float:
    """The 2-norm of a whole model's gradients from one rank's view of them: DTensors (FSDP2) reduce themselves;
    plain tensors are the whole gradient (replicas) or, where `sharded`, this rank's disjoint share of it (FSDP1's
    flat shards, ZeRO's partitions), whose squares are summed over the ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if grads and isinstance(grads[0], DTensor):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return float(norm.full_tensor())
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        squares += g.detach().double().pow(2).sum().to(device)
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squares)
    return float(squares.sqrt())


@contextlib.contextmanager
def _stepped_gradient_norms(cfg: RunConfig, norms: list[float]) -> Iterator[None]:
    """Inside, every torch optimizer step appends to `norms` the global norm of the gradients it is about to
    apply: after whatever unscaling and clipping the trainer or its library did (DeepSpeed's engine calls the
    torch AdamW it was given on its unscaled, clipped fp32 partitions; a step skipped for an overflow calls it not
    at all), whatever norm the trainer reports. A torch optimizer step pre-hook: outside the code under test.
    One call per optimizer step: ZeRO-3 would call it once per parameter sub-group, of which these models have
    one."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from distbench.strategies import get_spec

    layout = get_spec(cfg.strategy).memory
    sharded = layout is not None and "optimizer" in layout.sharded

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(_global_norm(grads, sharded))

    handle = register_optimizer_step_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()


def train_watching_steps(ctx: Any, cfg: RunConfig, **kwargs: Any) -> dict[str, Any]:
    """jobs.train, and the global norm of the gradient each optimizer step applied (`stepped_norms`)."""
    stepped: list[float] = []
    with _stepped_gradient_norms(cfg, stepped):
        out = jobs.train(ctx, cfg=cfg, **kwargs)
    return {**out, "stepped_norms": stepped}


def train_with_an_overflow(
    ctx: Any, cfg: RunConfig, step: int, micro_batch: int, **kwargs: Any
) -> dict[str, Any]:
    """train_watching_steps with an inf planted in the gradient of global micro-batch `micro_batch` of step `step`,
    on the rank that runs it (global micro-batches rank x accum_steps on), and the dtypes the model's matmuls
    produced (fp16 if it really computes in fp16)."""
    rank, local = divmod(micro_batch, cfg.accum_steps)
    dtypes: set[str] = set()

    def matmul_dtype(module: torch.nn.Module, args: Any, out: Any) -> None:
        if type(module).__name__ in ("Linear", "Conv1D") and isinstance(out, torch.Tensor):
            dtypes.add(str(out.dtype).removeprefix("torch."))

    handle = torch.nn.modules.module.register_module_forward_hook(matmul_dtype)
    try:
        with _overflow_at(step * cfg.accum_steps + local if ctx.rank == rank else None):
            out = train_watching_steps(ctx, cfg=cfg, **kwargs)
    finally:
        handle.remove()
    return {**out, "matmul_dtypes": sorted(dtypes)}


def reference_with_an_overflow(ctx: Any, cfg: RunConfig, step: int, micro_batch: int) -> dict[str, Any]:
    """The reference with the same inf planted (it runs every micro-batch of a step, in order)."""
    with _overflow_at(step * (cfg.global_batch // cfg.micro_batch) + micro_batch):
        out = reference_run(cfg, ctx.device)
    return {k: out[k] for k in ("losses", "loss_scales", "skipped_steps", "grad_norms")}


def saved_activation_bytes(ctx: Any, cfg: RunConfig) -> dict[str, int]:
    """Bytes autograd keeps for backward from one micro-batch's forward, counted by its saved-tensor hooks, with
    activation checkpointing off and on: an account of activation memory that neither measure/ nor the caching
    allocator takes part in. Each storage counts once; only tensors with the batch as their first dimension
    count, as weights (and autocast's casts of them) are kept either way."""
    from distbench.strategies.base import enable_activation_checkpointing, model_logits
    from distbench.workloads import get_model
    from distbench.workloads.data import rank_micro_batches

    spec = get_model(cfg.model)
    batch = rank_micro_batches(cfg, 0, ctx.rank, jobs.seq_len_of(cfg), spec.vocab_size, ctx.device)[0]
    out = {}
    for checkpointed in (False, True):
        model = spec.build(cfg.seed, ctx.device)
        if checkpointed:
            enable_activation_checkpointing(model)
        model.train()
        kept: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor, kept: dict[tuple[int, int], int] = kept) -> torch.Tensor:
            if t.dim() >= 2 and t.shape[0] == cfg.micro_batch:
                kept[(t.untyped_storage().data_ptr(), t.device.index or 0)] = t.untyped_storage().nbytes()
            # Detached: the storage stays saved (no address is reused and counted once for two tensors), but
            # not `t` itself, which for an op's own output holds the node saving it (its grad_fn): a cycle
            # through autograd's C++ graph that Python's collector cannot see, which kept the plain model and
            # its activations (6.35 GiB on an H200) alive after the job.
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
                model_logits(model, batch["input_ids"])
        out["checkpointed" if checkpointed else "plain"] = sum(kept.values())
        del model
    return out
