"""What each strategy's precision policy puts on the wire per optimizer step, and the check of a record against it.

A bf16 gradient reduction where the policy says fp32 passes every loss test at 2 ranks (inside bf16 compute
noise: tests/test_bf16.py), so the dtype is checked as a fact: each collective a step issues (recorded by
invariants/collectives.py) against the table below. The table is written here from each strategy's declared
policy and its library's documented behaviour, not read from the strategies' code: a strategy that builds
its policy wrong, or a library that stops honouring it, disagrees with it.

Per kind of collective, a step's payload (floating-point tensors of more than one element) must travel in
one dtype over groups of one size, in a number of collectives and a number of bytes within stated bounds.
Bytes are elements of the unsharded side times the dtype's size; the elements are N, the model's trainable
parameter elements, per pass over the gradients or parameters, plus at most `ModelFacts.padded`'s padding.
Scalars and integer tensors (the harness's loss, gradient norms, overflow flags, DDP's unused-parameter
bitmap) are control traffic: counted by the completeness check, not held to a dtype.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

#: A policy's name for a dtype -> the name invariants/collectives.py records ("float32", as torch spells it).
DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
FP32 = DTYPE["fp32"]

#: Padding a sharded flat layout may add per parameter tensor besides dim-0 rows: FSDP1 aligns each original
#: parameter to 16 bytes (at most 7 elements of 2 bytes), DeepSpeed pads its partitions to a multiple of
#: 2 x world size elements (at most 15 at 8 ranks, and once a group, not a tensor).
ALIGN_ELEMENTS = 16
#: DDP's default bucket sizes (DistributedDataParallel's bucket_cap_mb, and the smaller first bucket it fills
#: so that communication starts early).
DDP_BUCKET_BYTES = 25 << 20
DDP_FIRST_BUCKET_BYTES = 1 << 20
#: DeepSpeed's default reduce_bucket_size and allgather_bucket_size (elements); distbench caps both at the
#: model's parameter count (strategies/ds_config.py), so a model below it goes in one bucket.
DS_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class Traffic:
    """What one kind of collective carries per optimizer step: every payload collective of the kind in `dtype`
    over groups of `group_size` ranks, `count` of them, `elements` unsharded elements in all (bounds inclusive)."""

    dtype: str
    group_size: int
    elements: tuple[int, int]
    count: tuple[int, int]

    @property
    def bytes(self) -> tuple[int, int]:
        size = ITEMSIZE[self.dtype]
        return self.elements[0] * size, self.elements[1] * size


@dataclass(frozen=True)
class ModelFacts:
    """What the table needs of a model, counted from its parameters (build it on the meta device)."""

    elements: int  # N: trainable parameter elements, a tied weight once
    tensors: int  # trainable parameter tensors
    rows: int  # elements of one dim-0 row, summed over the tensors
    largest: int  # elements of the largest tensor
    layers: int  # transformer blocks

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if not layers:
            raise ValueError(
                f"{type(model).__name__} has no transformers config (num_hidden_layers): the wire table counts "
                "FSDP units as one per transformer block plus the root; use a built-in model"
            )
        return cls(
            elements=sum(p.numel() for p in params),
            tensors=len(params),
            rows=sum(p.numel() // p.shape[0] if p.dim() else 1 for p in params),
            largest=max(p.numel() for p in params),
            layers=int(layers),
        )

    def padded(self, shards: int) -> int:
        """The most elements a sharded layout of the N may hold: each tensor padded on dim 0 to a multiple of
        `shards` (FSDP2, DeepSpeed's ZeRO-3 partitions: at most shards - 1 rows) and ALIGN_ELEMENTS aligned."""
        return self.elements + (shards - 1) * self.rows + ALIGN_ELEMENTS * self.tensors


Table = dict[str, Traffic]


def ddp_buckets(grad_bytes: int, largest_bytes: int) -> tuple[int, int]:
    """Bounds on DDP's buckets for `grad_bytes` of gradients. A bucket closes once it holds its cap (the first
    DDP_FIRST_BUCKET_BYTES, later DDP_BUCKET_BYTES), so every bucket but the last holds at least its cap, and
    at most its cap plus the largest gradient."""
    most = (
        1
        if grad_bytes <= DDP_FIRST_BUCKET_BYTES
        else 2 + (grad_bytes - DDP_FIRST_BUCKET_BYTES - 1) // DDP_BUCKET_BYTES
    )
    least = -(-grad_bytes // (DDP_BUCKET_BYTES + largest_bytes))
    return least, most


def _ddp(precision: str, ws: int, m: ModelFacts) -> Table:
    """DDP all-reduces every gradient once a step in its parameter's dtype: parameters stay fp32 under autocast
    (bf16, fp16), so fp32 whatever the policy; exactly N elements (its buckets are views of the gradients); on
    one rank too."""
    return {
        "all_reduce": Traffic(FP32, ws, (m.elements, m.elements), ddp_buckets(4 * m.elements, 4 * m.largest))
    }


def _fsdp2(
    precision: str, ws: int, m: ModelFacts, *, reshard_after_forward: bool, replicas: int | None = None
) -> Table:
    """FSDP2, fully_shard per block and then the root: layers + 1 units. Under bf16 MixedPrecisionPolicy
    (param_dtype bf16, reduce_dtype fp32) parameters are all-gathered in bf16 and gradients reduced in fp32; fp32
    and fp16 (autocast over fp32 parameters) keep fp32. Each unit reduce-scatters once a step and all-gathers for
    forward and, when reshard_after_forward frees a block again, for backward; the root keeps its parameters
    from forward into backward (FSDP2's default for it, as torchtitan leaves it), so it gathers once. How many
    of the elements are the root's is not counted: between one and two passes over them.
    FSDP2 neither all-gathers nor reduce-scatters over a shard group of one rank (it copies); HSDP all-reduces the
    reduce-scatter's output over its `replicas` groups whatever their size (None: FSDP, no replicate
    dimension)."""
    param = DTYPE["bf16"] if precision == "bf16" else FP32
    units = m.layers + 1
    shard = ws // (replicas or 1)
    table: Table = {}
    if shard > 1:
        span = (m.elements, m.padded(shard))
        table["reduce_scatter"] = Traffic(FP32, shard, span, (units, units))
        if reshard_after_forward:  # every block twice, the root once
            table["all_gather"] = Traffic(
                param, shard, (span[0], 2 * span[1]), (2 * units - 1, 2 * units - 1)
            )
        else:
            table["all_gather"] = Traffic(param, shard, span, (units, units))
    if replicas is not None:
        table["all_reduce"] = Traffic(
            FP32, replicas, (m.elements // shard, m.padded(shard) // shard), (units, units)
        )
    return table


def _fsdp1(precision: str, ws: int, m: ModelFacts, *, full: bool) -> Table:
    """Legacy FSDP1, one flat parameter per block and one for the root, MixedPrecision(param_dtype bf16,
    reduce_dtype fp32) under bf16. On one rank it runs NO_SHARD: one all-reduce a unit a step. Otherwise one
    reduce-scatter a unit a step, and an all-gather a unit for forward and, FULL_SHARD, again for backward for
    each unit it freed (the root may keep its parameters: bounded, not counted exactly)."""
    units = m.layers + 1
    if ws == 1:
        return {"all_reduce": Traffic(FP32, 1, (m.elements, m.padded(1)), (units, units))}
    param = DTYPE["bf16"] if precision == "bf16" else FP32
    passes = 2 if full else 1
    return {
        "reduce_scatter": Traffic(FP32, ws, (m.elements, m.padded(ws)), (units, units)),
        "all_gather": Traffic(param, ws, (m.elements, passes * m.padded(ws)), (units, passes * units)),
    }


def _zero(precision: str, ws: int, m: ModelFacts, *, stage: int) -> Table:
    """DeepSpeed reduces gradients in its communication_data_type, which distbench leaves unset and DeepSpeed
    documents as "determined by the regime": the precision's own dtype (bf16 under bf16, fp16 under fp16, fp32
    otherwise), which is also the dtype it holds the model's parameters in; under bf16-amp (torch_autocast over
    fp32 parameters, no module marked for bf16 communication) that is fp32. Buckets of DS_BUCKET_ELEMENTS capped at
    N: greedily filled, so at least N / bucket of them and fewer than twice that.
    ZeRO-1/2 all-reduce each bucket (use_multi_rank_bucket_allreduce, on by default in 0.19: "an All-Reduce
    instead of multiple Reduce ops"), on one rank too, and all-gather the updated partitions once per parameter
    group (distbench's AdamW has one) except on one rank. ZeRO-3 reduce-scatters each bucket, on one rank too,
    and all-gathers parameters as forward and backward reach them: at most twice each a step, none on one rank."""
    comm = FP32 if precision == "bf16-amp" else DTYPE[precision]
    bucket = min(DS_BUCKET_ELEMENTS, m.elements)
    buckets = -(-m.elements // bucket)
    grads = (m.elements, m.padded(ws))
    if stage in (1, 2):
        table = {"all_reduce": Traffic(comm, ws, grads, (buckets, 2 * buckets - 1))}
        if ws > 1:
            table["all_gather"] = Traffic(comm, ws, grads, (1, 1))
        return table
    table = {"reduce_scatter": Traffic(comm, ws, grads, (buckets, 2 * buckets - 1))}
    if ws > 1:
        table["all_gather"] = Traffic(comm, ws, (1, 2 * m.padded(ws)), (1, 2 * m.tensors))
    return table


def _zero0(precision: str, ws: int, m: ModelFacts) -> Table:
    """DeepSpeed without ZeRO all-reduces every gradient once at the boundary (buffered_allreduce_fallback),
    flattened into buckets it fills until they pass DeepSpeed's 5e8 elements (not capped: stage 0 reads no ZeRO
    bucket size), in the communication dtype of the regime, as _zero says; exactly N elements, on one rank too."""
    comm = FP32 if precision == "bf16-amp" else DTYPE[precision]
    most = m.elements // DS_BUCKET_ELEMENTS + 1  # every bucket but the last holds more than 5e8
    least = -(-m.elements // (DS_BUCKET_ELEMENTS + m.largest))
    return {"all_reduce": Traffic(comm, ws, (m.elements, m.elements), (least, most))}


def _single(precision: str, ws: int, m: ModelFacts) -> Table:
    """One process: nothing to communicate."""
    return {}


def hybrid_replicas(world_size: int, nodes: int = 1, replicate: int | None = None) -> int:
    """fsdp_hybrid's replicate groups as docs/strategies.md declares them: its `replicate` option, else one a
    node, else 2 on one node when the world is even. Written here from the declaration, not read from the
    trainer's mesh, so that a trainer building another mesh disagrees with the table."""
    if replicate is not None:
        return replicate
    return nodes if nodes > 1 else (2 if world_size % 2 == 0 else 1)


#: (precision, world size, the model, fsdp_hybrid's replicate groups: the others ignore them) -> the table.
Policy = Callable[[str, int, ModelFacts, int], Table]

#: Each strategy's declared layout, as the registry describes it (docs/strategies.md, `distbench strategies`).
POLICIES: dict[str, Policy] = {
    "single": lambda p, ws, m, r: _single(p, ws, m),
    "ddp": lambda p, ws, m, r: _ddp(p, ws, m),
    "fsdp_full": lambda p, ws, m, r: _fsdp2(p, ws, m, reshard_after_forward=True),
    "fsdp_grad": lambda p, ws, m, r: _fsdp2(p, ws, m, reshard_after_forward=False),
    "fsdp_hybrid": lambda p, ws, m, r: _fsdp2(p, ws, m, reshard_after_forward=True, replicas=r),
    "fsdp_offload": lambda p, ws, m, r: _fsdp2(p, ws, m, reshard_after_forward=True),
    "fsdp1_full": lambda p, ws, m, r: _fsdp1(p, ws, m, full=True),
    "fsdp1_grad": lambda p, ws, m, r: _fsdp1(p, ws, m, full=False),
    "zero0": lambda p, ws, m, r: _zero0(p, ws, m),
    "zero1": lambda p, ws, m, r: _zero(p, ws, m, stage=1),
    "zero2": lambda p, ws, m, r: _zero(p, ws, m, stage=2),
    "zero3": lambda p, ws, m, r: _zero(p, ws, m, stage=3),
    "zero3_offload": lambda p, ws, m, r: _zero(p, ws, m, stage=3),
}


def expected_traffic(
    strategy: str,
    precision: str,
    world_size: int,
    facts: ModelFacts,
    *,
    nodes: int = 1,
    replicate: int | None = None,
) -> Table:
    """The table for one configuration (one micro-batch a step: accumulation multiplies the all-gathers), on
    `nodes` nodes, `replicate`: fsdp_hybrid's option when the configuration sets it."""
    if strategy not in POLICIES:
        raise KeyError(f"no wire policy for strategy {strategy!r}: add one to distbench/invariants/wire.py")
    return POLICIES[strategy](precision, world_size, facts, hybrid_replicas(world_size, nodes, replicate))


def is_payload(call: dict[str, Any]) -> bool:
    """A collective that carries model data: more than one element, not integers or flags."""
    return call["elements"] > 1 and not call["dtype"].startswith(("int", "uint", "bool"))


def _within(value: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= value <= bounds[1]


def wire_problems(calls: list[dict[str, Any]], expected: Table) -> list[str]:
    """What in one step's collectives disagrees with `expected` (empty when nothing does)."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for call in calls:
        if is_payload(call):
            by_kind[call["kind"]].append(call)
    problems = [
        f"{kind}: {len(got)} collectives ({sum(c['bytes'] for c in got)} bytes, {sorted({c['dtype'] for c in got})}) "
        "where the policy has none"
        for kind, got in by_kind.items()
        if kind not in expected
    ]
    for kind, want in expected.items():
        got = by_kind.get(kind, [])
        dtypes = sorted({c["dtype"] for c in got})
        groups = sorted({c["group_size"] for c in got})
        total = sum(c["bytes"] for c in got)
        if got and dtypes != [want.dtype]:
            problems.append(f"{kind} in {dtypes}, the policy says {want.dtype}")
        if got and groups != [want.group_size]:
            problems.append(f"{kind} over groups of {groups} ranks, the policy's group has {want.group_size}")
        if not _within(len(got), want.count):
            problems.append(
                f"{len(got)} {kind} collectives a step, the policy allows {want.count[0]}-{want.count[1]}"
            )
        if not _within(total, want.bytes):
            problems.append(
                f"{kind} moved {total} bytes a step, the policy {want.bytes[0]}-{want.bytes[1]} "
                f"({want.elements[0]}-{want.elements[1]} elements of {want.dtype})"
            )
    return problems


def assert_wire_matches(record: dict[str, Any], expected: Table, what: str) -> None:
    """Every recorded step's collectives follow `expected` (see wire_problems), and the record holds every
    collective the profiler counted in the step before (a dispatch mode can miss a thread the profiler sees)."""
    assert record["steps"], f"{what}: no step recorded"
    for step, calls in enumerate(record["steps"]):
        recorded = dict(Counter(c["kind"] for c in calls))
        assert recorded == record["profiled"], (
            f"{what}: step {step} recorded collectives {recorded}, the profiler counted {record['profiled']} "
            "in a step of the same run: the record misses collectives"
        )
        problems = wire_problems(calls, expected)
        assert not problems, f"{what}: step {step} disagrees with its precision policy: " + "; ".join(
            problems
        )
