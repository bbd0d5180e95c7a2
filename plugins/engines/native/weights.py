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
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], shared: frozenset = frozenset()) -> int:
    """Copy each (name, tensor) into the parameter of that name, in place; returns the count.
    shared: parameters that are the actor's own tensors (share_weights), which take only
    themselves: nothing to copy (a sync of every weight), where anything else would overwrite
    the actor's."""
    params = dict(model.named_parameters(remove_duplicate=False))
    actors = {params[name].data_ptr() for name in shared}  # a tied head is the embedding: by storage
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
        if param.data_ptr() in actors:
            if tensor.data_ptr() != param.data_ptr():
                raise ValueError(
                    f"weight {name}: the native engine holds the actor's own tensor here (EngineContext.shared, "
                    "a weight that stays constant for the run) and cannot load other values into it"
                )
        else:
            param.copy_(tensor)
        count += 1
    if unknown:
        raise ValueError(f"{len(unknown)} weights have no parameter in the native engine's model: {unknown[:5]}")
    return count


def share_weights(model: nn.Module, shared: dict[str, torch.Tensor]) -> frozenset[str]:
    """Point each parameter named in `shared` (EngineContext.shared: the actor's tensors that never
    change) at that tensor instead of holding a copy, where shape, dtype and device agree; returns
    the names of the parameters that now alias the actor. Done before the first load, which then
    copies nothing into them; their own storage is freed, and the caller returns it to the
    device before sizing its KV cache. A parameter that is a block of a fused tensor (q_proj's
    weight and bias in the fused qkv, gate_proj's in gate/up) keeps its copy: the fused tensor is
    what the forward multiplies with, and pointing the block elsewhere would leave it stale."""
    params = dict(model.named_parameters())
    aliased = []
    for name, tensor in shared.items():
        name = hf_name(name)
        param = params.get(name)
        if param is None or (param.shape, param.dtype, param.device) != (tensor.shape, tensor.dtype, tensor.device):
            continue
        if param.untyped_storage().nbytes() != param.numel() * param.element_size():  # a block of a fused tensor
            continue
        param.data = tensor.detach()
        aliased.append(name)
    return frozenset(aliased)


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
