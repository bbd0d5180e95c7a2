"""Weights in and out of the engine: in-place loads by Hugging Face name, and the checksum
(minirl.models.checksum.weights_checksum, re-exported here) both sides compare.
"""

from __future__ import annotations

import glob
import os
from typing import Iterable

import torch
from torch import nn

from minirl.models.assembly import hf_name
from minirl.models.checksum import _IGNORED_SUFFIXES, full_tensor, weights_checksum  # noqa: F401 (re-exported)


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each (name, tensor) into the parameter of that name, in place; returns the count."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown, count = [], 0
    for name, tensor in weights:
        name = hf_name(name)
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        param = params.get(name)
        if param is None:
            unknown.append(name)
            continue
        tensor = full_tensor(tensor)
        if tensor.shape != param.shape:
            raise ValueError(
                f"weight {name}: shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}"
            )
        param.copy_(tensor)
        count += 1
    if unknown:
        raise ValueError(f"{len(unknown)} weights have no parameter in the native engine's model: {unknown[:5]}")
    return count


def iter_checkpoint(path: str, device) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the safetensors files of a local Hugging Face directory."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (ctx.extra['path'])")
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def init_random(model: nn.Module, std: float, seed: int) -> None:
    """transformers' initialisation: normal(0, std) matrices and embeddings, zero biases, unit norms."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
