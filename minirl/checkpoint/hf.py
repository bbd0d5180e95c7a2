"""Saving the actor as a Hugging Face directory (config.json, model.safetensors, tokenizer); a
LoRA actor's export is the model adapter's (minirl.adapter.lora).

The result loads back with `model.path = <dir>` or with transformers' from_pretrained. A
sharded actor is gathered one parameter at a time onto rank 0's CPU (never the whole model on a
device); only rank 0 writes.
"""

from __future__ import annotations

import os

import torch

from minirl.dist.context import DistContext
from minirl.models.assembly import full_weights


def save_hf_checkpoint(actor: torch.nn.Module, tokenizer, path: str, dist: DistContext) -> str | None:
    """Write `path` on rank 0 (every rank must call: gathering sharded weights is collective)."""
    state = {}
    for name, tensor in full_weights(actor):
        if dist.is_main:
            state[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if not dist.is_main:
        return None
    if getattr(actor.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # safetensors stores a tied tensor once
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    actor.config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
