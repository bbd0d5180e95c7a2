"""Rotary position embeddings: inverse frequencies for the rope types of the supported families.

Reads both config styles: transformers >= 5 (`rope_parameters`) and 4.x (`rope_theta`,
`rope_scaling`).
"""

from __future__ import annotations

import math

import torch

from minirl.errors import UserError


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params:
        params = dict(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inv_frequencies(params: dict, head_dim: int) -> torch.Tensor:
    """inv_freq_F (F = head_dim / 2), float32, the way transformers computes it."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponent)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        return _llama3(inv_freq, params)
    raise UserError(
        f"the model's rope_parameters.rope_type = {kind!r} is not supported by rollout.name = 'native' "
        "(it supports default and llama3); use rollout.name = 'hf' for this model"
    )


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth band between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_PF, sin_PF in float32 for positions [0, max_positions)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos().to(device).contiguous(), freqs.sin().to(device).contiguous()
