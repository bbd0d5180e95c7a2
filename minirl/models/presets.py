"""Named model shapes that need no download: `model.preset = "tiny"` and friends.

A preset is a transformers config (weights are random, seeded by model.seed) plus the name of its
built-in tokenizer. `qwen2-1.5b` is exactly DeepSeek-R1-Distill-Qwen-1.5B's config.json, so
benchmarks on random weights measure the real model's cost; `qwen2-7b` is Qwen2-7B's, the LoRA
benchmark's shape. The tiny presets cover the three
decoder families the native rollout engine implements, with both tied and untied embeddings,
GQA, qkv bias (Qwen2), q/k norms and a head_dim that is not hidden/heads (Qwen3), and Llama 3's
scaled RoPE. `tiny-agent` is `tiny` with the agent tokenizer's 264-token vocabulary (its tool-call
tokens), for the synthetic multi-turn lookup task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from minirl.models.tokenizers import (
    AGENT_VOCAB_SIZE,
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    agent_byte_tokenizer,
    byte_tokenizer,
    qwen2_tokenizer,
)


@dataclass(frozen=True)
class Preset:
    config: Callable[..., PretrainedConfig]  # (**overrides) -> a fresh config
    tokenizer: Callable[[], object]


# The shape of the three tiny presets: milliseconds per forward on CPU. No pad_token_id, as in
# Qwen's checkpoints: it would make the eos embedding row a frozen zero padding_idx (padding comes
# from the tokenizer).
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    vocab_size=BYTE_VOCAB_SIZE,
    bos_token_id=None,
    eos_token_id=BYTE_EOS_ID,
)


def _tiny(**overrides) -> PretrainedConfig:
    """Qwen2 shape in miniature (untied like R1-Distill-1.5B)."""
    family = dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2Config(**{**TINY_SHAPE, **family, **overrides})


def _qwen3_tiny(**overrides) -> PretrainedConfig:
    """Qwen3 in miniature: q/k RMSNorm, no qkv bias, head_dim 32 != 64/4, tied embeddings."""
    family = dict(head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return Qwen3Config(**{**TINY_SHAPE, **family, "use_sliding_window": False, **overrides})


def _llama3_tiny(**overrides) -> PretrainedConfig:
    """Llama 3.2 in miniature: tied embeddings and the "llama3" frequency-scaled RoPE."""
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    )
    family = dict(rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return LlamaConfig(**{**TINY_SHAPE, **family, "attention_bias": False, "mlp_bias": False, **overrides})


def _tiny_agent(**overrides) -> PretrainedConfig:
    """`tiny` over agent_byte_tokenizer's vocabulary (the byte tokenizer + 5 tool-call tokens)."""
    return _tiny(**{"vocab_size": AGENT_VOCAB_SIZE, **overrides})


# the keys every Qwen2 config.json below shares
QWEN2_COMMON = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_act="silu",
    max_position_embeddings=131072,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_sliding_window=False,
    attention_dropout=0.0,
    use_cache=True,
    bos_token_id=151643,
    eos_token_id=151643,
)


def _qwen2_1_5b(**overrides) -> PretrainedConfig:
    """DeepSeek-R1-Distill-Qwen-1.5B's config.json, key for key (bos in config.json is 151643;
    its tokenizer and generation_config.json use <｜begin▁of▁sentence｜> = 151646)."""
    shape = dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        rope_theta=10000.0,
        sliding_window=4096,
        max_window_layers=21,
    )
    return Qwen2Config(**{**QWEN2_COMMON, **shape, **overrides})


def _qwen2_7b(**overrides) -> PretrainedConfig:
    """Qwen2-7B's config.json (the base model), key for key: the shape of the LoRA benchmark, a
    model whose full fine-tuning (weights, gradients, AdamW state) does not fit one H200."""
    shape = dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rope_theta=1000000.0,
        sliding_window=131072,
        max_window_layers=28,
    )
    return Qwen2Config(**{**QWEN2_COMMON, **shape, **overrides})


PRESETS: dict[str, Preset] = {
    "tiny": Preset(_tiny, byte_tokenizer),
    "qwen3-tiny": Preset(_qwen3_tiny, byte_tokenizer),
    "llama3-tiny": Preset(_llama3_tiny, byte_tokenizer),
    "tiny-agent": Preset(_tiny_agent, agent_byte_tokenizer),
    "qwen2-1.5b": Preset(_qwen2_1_5b, qwen2_tokenizer),
    "qwen2-7b": Preset(_qwen2_7b, qwen2_tokenizer),
}


def preset_config(name: str, **overrides) -> PretrainedConfig:
    """A fresh transformers config of the named preset, with `overrides` in place of its values
    (the engine tests' smaller shapes). model.preset is checked up front (minirl.validate.files)."""
    return PRESETS[name].config(**overrides)


def preset_tokenizer(name: str):
    """The preset's built-in tokenizer: the byte tokenizer (with tool-call tokens for tiny-agent),
    or Qwen2's vocabulary for qwen2-*."""
    return PRESETS[name].tokenizer()
