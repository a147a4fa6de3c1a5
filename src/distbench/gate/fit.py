"""The gate's default workload size on the card at hand: both variants' runs of a configuration resident at
once (so their timed windows interleave), at a device-bound micro-batch where the card allows it.

Predicted peak of one rank, on NVML's scale (what must fit on the card), for a strategy family and model:
    state        parameters, gradients and optimizer state as the strategy shards them (invariants/memory.py)
    + held       what the strategy holds beyond its state (buffers, the autocast cache, the CUDA context, the
                 allocator's slack), measured; plus, for fsdp_grad, the bf16 parameters it keeps gathered
    + micro-batch x per sample (activations), measured with activation checkpointing off and on
    + COMM_ALLOWANCE at two or more ranks (NCCL's buffers: an allowance, not a measurement)
The measured terms come from `distbench recommend`'s probes on one H200 at world size 1
(results/recommend-h200-2026-11-24/gpt2-large/probes.csv, NVML peaks at micro-batch 4 to 96): per family,
the steepest rise per sample between two probes, and the largest remainder of a probe without
checkpointing, so that every probe lies at or under the model (tests/test_gate.py reads them from the
file): 0-11% over the probes without checkpointing, 6-32% over them with it.
The issue that asked for this measured DDP at world size 2 on an 80 GB H100: micro-batch 16 out of memory,
micro-batch 8 48.1 GiB allocated a run, too much for two.

choose() keeps the tier's micro-batch (16: on 2x H200 ddp, fsdp_grad and zero2 were device-bound there, the
device busy 0.89-1.0 of the step, zero3 host-bound at 0.56-0.75) when two runs fit; else it turns activation
checkpointing on (recomputation adds device work, so the step stays device-bound), then lowers the micro-batch
until two runs fit; a configuration where even one micro-batch does not fit twice runs alone at the largest
that fits once (the gate then alternates whole runs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import RunConfig, label_of

GIB = 2**30

#: Share of the card's memory the two runs leave free (the model's error and the allocator's own slack).
HEADROOM = 0.05
#: Bytes a rank's NCCL communicators may take at two or more ranks: an allowance, not a measurement.
COMM_ALLOWANCE = 1 * GIB


@dataclass(frozen=True)
class Footprint:
    """One strategy family's measured memory beyond its state, in GiB: held, and per sample without and
    with activation checkpointing."""

    held: float
    per_sample: float
    per_sample_checkpointed: float


#: (family, model) -> footprint, from the probes named in the module doc.
FOOTPRINTS: dict[tuple[str, str], Footprint] = {
    ("ddp", "gpt2-774m"): Footprint(5.43, 4.90, 1.14),
    ("fsdp", "gpt2-774m"): Footprint(2.42, 3.54, 1.02),
    ("deepspeed", "gpt2-774m"): Footprint(8.49, 3.15, 1.37),
}

#: strategy -> the family whose probes stand for it (offloaded strategies have none: their state is on the host)
FAMILIES = {
    "single": "ddp",
    "ddp": "ddp",
    "fsdp_full": "fsdp",
    "fsdp_grad": "fsdp",
    "fsdp_hybrid": "fsdp",
    "fsdp1_full": "fsdp",
    "fsdp1_grad": "fsdp",
    "zero0": "deepspeed",  # the DeepSpeed engine's own buffers, its state replicated (the memory model's term)
    "zero1": "deepspeed",
    "zero2": "deepspeed",
    "zero3": "deepspeed",
}


def predicted_peak(cfg: RunConfig, n_params: int, footprint: Footprint | None = None) -> float | None:
    """Predicted peak device bytes of one rank of `cfg` (module doc), None where nothing was measured;
    `footprint`: another model's measured terms in place of cfg.model's (bounding_peak)."""
    from ..invariants.memory import analytic_bytes
    from ..workloads import get_model

    family = FAMILIES.get(cfg.strategy)
    fp = footprint or FOOTPRINTS.get((family or "", get_model(cfg.model).name))
    if fp is None:
        return None
    replicate = cfg.options.get("replicate")
    state = sum(
        analytic_bytes(cfg.strategy, n_params, cfg.world_size, cfg.precision, replicate=replicate).values()
    )
    gathered = 2 * n_params * (1 - 1 / cfg.world_size) if cfg.strategy in ("fsdp_grad", "fsdp1_grad") else 0
    per_sample = fp.per_sample_checkpointed if cfg.activation_checkpointing else fp.per_sample
    comm = COMM_ALLOWANCE if cfg.world_size > 1 else 0
    return state + gathered + (fp.held + cfg.micro_batch * per_sample) * GIB + comm


def bounding_peak(cfg: RunConfig, n_params: int) -> float | None:
    """predicted_peak, or for a model without probes of its own, the prediction with the footprint of its
    family's smallest probed model at least as large (its buffers and activations per sample are no smaller):
    an upper bound for placing several small runs on one card (the numerics' gpt2-124m runs), too loose to
    size a timed run by. None where no probed model of the family is as large."""
    from ..workloads import get_model

    peak = predicted_peak(cfg, n_params)
    family = FAMILIES.get(cfg.strategy)
    if peak is not None or family is None:
        return peak
    probed = sorted((get_model(m).param_count(), m) for f, m in FOOTPRINTS if f == family)
    larger = [m for count, m in probed if count >= n_params]
    return predicted_peak(cfg, n_params, FOOTPRINTS[(family, larger[0])]) if larger else None


def fits(peak: float, card: int, runs: int) -> bool:
    """Whether `runs` runs of `peak` bytes each fit on a card of `card` bytes, HEADROOM left free."""
    return runs * peak <= (1 - HEADROOM) * card


def choose(cfg: RunConfig, n_params: int, card: int | None) -> RunConfig:
    """`cfg`, or the nearest size to it whose two runs fit at once on a card of `card` bytes, else one run
    (module doc); `cfg` itself where there is no card or no model for it."""
    if card is None or predicted_peak(cfg, n_params) is None:
        return cfg
    sizes = [cfg, cfg.replace(activation_checkpointing=True)] + [
        cfg.replace(activation_checkpointing=True, micro_batch=mb, global_batch=mb * cfg.world_size)
        for mb in range(cfg.micro_batch - 1, 0, -1)
    ]
    for runs in (2, 1):
        for c in sizes:
            if fits(predicted_peak(c, n_params) or 0.0, card, runs):
                return c
    return cfg


def describe(cfg: RunConfig, n_params: int, card: int | None) -> str:
    """The report's line on a configuration's size: what the memory model predicts of it on this card."""
    what = label_of(cfg)
    peak = predicted_peak(cfg, n_params)
    if peak is None or card is None:
        return f"{what}: no memory model for it, or no card to hold it against"
    runs = "two runs resident at once" if fits(peak, card, 2) else "one run at a time"
    return (
        f"{what}: {peak / GIB:.1f} GiB a run predicted by the memory model (gate/fit.py), {runs} on "
        f"this {card / GIB:.1f} GiB card"
    )


@functools.lru_cache
def n_params(model: str) -> int:
    """The model's parameter count (ModelSpec.param_count)."""
    from ..workloads import get_model

    return get_model(model).param_count()


def card_bytes() -> int | None:
    """The smallest GPU's memory on this machine, as NVML counts it (the scale of the measured peaks);
    None without NVML."""
    from ..machine import nvml

    nv = nvml()
    if nv is None:
        return None
    try:
        totals = [
            int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).total)
            for i in range(nv.nvmlDeviceGetCount())
        ]
    except Exception:
        return None
    return min(totals) if totals else None
