"""The memory model: per-rank bytes of parameters, gradients and optimizer state, measured and predicted.

Measured with the CUDA caching allocator's live bytes inside a training step: after the backward of the
step's last micro-batch (parameters + gradients + optimizer state) and after the optimizer step and
zero_grad (parameters + optimizer state). Activations are freed by then, so the difference from the
analytic model is what a strategy holds beyond its state: buffers, or a replica it should not keep.

Analytic model for N parameters trained with fp32 master weights (16N bytes in all, replicated):
  torch-native (single, DDP, FSDP):  parameters 4N (fp32, also the master copy), gradients 4N, AdamW 8N
  DeepSpeed bf16:                    parameters 2N (bf16), gradients 2N, fp32 master + AdamW 12N
Sharding divides a component by the shard-group size: ZeRO-1 the optimizer state; ZeRO-2 also gradients;
ZeRO-3, fsdp_full and fsdp_grad (at rest) also parameters. Offload moves state to host memory: FSDP2's
CPUOffloadPolicy all of it; ZeRO-3 offload parameters, optimizer state and (ZeRO-Offload) the gradient
partitions. What stays on the device is buffers: for zero3_offload DeepSpeed's reduce bucket (n_params
bf16 elements under the harness's config), whatever the world size.
"""

from __future__ import annotations

from ..strategies import get_spec


def analytic_bytes(
    strategy: str,
    n_params: int,
    world_size: int,
    precision: str,
    nodes: int = 1,
    replicate: int | None = None,
) -> dict[str, float]:
    """Predicted device bytes per rank of each component (see module docstring), from the strategy's
    registry memory layout; `nodes`: those the world spans (HSDP's default mesh replicates across them),
    `replicate`: fsdp_hybrid's option, where a configuration sets it."""
    from ..strategies.fsdp import hybrid_shape

    layout = get_spec(strategy).memory
    if layout is None:
        raise ValueError(f"strategy {strategy} has no memory layout in the registry")
    deepspeed_bf16 = layout.bytes_per_param == "deepspeed" and precision == "bf16"
    per_param = (
        {"params": 2, "grads": 2, "optimizer": 12}
        if deepspeed_bf16
        else {"params": 4, "grads": 4, "optimizer": 8}
    )
    shard = hybrid_shape(world_size, nodes, replicate)[1] if layout.shard_group == "hybrid" else world_size
    return {
        k: 0.0 if k in layout.on_host else b * n_params / (shard if k in layout.sharded else 1)
        for k, b in per_param.items()
    }
