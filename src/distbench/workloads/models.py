"""Models from transformers configs with random init (no hub downloads), plus users' own factories.

Every rank builds the same model from the same seed, so all strategies start from identical weights.
The configs' dropout is off so that losses are a deterministic function of weights and data; RunConfig.dropout
puts per-sample dropout (workloads/dropout.py) in place of their nn.Dropout modules, deterministic too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # torch is imported where a model is built, so that names are checked before heavy imports
    import torch
    from torch import nn


#: The modules LoRA adapts by default, per family: GPT-2's attention projections and its MLP's output
#: projection (every module named c_attn or c_proj), Llama's attention projections.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gpt2", "llama" or "custom"
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 1024
    factory: Callable[[], nn.Module] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model's position embeddings cover, when it has a limit."""
        for key in ("n_positions", "max_position_embeddings"):
            if self.config.get(key):
                return int(self.config[key])
        return None

    def lora_targets(self, given: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The modules LoRA adapts: those `given`, else the family's defaults (a user's factory has none)."""
        targets = given or LORA_TARGETS.get(self.family, ())
        if not targets:
            raise ConfigError(
                f"model {self.name} has no default LoRA targets; name the modules to adapt "
                "(lora_targets, --lora-targets)"
            )
        return targets

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
        """Build with random init from `seed`, directly on `device`. Every global generator is seeded, so a
        factory whose initialisation draws from numpy or Python's `random` builds the same model on every rank."""
        import torch

        from .global_rng import seed_all

        seed_all(seed)
        with torch.device(device):
            if self.factory is not None:
                model = self.factory()
            else:
                import transformers

                cls = transformers.GPT2LMHeadModel if self.family == "gpt2" else transformers.LlamaForCausalLM
                model = cls(self.hf_config())
        return model.to(device=device, dtype=torch.float32).train()

    def param_count(self) -> int:
        """Unique parameters (tied weights once), from the configuration for the registered families, which
        costs no import of their model code (GPT-2's took the GPU session's planning 6.9 s on an H200 host);
        a user's factory is built on the meta device and counted."""
        c = self.config
        if self.family == "gpt2":
            d, layers, inner = c["n_embd"], c["n_layer"], c.get("n_inner") or 4 * c["n_embd"]
            block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
            return (c["vocab_size"] + c["n_positions"]) * d + layers * block + 2 * d  # lm_head tied to wte
        if self.family == "llama":
            h, inner, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
            head_dim = c.get("head_dim") or h // heads
            kv = c.get("num_key_value_heads") or heads
            attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim  # q, o; k, v (no biases)
            block = attention + 3 * h * inner + 2 * h  # gate, up, down (no biases); two RMSNorms
            lm_head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * h
            return c["vocab_size"] * h + c["num_hidden_layers"] * block + h + lm_head
        return count_params(self.build(0, "meta"))


def _gpt2(name: str, layers: int, hidden: int, heads: int, desc: str) -> ModelSpec:
    return ModelSpec(
        name,
        "gpt2",
        desc,
        {"n_layer": layers, "n_embd": hidden, "n_head": heads, "vocab_size": 50257, "n_positions": 1024},
    )


_MODELS = [
    ModelSpec(
        "gpt2-tiny",
        "gpt2",
        "2-layer, 64-wide GPT-2 for the CPU tier",
        {
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 512,
            "n_positions": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        seq_len=32,
    ),
    _gpt2("gpt2-124m", 12, 768, 12, "GPT-2 small (124M)"),
    _gpt2("gpt2-355m", 24, 1024, 16, "GPT-2 medium (355M)"),
    _gpt2("gpt2-774m", 36, 1280, 20, "GPT-2 large (774M), the model of seed 004"),
    _gpt2("gpt2-1.5b", 48, 1600, 25, "GPT-2 XL (1.5B)"),
    ModelSpec(
        "llama-tiny",
        "llama",
        "2-layer, 64-wide Llama (GQA, RMSNorm, SwiGLU) for the CPU tier",
        {
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        seq_len=32,
    ),
    ModelSpec(
        "gpt2-uneven",
        "gpt2",
        "2-layer GPT-2 for the CPU scale tier whose every dimension is 4 x an odd number: even shards at 4 "
        "ranks, uneven (padded) at 8",
        {
            "n_layer": 2,
            "n_embd": 44,
            "n_head": 4,
            "n_inner": 172,
            "vocab_size": 508,
            "n_positions": 36,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        seq_len=32,
    ),
    ModelSpec(
        "llama-1b",
        "llama",
        "Llama-3.2-1B shape (16 layers, 2048 wide, GQA 32/8, 128k vocab)",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
        },
        seq_len=1024,
    ),
    ModelSpec(
        "llama-7b",
        "llama",
        "Llama-2-7B shape (32 layers, 4096 wide, 11008 MLP, 32k vocab, 6.74B parameters): the memory model's "
        "and recommend's cluster-size model, built on the meta device",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
        seq_len=4096,
    ),
]

MODELS: dict[str, ModelSpec] = {m.name: m for m in _MODELS}
ALIASES = {
    "gpt2": "gpt2-124m",
    "gpt2-small": "gpt2-124m",
    "gpt2-medium": "gpt2-355m",
    "gpt2-large": "gpt2-774m",
    "gpt2-xl": "gpt2-1.5b",
}


def get_model(name: str) -> ModelSpec:
    """A registered model by name or alias, or a user factory given as `package.module:function`.

    A factory returns an nn.Module whose forward takes `input_ids` and returns logits (or an object
    with `.logits`), and which exposes its vocabulary size as `config.vocab_size` or `vocab_size`.
    """
    name = check_model_name(name)
    return MODELS[name] if name in MODELS else _custom(name)


def check_model_name(name: str) -> str:
    """The registered name `name` stands for, or `name` itself when it has a factory's form (imported only
    by get_model); ConfigError with the nearest names otherwise. Needs no torch."""
    name = ALIASES.get(name, name)
    if name in MODELS:
        return name
    if ":" in name:
        module_name, _, fn_name = name.partition(":")
        if not module_name or not fn_name.isidentifier():
            raise ConfigError(f"model factory {name!r} must read package.module:function")
        return name
    raise ConfigError(
        f"unknown model {name!r}.{did_you_mean(name, [*MODELS, *ALIASES])} Known models: {', '.join(MODELS)} "
        f"(aliases: {', '.join(ALIASES)}), or give your own factory as module:function"
    )


def _custom(ref: str) -> ModelSpec:
    import torch

    module_name, _, fn_name = ref.partition(":")
    # A user's module or factory may raise anything, or call sys.exit: each is a bad input named here, before
    # any rank starts, not a traceback.
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load model factory {ref!r}: {e}; is the module on PYTHONPATH?") from None
    except (Exception, SystemExit) as e:
        raise ConfigError(
            f"importing {module_name!r} for model factory {ref!r} raised "
            f"{type(e).__name__}: {e}; fix the module"
        ) from None
    from .global_rng import preserved

    # get_model runs this probe wherever a job looks the model up, mid-training included: it must leave the
    # global generators (which the factory may seed, and the model draws from) as it found them.
    try:
        with preserved(), torch.device("meta"):
            probe = fn()
    except (Exception, SystemExit) as e:
        raise ConfigError(f"model factory {ref!r} raised {type(e).__name__}: {e}; fix the factory") from None
    config = getattr(probe, "config", None)
    vocab = getattr(config, "vocab_size", None) or getattr(probe, "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ConfigError(
            f"model factory {ref!r} must expose config.vocab_size or vocab_size as a positive int"
        )
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    seq = getattr(probe, "seq_len", None) or positions or 128
    extra = {"n_positions": int(positions)} if positions else {}
    return ModelSpec(
        ref,
        "custom",
        f"user factory {ref}",
        {"vocab_size": int(vocab), **extra},
        seq_len=int(seq),
        factory=fn,
    )


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
