"""Dynamic sampling's group filter (DAPO, Yu et al. 2025, §3.2; verl's algorithm.filter_groups):
which groups carry signal, and which of them a step keeps. A group (the rollout.n samples of one
prompt) whose metric is the same for every sample gets zero advantage from GRPO-style
estimators; with m_gi the metric of sample i of group g,

    informative(g)  <=>  max_i m_gi != min_i m_gi      (zero variance <=> all equal)

The loop that draws prompt batches until a step holds enough of them is
minirl.rollout.dynamic_sampling. Legend: B sequences, G groups, R data-parallel ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

from minirl.batch import RolloutBatch

# algorithm.filter_groups.metric -> the per-sequence value [B] whose spread within a group decides
SEQUENCE_METRICS: dict[str, Callable[[RolloutBatch], torch.Tensor]] = {
    "score": lambda b: b.scores_B,  # what the reward function returned
    "seq_reward": lambda b: b.token_scores_BT.sum(-1),  # the token-level scores summed (shaping included)
    # the rewards the advantage sees: seq_reward, as the KL penalty needs log-probs computed after
    # the filter (validation refuses this metric with use_kl_in_reward)
    "seq_final_reward": lambda b: b.token_scores_BT.sum(-1),
}

Key = tuple[int, int, int]  # (generation batch of the step, data-parallel rank, group on that rank)


def informative_groups(batch: RolloutBatch, metric: str, n: int) -> torch.Tensor:
    """[G] bool: the metric differs between the n samples of the group (prompt-major batch)."""
    values_GN = SEQUENCE_METRICS[metric](batch).detach().double().cpu().reshape(-1, n)
    return values_GN.amax(1) != values_GN.amin(1)


def choose_groups(flags: list[torch.Tensor], target: int, ranks: int) -> tuple[list[Key], int]:
    """The kept groups in global order, and how many of them are uninformative.

    The first `target` informative groups; fewer (the cap was hit) are rounded up to a positive
    multiple of `ranks` with the first uninformative ones. `target` is a multiple of `ranks`, and
    each generation batch holds `target` groups, so the first batch holds enough of those.
    """
    order = [(d, r, j) for d, f_RG in enumerate(flags) for r in range(f_RG.shape[0]) for j in range(f_RG.shape[1])]
    informative = [k for k in order if flags[k[0]][k[1], k[2]]][:target]
    wanted = max(ranks, -(-len(informative) // ranks) * ranks)
    padding = [k for k in order if not flags[k[0]][k[1], k[2]]][: wanted - len(informative)]
    return sorted(informative + padding), len(padding)
