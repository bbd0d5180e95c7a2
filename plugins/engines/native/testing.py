"""Tiny models for the native engine's tests and the CPU profile (random weights, no network)."""

from __future__ import annotations

import torch

from minirl.protocols import EngineContext

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=300,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny_config(family: str, **overrides):
    """A transformers config of the family with TINY's shape (Qwen3: head_dim 32 != 64/4)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = {**TINY, **overrides}
    if family == "qwen2":
        return Qwen2Config(**kwargs)
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        return LlamaConfig(**{"rope_scaling": rope, **kwargs})
    if family == "qwen3":
        return Qwen3Config(**{"head_dim": 32, **kwargs})
    raise ValueError(family)


def tiny_hf_model(config, seed: int = 0, std: float = 0.02, dtype=torch.float32, device="cpu"):
    """transformers' causal LM for the config with normal(0, std) weights (biases and norms too,
    so that every parameter matters in a comparison)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_((1.0 + noise) if "norm" in name else noise)
    return model.eval()


def engine_context(config, actor=None, device="cpu", dtype=torch.float32, eos=(), **extra) -> EngineContext:
    extra = {"max_model_len": 256, **extra}
    return EngineContext(config, actor, torch.device(device), dtype, tuple(eos), 0, extra=extra)
