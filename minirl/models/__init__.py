"""Model loading: local Hugging Face directories, random-weight presets, tokenizers, attention.

    from minirl.models import load_model, packed_forward_kwargs
    model, tokenizer = load_model(cfg.model, device, dtype)
    logits = model(input_ids=ids_1N, **packed_forward_kwargs(seq_lens, device)).logits

The names below are imported on first use, so `import minirl.models` stays cheap (no transformers).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "loading",
    "random_model": "loading",
    "load_tokenizer": "loading",
    "byte_tokenizer": "tokenizers",
    "qwen2_tokenizer": "tokenizers",
    "preset_config": "presets",
    "preset_tokenizer": "presets",
    "PRESETS": "presets",
    "ATTN_NAME": "attention",
    "packed_forward_kwargs": "attention",
    "register_attention": "attention",
    "set_varlen_core": "attention",
    "varlen_attention": "varlen",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minirl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"minirl.models.{_EXPORTS[name]}"), name)
