"""Parameter names as Hugging Face writes them: the prefixes that wrappers add are removed."""

from __future__ import annotations

# prefixes that wrappers add to parameter names; the engines want Hugging Face names
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", "module.")


def hf_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
