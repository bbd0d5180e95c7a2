"""From trajectories to the step's batch, and how a training rollout samples. Both sides of an
asynchronous job use these too (minirl.async_training). Legend: B sequences, T response positions.
"""

from __future__ import annotations

import torch

from minirl.algo.rollout_corr import require_rollout_log_probs, rollout_log_probs_BT
from minirl.batch import RolloutBatch, trajectory_mask
from minirl.protocols import Completion, SamplingParams, Trajectory


def sampling_params(rollout_cfg, max_new_tokens: int, seed: int) -> SamplingParams:
    """How a training rollout samples (rollout.*): one sample per request (the n samples of a
    prompt are requests of their own), the whole response budget each (data.max_response_length)."""
    r = rollout_cfg
    return SamplingParams(
        n=1,
        temperature=r.temperature if r.do_sample else 0.0,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=max_new_tokens,
        ignore_eos=r.ignore_eos,
        seed=seed,
    )


def rollout_seed(seed: int, number: int, rank: int) -> int:
    """The sampling seed of prompt batch `number` on `rank`: distinct per batch and rank."""
    return seed * 1_000_003 + number * 1009 + rank


def to_batch(records: list, uids: list[int], trajectories: list[Trajectory], rollout_cfg, tis_cap: float, device):
    """The RolloutBatch of expanded records and their trajectories (the mask with holes, and the
    engine's log-probs when rollout.calculate_log_probs; actor.tis_imp_ratio_cap needs them)."""
    batch = RolloutBatch(
        prompts=[t.prompt_ids for t in trajectories],
        responses=[t.response_ids for t in trajectories],
        group_B=torch.tensor(uids, dtype=torch.long),
        mask_BT=trajectory_mask([t.response_mask for t in trajectories], device),
        records=records,
        finish_reasons=[t.finish_reason for t in trajectories],
        trajectories=trajectories,
    )
    if rollout_cfg.calculate_log_probs:
        completions = [Completion(t.response_ids, t.logprobs) for t in trajectories]
        batch.rollout_log_probs_BT = rollout_log_probs_BT(completions, batch.mask_BT, rollout_cfg.name)
        require_rollout_log_probs(batch.rollout_log_probs_BT, tis_cap, rollout_cfg.name)
    return batch


def model_tokens(trajectories: list[Trajectory]) -> int:
    """Response tokens the model sampled (tool and user tokens left out)."""
    return sum(t.response_mask.count(1) for t in trajectories)
