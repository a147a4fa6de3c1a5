"""Models from transformers configs with random init (no hub downloads), plus users' own factories.

Every rank builds the same model from the same seed, so all strategies start from identical weights.
Dropout is off so that losses are a deterministic function of weights and data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gpt2", "llama" or "custom"
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 1024
    cpu_ok: bool = False  # small enough for the CPU tier
    factory: Callable[[], nn.Module] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def hf_config(self):
        import transformers

        if self.family == "gpt2":
            c = transformers.GPT2Config(
                **self.config, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False
            )
        elif self.family == "llama":
            c = transformers.LlamaConfig(**self.config, attention_dropout=0.0, use_cache=False)
        else:
            raise ConfigError(f"model {self.name} has no transformers config")
        c._attn_implementation = "sdpa"
        return c

    def build(self, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        """Build with random init from `seed`, directly on `device`."""
        torch.manual_seed(seed)
        with torch.device(device):
            if self.factory is not None:
                model = self.factory()
            else:
                import transformers

                cls = transformers.GPT2LMHeadModel if self.family == "gpt2" else transformers.LlamaForCausalLM
                model = cls(self.hf_config())
        return model.to(device=device, dtype=torch.float32).train()


def _gpt2(name: str, layers: int, hidden: int, heads: int, desc: str) -> ModelSpec:
    return ModelSpec(
        name, "gpt2", desc,
        {"n_layer": layers, "n_embd": hidden, "n_head": heads, "vocab_size": 50257, "n_positions": 1024},
    )


_MODELS = [
    ModelSpec("gpt2-tiny", "gpt2", "2-layer, 64-wide GPT-2 for the CPU tier",
              {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64,
               "bos_token_id": 0, "eos_token_id": 0},
              seq_len=32, cpu_ok=True),
    _gpt2("gpt2-124m", 12, 768, 12, "GPT-2 small (124M)"),
    _gpt2("gpt2-355m", 24, 1024, 16, "GPT-2 medium (355M)"),
    _gpt2("gpt2-774m", 36, 1280, 20, "GPT-2 large (774M), the model of seed 004"),
    _gpt2("gpt2-1.5b", 48, 1600, 25, "GPT-2 XL (1.5B)"),
    ModelSpec("llama-tiny", "llama", "2-layer, 64-wide Llama (GQA, RMSNorm, SwiGLU) for the CPU tier",
              {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
               "bos_token_id": 0, "eos_token_id": 0},
              seq_len=32, cpu_ok=True),
    ModelSpec("llama-1b", "llama", "Llama-3.2-1B shape (16 layers, 2048 wide, GQA 32/8, 128k vocab)",
              {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_theta": 500000.0},
              seq_len=1024),
]

MODELS: dict[str, ModelSpec] = {m.name: m for m in _MODELS}
ALIASES = {"gpt2": "gpt2-124m", "gpt2-small": "gpt2-124m", "gpt2-medium": "gpt2-355m",
           "gpt2-large": "gpt2-774m", "gpt2-xl": "gpt2-1.5b"}


def get_model(name: str) -> ModelSpec:
    """A registered model by name or alias, or a user factory given as `package.module:function`.

    A factory returns an nn.Module whose forward takes `input_ids` and returns logits (or an object
    with `.logits`), and which exposes its vocabulary size as `config.vocab_size` or `vocab_size`.
    """
    name = ALIASES.get(name, name)
    if name in MODELS:
        return MODELS[name]
    if ":" in name:
        return _custom(name)
    raise ConfigError(
        f"unknown model {name!r}; known models: {', '.join(MODELS)} (aliases: {', '.join(ALIASES)}), "
        "or give your own factory as module:function"
    )


def _custom(ref: str) -> ModelSpec:
    module_name, _, fn_name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load model factory {ref!r}: {e}; is the module on PYTHONPATH?") from e
    torch.manual_seed(0)
    try:
        with torch.device("meta"):
            probe = fn()
    except Exception as e:
        raise ConfigError(f"model factory {ref!r} raised {type(e).__name__}: {e}") from e
    vocab = getattr(getattr(probe, "config", None), "vocab_size", None) or getattr(probe, "vocab_size", None)
    if not vocab:
        raise ConfigError(f"model factory {ref!r} must expose config.vocab_size or vocab_size")
    seq = getattr(probe, "seq_len", None) or getattr(getattr(probe, "config", None), "n_positions", None) or 128
    return ModelSpec(ref, "custom", f"user factory {ref}", {"vocab_size": int(vocab)}, seq_len=int(seq),
                     cpu_ok=True, factory=fn)


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
