"""Small rollout batches for update tests: random token ids, three groups of two samples."""

from __future__ import annotations

import torch

from minirl.batch import RolloutBatch, response_mask

ADVANTAGES = (1.0, -1.0, 0.5, -0.5, 2.0, -2.0)  # one per sequence, signs alternating within a group


def three_groups(seed: int, prompt_lens: list[int], response_lens: list[int]) -> RolloutBatch:
    """Six sequences (groups 0, 0, 1, 1, 2, 2) with a mask and per-token advantages (ADVANTAGES
    broadcast over each response); token ids drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, 250, (n,), generator=g).tolist() for n in response_lens]
    mask_BT = response_mask(responses, torch.device("cpu"))
    batch = RolloutBatch(prompts, responses, torch.tensor([0, 0, 1, 1, 2, 2]), mask_BT)
    batch.advantages_BT = torch.tensor(ADVANTAGES)[:, None] * mask_BT
    return batch
