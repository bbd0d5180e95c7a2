"""An exact checksum of named weights: the trainer's and a rollout engine's must agree.

Exact whatever the device: each tensor is rounded to one dtype, its bits read as integers,
weighted by position and summed in int64 (wrapping); names (wrapper prefixes removed) fix the
order, so swapped tensors are caught too.
"""

from __future__ import annotations

from typing import Iterable

import torch

from minirl.models.names import full_tensor, hf_name

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1


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
