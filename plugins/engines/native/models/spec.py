"""The shape and switches of a decoder family, read from a transformers config.

Qwen2 / Qwen2.5 / DeepSeek-R1-Distill-Qwen: bias on q/k/v. Llama 3: optional attention and MLP
biases, llama3 rope scaling. Qwen3: per-head RMSNorm on q and k, explicit head_dim.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from minirl_plugins.engines.native.layers.meta import Heads
from minirl_plugins.engines.native.layers.rotary import rope_parameters

FAMILIES = ("qwen2", "llama", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope: dict
    initializer_range: float = 0.02

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads(self) -> Heads:
        return Heads(self.num_heads, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelSpec":
        family = getattr(cfg, "model_type", "")
        if family not in FAMILIES:
            raise ValueError(
                f"the native rollout engine supports model_type {FAMILIES}, got {family!r}; "
                "use rollout.name = 'hf' for other architectures"
            )
        if getattr(cfg, "use_sliding_window", False):
            warnings.warn("native engine: use_sliding_window is ignored (full attention everywhere)")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported by the native engine (silu)")
        heads = cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope=rope_parameters(cfg),
            initializer_range=getattr(cfg, "initializer_range", 0.02),
        )
