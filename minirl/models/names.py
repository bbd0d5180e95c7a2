"""Parameters as Hugging Face has them, whatever wraps the model: names without the prefixes
that wrappers add, tensors whole where FSDP2 shards them."""

from __future__ import annotations

import torch

# prefixes that wrappers add to parameter names; the engines want Hugging Face names
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", "module.")


def hf_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (FSDP2), on its mesh's device; or the tensor itself,
    detached. Every rank must call it (a gather). On a one-rank mesh (one GPU) the shard is the
    whole tensor: it comes as it lies, the shard's own storage (for readers: every caller reads it
    or copies it), taken out first and detached itself, without DTensor's redistribution, which
    gathers nothing there either, nor a detach of the DTensor, which goes through its dispatch:
    4 us a call against 40 and 10 (a 1-rank gloo mesh, CPU, under no_grad), and a weight sync
    makes one call per parameter, three per LoRA matrix."""
    if not hasattr(t, "full_tensor"):
        return t.detach()
    mesh = t.device_mesh
    if mesh.size() == 1:
        local = t.to_local().detach()
        if local.shape == t.shape:
            return local if local.device.type == mesh.device_type else local.to(mesh.device_type)
    t = t.detach()
    if t.device.type != mesh.device_type:  # a CPU-offloaded shard: NCCL gathers device memory
        t = t.to(mesh.device_type)
    return t.full_tensor()
