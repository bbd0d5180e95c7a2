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
    """The whole tensor of a DTensor shard (FSDP2), on its mesh's device; or the tensor itself.
    Every rank must call it (a gather)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        if t.device.type != t.device_mesh.device_type:  # a CPU-offloaded shard: NCCL gathers device memory
            t = t.to(t.device_mesh.device_type)
        t = t.full_tensor()
    return t
