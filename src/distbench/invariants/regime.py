"""The precision regime a strategy trains in: which dtype its matmuls compute in, which its layer norms see, and
which its parameters are held in. Strategies compared in one table must share it: under "bf16" each wrapper
brings its own (FSDP2 and FSDP1 compute from bf16 copies of the parameters, so layer norms and the residual
stream run in bf16; DeepSpeed holds bf16 weights; single and DDP run torch.autocast over fp32 parameters, which
keeps layer norms and the residual stream in fp32), and a strategy can look faster by doing less fp32 work.

EXPECTED is written from torch.autocast's documented op lists, not read from a trainer: under autocast
matrix multiplies run in bf16, while the residual stream stays fp32 (a bf16 matmul output added to an fp32
input promotes), so every layer norm sees fp32; parameters stay fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose output dtype is the compute dtype of the matmuls with the weights (linear layers, GPT-2's
#: Conv1D, the LM head). Attention's batched matmuls are left out: which dtype they run in is the attention
#: backend's choice (the math backend upcasts bf16 to fp32 inside), the same under every strategy.
MATMULS = frozenset({"mm", "addmm"})
#: aten ops whose first input's dtype is what a layer norm sees
LAYER_NORMS = frozenset({"native_layer_norm"})

#: The regime bf16-amp promises for every strategy (see the module docstring for why these dtypes)
EXPECTED: dict[str, dict[str, list[str]]] = {
    "bf16-amp": {"matmul": ["bfloat16"], "layer_norm": ["float32"], "parameters": ["float32"]},
}


class DtypeRecorder(TorchDispatchMode):
    """Records the dtypes of the matmuls' outputs and the layer norms' inputs of everything run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[str]] = {"matmul": set(), "layer_norm": set()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in MATMULS and isinstance(out, torch.Tensor):
            self.seen["matmul"].add(str(out.dtype).removeprefix("torch."))
        elif name in LAYER_NORMS and isinstance(args[0], torch.Tensor):
            self.seen["layer_norm"].add(str(args[0].dtype).removeprefix("torch."))
        return out


def regime_of(recorded: dict[str, set[str]], parameters: list[torch.Tensor]) -> dict[str, list[str]]:
    """A run's regime as EXPECTED spells one: sorted dtype names per part."""
    dtypes = {str(p.dtype).removeprefix("torch.") for p in parameters}
    return {**{k: sorted(v) for k, v in recorded.items()}, "parameters": sorted(dtypes)}


def regime_differences(precision: str, regime: dict[str, list[str]]) -> list[str]:
    """What in `regime` differs from the one `precision` promises (empty: the same regime)."""
    want = EXPECTED[precision]
    return [
        f"{part}: {regime.get(part)} where {precision} computes in {want[part]}"
        for part in want
        if regime.get(part) != want[part]
    ]
