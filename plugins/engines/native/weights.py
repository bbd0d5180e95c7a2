"""Weights in and out of the engine: in-place loads by Hugging Face name, and a checksum.

`weights_checksum` is the one both sides use, the trainer over the actor's parameters and the
engine over its own. It is exact whatever the device: each tensor is rounded to one dtype, its
bits read as integers, weighted by position and summed in int64 (wrapping).
"""

from __future__ import annotations

import glob
import os
from typing import Iterable

import torch
from torch import nn

from minirl.models.assembly import hf_name

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (FSDP2), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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


@torch.no_grad()
def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16) -> int:
    """An exact checksum of named weights after rounding to `dtype` (an int in [0, 2**64)).

    Equal for the actor and the engine exactly when they hold the same values, whatever the
    device; names (wrapper prefixes removed) fix the order, so swapped tensors are caught too.
    """
    total = 0
    items = sorted((hf_name(n), t) for n, t in named_tensors)
    items = [(n, t) for n, t in items if not n.endswith(_IGNORED_SUFFIXES)]
    for i, (_name, tensor) in enumerate(items):
        total = (total + (i + 1) * _tensor_checksum(full_tensor(tensor).detach(), dtype)) & _MASK64
    return total


def _tensor_checksum(t: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 24) -> int:
    flat = t.to(dtype).contiguous().view(-1)
    bits = flat.view(_BITS[flat.element_size()])
    acc = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), chunk):
        piece = bits[start : start + chunk].to(torch.int64)
        weight = torch.arange(start, start + piece.numel(), device=t.device, dtype=torch.int64) % 8191 + 1
        acc += (piece * weight).sum()
    return int(acc) & _MASK64
