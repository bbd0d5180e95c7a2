"""DAPO's overlong reward shaping (Yu et al. 2025, "soft overlong punishment"; formula in
docs/algorithms.md §8). |y| is the response's model-token count, EOS included: the sum of its
response mask, as verl's valid response length. In a multi-turn response the tool and user
tokens (mask 0) are not the model's length and are not counted; for a single-turn response the
count is the response's length. Shape legend: B sequences.
"""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths_B, max_response_length: int, cfg) -> torch.Tensor:
    """penalty_B (float32, <= 0) for `cfg` = reward.overlong_buffer; all zero when disabled.

    response_lengths_B: each response's model-token count (mask_BT.sum(-1)), not its length
    with tool tokens."""
    lengths_B = torch.as_tensor(response_lengths_B, dtype=torch.float64)
    if not cfg.enable:
        return torch.zeros_like(lengths_B, dtype=torch.float32)
    expected = max_response_length - cfg.len
    exceed_B = lengths_B - expected
    penalty_B = torch.clamp(-exceed_B / cfg.len * cfg.penalty_factor, max=0.0)
    return penalty_B.to(torch.float32)
