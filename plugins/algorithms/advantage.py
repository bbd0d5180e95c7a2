"""Built-in advantage estimators, selected by algorithm.adv_estimator: definitions and shared
rules in docs/algorithms.md §2. Each is fn(inputs: AdvantageInputs, cfg: AlgorithmConfig) ->
(advantages_BT, returns_BT); masked positions of every output are exactly 0.

The conventions the code refers to by number:
1. The score of sequence i is s_i = Σ_t token_rewards[i, t]·m[i, t].
2. Groups come from inputs.group_B (uid), never from batch position; group statistics are
   vectorised (torch.unique + index_add / scatter_reduce), no Python loop over groups.
3. A group of one has no baseline: its advantage is its score (grpo: mean 0, std 1).
4. A group of two or more equal scores gets exactly 0, not the rounding residue of s − mean(s)
   divided by 1e-6 (which can be O(1) for non-dyadic scores).
5. Token-level recursions (reinforce_plus_plus, gae) skip masked holes (a multi-turn
   response's tool and user tokens) and discount over valid tokens only, as a log-depth parallel
   scan instead of a Python loop over T: at a masked position the scan's factor is 1 and its
   input 0, so the running return, the running advantage and V_next pass through unchanged.
   Rewards and values at masked positions are never read (multiplied by the mask first).
6. Batch-wide whitening uses inputs.reduce, so it is exact over all data-parallel ranks.

Shape legend: B sequences, T response positions, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minirl import hookimpl
from minirl.algo.stats import masked_whiten
from minirl.protocols import AdvantageInputs

GRPO_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# group statistics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Groups:
    """Dense group index of each sequence (0..n−1), from the uid whatever its values or order."""

    idx_B: torch.Tensor
    n: int

    @classmethod
    def of(cls, group_B: torch.Tensor) -> "_Groups":
        uids_G, idx_B = torch.unique(group_B, return_inverse=True)
        return cls(idx_B=idx_B, n=uids_G.numel())

    def sum_B(self, x_B: torch.Tensor) -> torch.Tensor:
        """Σ of x over the sequence's group, gathered back to every sequence."""
        return x_B.new_zeros(self.n).index_add_(0, self.idx_B, x_B)[self.idx_B]

    def extreme_B(self, x_B: torch.Tensor, reduce: str) -> torch.Tensor:
        out_G = x_B.new_zeros(self.n).scatter_reduce_(0, self.idx_B, x_B, reduce, include_self=False)
        return out_G[self.idx_B]


def _scores_and_stats(inputs: AdvantageInputs) -> tuple[torch.Tensor, _Groups, dict[str, torch.Tensor]]:
    """Each sequence's score (convention 1), its group and the per-sequence view of the group's
    size, mean, unbiased std and all-equal flag."""
    s_B = (inputs.token_rewards_BT * inputs.mask_BT).sum(-1)
    groups = _Groups.of(inputs.group_B)
    count_B = groups.sum_B(torch.ones_like(s_B))
    mean_B = groups.sum_B(s_B) / count_B
    # Two-pass variance: Σ(s − mean)² is exact for equal scores, unlike Σs² − n·mean².
    var_B = groups.sum_B((s_B - mean_B) ** 2) / (count_B - 1.0).clamp(min=1.0)
    equal_B = (groups.extreme_B(s_B, "amax") == groups.extreme_B(s_B, "amin")) & (count_B > 1)
    return s_B, groups, {"count": count_B, "mean": mean_B, "std": var_B.sqrt(), "equal": equal_B}


def _tile(adv_B: torch.Tensor, stats: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> torch.Tensor:
    """adv_B on every valid token; exactly 0 for every member of a group of >= 2 equal scores
    (convention 4)."""
    return torch.where(stats["equal"], torch.zeros_like(adv_B), adv_B).unsqueeze(-1) * mask_BT


# ---------------------------------------------------------------------------------------------
# outcome estimators
# ---------------------------------------------------------------------------------------------


def grpo(inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = (s_i − mean_g) / (std_g + 1e-6), std unbiased; group of one: mean 0, std 1.

    cfg.norm_adv_by_std_in_grpo = False (Dr.GRPO): A_i = s_i − mean_g. Returns = advantages.
    """
    s_B, _, st = _scores_and_stats(inputs)
    single_B = st["count"] == 1
    mean_B = torch.where(single_B, torch.zeros_like(s_B), st["mean"])
    adv_B = s_B - mean_B
    if cfg.norm_adv_by_std_in_grpo:
        std_B = torch.where(single_B, torch.ones_like(s_B), st["std"])
        adv_B = adv_B / (std_B + GRPO_EPS)
    adv_BT = _tile(adv_B, st, inputs.mask_BT)
    return adv_BT, adv_BT


def rloo(inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = s_i − mean of the other n−1 scores = n/(n−1)·(s_i − mean_g); group of one: s_i."""
    s_B, _, st = _scores_and_stats(inputs)
    n_B = st["count"]
    loo_B = n_B / (n_B - 1.0).clamp(min=1.0) * (s_B - st["mean"])
    adv_BT = _tile(torch.where(n_B == 1, s_B, loo_B), st, inputs.mask_BT)
    return adv_BT, adv_BT


def opo(inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: A_i = s_i − b_g, b_g = Σ_j len_j·s_j / Σ_j len_j (length-weighted group baseline).

    len_j = Σ_t m[j, t], the model tokens (a multi-turn response's tool tokens do not count).
    Choice: a group of one gets baseline 0, so A_i = s_i (as verl's OPO, and as grpo/rloo treat
    a group of one); a group whose lengths are all 0 gets baseline 0 (its advantages are masked
    to 0 anyway). Returns = advantages.
    """
    s_B, groups, st = _scores_and_stats(inputs)
    len_B = inputs.mask_BT.sum(-1).to(s_B.dtype)
    baseline_B = groups.sum_B(len_B * s_B) / groups.sum_B(len_B).clamp(min=1.0)
    baseline_B = torch.where(st["count"] == 1, torch.zeros_like(s_B), baseline_B)
    adv_BT = _tile(s_B - baseline_B, st, inputs.mask_BT)
    return adv_BT, adv_BT


def reinforce_plus_plus_baseline(inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """a_i = s_i − mean_g (group of one: s_i), tiled over valid tokens, then masked_whiten over
    the whole (global) batch. Returns = advantages."""
    s_B, _, st = _scores_and_stats(inputs)
    a_BT = _tile(torch.where(st["count"] == 1, s_B, s_B - st["mean"]), st, inputs.mask_BT)
    adv_BT = masked_whiten(a_BT, inputs.mask_BT, inputs.reduce)
    return adv_BT, adv_BT


# ---------------------------------------------------------------------------------------------
# token-level estimators
# ---------------------------------------------------------------------------------------------


def reverse_linear_scan(a_BT: torch.Tensor, b_BT: torch.Tensor) -> torch.Tensor:
    """x[t] = b[t] + a[t]·x[t+1] with x[T] = 0, in ceil(log2 T) vectorised doubling steps.

    After the step with span s, x[t] holds the recursion unrolled over [t, t+s) and a[t] the
    product of a over that span (0 once the span passes T, where x is 0).
    """
    a, x = a_BT, b_BT
    span = 1
    while span < x.shape[-1]:
        x = torch.cat([x[:, :-span] + a[:, :-span] * x[:, span:], x[:, -span:]], dim=-1)
        a = torch.cat([a[:, :-span] * a[:, span:], torch.zeros_like(a[:, -span:])], dim=-1)
        span *= 2
    return x


def _next_valid(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """x at the next valid position after t (0 if none): the bootstrap target of GAE."""
    m_next_BT = torch.nn.functional.pad(mask_BT[:, 1:], (0, 1))
    x_next_BT = torch.nn.functional.pad(x_BT[:, 1:], (0, 1))
    # y[t] = m[t+1]·x[t+1] + (1 − m[t+1])·y[t+1]
    return reverse_linear_scan(1.0 - m_next_BT, m_next_BT * x_next_BT)


def reinforce_plus_plus(inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """G[t] = r[t] + γ·G[next valid t], 0 after the last valid token; A = masked_whiten(G).

    Returns = G (unwhitened). No groups: every token of the batch is whitened together.
    """
    m_BT = inputs.mask_BT.to(inputs.token_rewards_BT.dtype)
    discount_BT = torch.where(m_BT > 0, torch.full_like(m_BT, cfg.gamma), torch.ones_like(m_BT))
    returns_BT = reverse_linear_scan(discount_BT, inputs.token_rewards_BT * m_BT) * m_BT
    return masked_whiten(returns_BT, m_BT, inputs.reduce), returns_BT


def gae(inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γλ·A_next over valid tokens, bootstrap 0 after
    the last; returns = A + V (before whitening); A = masked_whiten(A, m)."""
    assert inputs.values_BT is not None, "gae needs a critic's values: the trainer builds one for it (needs_values)"
    r_BT = inputs.token_rewards_BT
    m_BT = inputs.mask_BT.to(r_BT.dtype)
    v_BT = inputs.values_BT.to(r_BT.dtype) * m_BT
    delta_BT = (r_BT + cfg.gamma * _next_valid(v_BT, m_BT) - v_BT) * m_BT
    decay_BT = torch.where(m_BT > 0, torch.full_like(m_BT, cfg.gamma * cfg.lam), torch.ones_like(m_BT))
    adv_BT = reverse_linear_scan(decay_BT, delta_BT) * m_BT
    returns_BT = (adv_BT + v_BT) * m_BT
    return masked_whiten(adv_BT, m_BT, inputs.reduce), returns_BT


gae.needs_values = True  # the trainer builds a critic for it (minirl.critic.needs_values)


@hookimpl
def minirl_advantage_estimators() -> dict:
    return {
        "grpo": grpo,
        "rloo": rloo,
        "reinforce_plus_plus": reinforce_plus_plus,
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
        "opo": opo,
        "gae": gae,
    }
