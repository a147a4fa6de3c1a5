"""Model FLOPs per token, GPU peak throughput, MFU.

FLOPs per token (training: forward + backward), after PaLM (Chowdhery et al. 2022, appendix B):

    flops_per_token = 6 * N + 12 * L * H * S

* 6N: each parameter that takes part in a matrix multiply costs 2 FLOPs per token forward (multiply and
  add) and 4 backward (gradient w.r.t. input and w.r.t. weight).
* 12*L*H*S: attention scores Q.K^T and the weighted sum A.V, 2*S*H multiply-adds each per token per layer
  forward, times 3 for forward+backward. L = layers, H = hidden width (heads * head_dim), S = sequence
  length. Counted for the full S x S matrix even though causal kernels skip the masked half: that is the
  convention MFU numbers in the literature use, so ours compare with theirs.

Which N: the parameters that do multiply-adds per token, i.e. all unique parameters minus embedding tables
that are only looked up (position embeddings, and token embeddings when they are *not* tied to the output
head). A tied token embedding stays in N because it is the LM-head matmul (hidden x vocab), which for
GPT-2 is a third of the compute; Kaplan's "non-embedding N" would drop it and under-count, total N would
over-count untied input embeddings. For GPT-2 the difference from total N is only the position table.

MFU counts model FLOPs only: activation recomputation is work the model did not need, so it lowers MFU.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..config import BF16_COMPUTE

#: Dense (no structured sparsity) peak TFLOP/s per GPU from NVIDIA datasheets: "bf16" and "tf32" on tensor
#: cores, "fp32" on the CUDA cores (what plain fp32 matmuls reach with TF32 off). Datasheets quote sparse
#: figures for tensor cores; the dense figure is half of that.
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    "H100 SXM": {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "GH200": {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H800 SXM": {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H800 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"bf16": None, "tf32": None, "fp32": 15.7},
}

# torch.cuda.get_device_name() strings -> table rows, first match wins. Unlisted variants (e.g. an H100
# name that says neither SXM/HBM3 nor PCIe/NVL) deliberately match nothing: a wrong peak is worse than none.
_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"\bGH200\b", "GH200"),
    (r"\bH200 NVL\b", "H200 NVL"),
    (r"\bH200\b", "H200 SXM"),  # "NVIDIA H200"
    (r"\bH100 NVL\b", "H100 NVL"),
    (r"\bH100 PCIe\b", "H100 PCIe"),
    (r"\bH100\b.*(HBM3|SXM)", "H100 SXM"),  # "NVIDIA H100 80GB HBM3"
    (r"\bH800 PCIe\b", "H800 PCIe"),
    (r"\bH800\b.*(HBM3|SXM)", "H800 SXM"),
    (r"(?<!G)\bB200\b", "B200"),
    (r"\bA100\b", "A100"),  # SXM4 and PCIe, 40 and 80 GB: same tensor peak
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10\b", "A10"),
    (r"\bV100\b", "V100"),
]


def gpu_key(device_name: str | None) -> str | None:
    """The PEAK_TFLOPS row for a torch/NVML device name, or None for an unknown GPU (or no GPU)."""
    if not device_name:
        return None
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Dense peak FLOP/s of one GPU for `dtype` ("bf16", "tf32" or "fp32"); None when unknown."""
    key = gpu_key(device_name)
    if key is None:
        return None
    tflops = PEAK_TFLOPS[key].get(dtype)
    return None if tflops is None else tflops * 1e12


def matmul_tf32() -> bool:
    """Whether fp32 matmuls run on tensor cores as TF32 now, however it was set: torch's per-backend setting
    (torch.backends.cuda.matmul.fp32_precision) reflects its own setter and the legacy ones (allow_tf32,
    set_float32_matmul_precision); the legacy getters raise once the new setter was used ("a mix of the legacy and
    new APIs", torch 2.13), so a model factory that set TF32 the new way used to crash the run's last step.
    Torch without the new setting has only the legacy ones."""
    try:
        return bool(torch.backends.cuda.matmul.fp32_precision == "tf32")
    except AttributeError:
        return torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"


def peak_dtype(precision: str) -> str:
    """Which peak applies to a run's precision: the peak of the unit that does its matmuls. fp32 runs on tensor
    cores as TF32 when torch allows it (matmul_tf32), else on the CUDA cores; fp16 matmuls have bf16's dense
    tensor-core peak on every GPU in the table that has bf16 (V100, which has only fp16, gets none)."""
    if precision in (*BF16_COMPUTE, "fp16"):
        return "bf16"
    return "tf32" if matmul_tf32() else "fp32"


def flops_per_token(n_params: int, layers: int | None, hidden: int | None, seq_len: int) -> float:
    """6N + 12*L*H*S training FLOPs per token; the attention term is dropped when L or H is unknown."""
    attn = 12 * layers * hidden * seq_len if layers and hidden else 0
    return 6.0 * n_params + attn


def matmul_params(model: nn.Module) -> int:
    """N of the formula: unique parameters minus embedding tables that are only looked up (see module doc)."""
    unique = {id(p): p for p in model.parameters()}
    matmul_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup_only = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in matmul_weights
    }
    return sum(p.numel() for pid, p in unique.items() if pid not in lookup_only)


def model_dims(model: nn.Module) -> tuple[int | None, int | None]:
    """(layers, hidden) from a transformers-style config; (None, None) for models without one."""
    c = getattr(model, "config", None)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
    return (int(layers) if layers else None, int(hidden) if hidden else None)


def model_flops(model: nn.Module, seq_len: int) -> dict[str, Any]:
    """FLOPs per token of an unwrapped model, with the inputs of the formula (call before sharding)."""
    layers, hidden = model_dims(model)
    n = matmul_params(model)
    return {
        "formula": "6N + 12*L*H*S"
        if layers and hidden
        else "6N (attention term unknown: model has no config)",
        "flops_per_token": flops_per_token(n, layers, hidden, seq_len),
        "n_params_matmul": n,
        "layers": layers,
        "hidden": hidden,
        "seq_len": seq_len,
    }


def tflops_per_gpu(tokens_per_s_per_gpu: float, flops_per_tok: float) -> float:
    """Achieved model TFLOP/s per GPU."""
    return tokens_per_s_per_gpu * flops_per_tok / 1e12


def mfu(tokens_per_s_per_gpu: float, flops_per_tok: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved model FLOP/s per GPU over the GPU's dense peak."""
    if not peak:
        return None
    return tokens_per_s_per_gpu * flops_per_tok / peak
