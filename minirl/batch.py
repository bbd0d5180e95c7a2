"""The rollout batch of one step and how it is cut into mini- and micro-batches.

Sequences are kept unpadded (lists of token ids) for the packed forward passes, and as padded
[B, T] tensors (T = the longest response of the step) for the per-token math.

The response mask: 1 at the tokens the model sampled (EOS included), 0 at tool and user tokens
inside a multi-turn response (a mask with holes) and in the padding after it. The forward runs
over every response token, so the model reads the tool text; every loss, statistic and estimator
counts only the mask's 1s (docs/algorithms.md). Lengths (len(response)) stay right for packing
and token budgets; the number of trained tokens is the mask's sum.
Legend: B sequences, T response positions.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from minirl.dist.transfer import to_device


@dataclass
class RolloutBatch:
    """One step's sequences on this rank, prompt-major (the n samples of a prompt are adjacent),
    and the per-sequence [B] and per-token [B, T] tensors the step's phases add to it.

    field                  written by (minirl.trainer phase)     read by
    mask_BT                gen (1.0 at model tokens, see above)  every phase
    rollout_log_probs_BT   gen (rollout.calculate_log_probs)     update_actor (TIS, rollout_corr/*)
    scores_B               reward                                dynamic sampling, data metrics
    token_scores_BT        reward (score on last model token)    adv, dynamic sampling, guard
    old_log_probs_BT       old_log_prob (not on-policy), or the  adv (KL in reward), update_actor, guard
                           asynchronous source (bypass mode)
    ref_log_probs_BT       ref (a KL loss or KL in the reward)   adv (KL in reward), update_actor, guard
    values_BT              values (an estimator of values)       adv, update_critic, value metrics
    rewards_BT             adv (token scores − β·KL)             data metrics, guard
    advantages_BT          adv                                   update_actor, data metrics, guard
    returns_BT             adv                                   update_critic, data and value metrics

    A field no phase of the run writes stays None. `select`, `concat` and `to` carry every field.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    group_B: torch.Tensor  # int64 uid, on the CPU
    mask_BT: torch.Tensor
    records: list = field(default_factory=list)  # the PromptRecord of each sequence
    finish_reasons: list[str] = field(default_factory=list)
    trajectories: list = field(default_factory=list)  # the agent loops' Trajectory of each sequence
    rollout_log_probs_BT: torch.Tensor | None = None
    scores_B: torch.Tensor | None = None
    token_scores_BT: torch.Tensor | None = None
    old_log_probs_BT: torch.Tensor | None = None
    ref_log_probs_BT: torch.Tensor | None = None
    values_BT: torch.Tensor | None = None
    rewards_BT: torch.Tensor | None = None
    advantages_BT: torch.Tensor | None = None
    returns_BT: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.responses)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every field that holds a tensor, by name, in declaration order."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: v for name, v in values.items() if isinstance(v, torch.Tensor)}

    def seq_lens(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def select(self, idx: list[int]) -> RolloutBatch:
        t, tensors = torch.tensor(idx, dtype=torch.long), self.tensors()
        on_device = {}  # the index, copied once to each device the tensors live on
        for v in tensors.values():
            if v.device not in on_device:
                on_device[v.device] = to_device(t, v.device)
        return dataclasses.replace(
            self,
            prompts=[self.prompts[i] for i in idx],
            responses=[self.responses[i] for i in idx],
            records=[self.records[i] for i in idx] if self.records else [],
            finish_reasons=[self.finish_reasons[i] for i in idx] if self.finish_reasons else [],
            trajectories=[self.trajectories[i] for i in idx] if self.trajectories else [],
            **{k: v[on_device[v.device]] for k, v in tensors.items()},
        )

    def to(self, device: torch.device) -> RolloutBatch:
        """The batch with its tensors on `device` (the uids stay on the CPU, as generate makes them)."""
        tensors = {k: v.to(device) for k, v in self.tensors().items()}
        return dataclasses.replace(self, **{**tensors, "group_B": self.group_B.cpu()})


def response_mask(responses: list[list[int]], device) -> torch.Tensor:
    """1.0 for each generated token (EOS included), 0.0 in the padding after it."""
    width = max(1, max(len(r) for r in responses))
    lens = torch.tensor([len(r) for r in responses], device=device)
    return (torch.arange(width, device=device)[None, :] < lens[:, None]).float()


def trajectory_mask(masks: list[list[int]], device) -> torch.Tensor:
    """mask_BT of multi-turn responses: row b is masks[b] (1 at model tokens, 0 at tool/user
    tokens, one entry per response token), right-padded with 0.0 to the longest. With masks of
    all ones it is response_mask of the same responses, bit for bit."""
    lens_B = np.fromiter(map(len, masks), np.int64, len(masks))
    width = max(1, int(lens_B.max(initial=0)))
    flat_N = np.fromiter(itertools.chain.from_iterable(masks), np.float32, int(lens_B.sum()))
    assert np.isin(flat_N, (0.0, 1.0)).all(), "a response mask holds 0 and 1 only"
    out_BT = np.zeros(len(masks) * width, np.float32)
    out_BT[ragged_arange(np.arange(len(masks), dtype=np.int64) * width, lens_B)] = flat_N
    return to_device(torch.from_numpy(out_BT.reshape(len(masks), width)), device)


def ragged_arange(starts_S: np.ndarray, lens_S: np.ndarray) -> np.ndarray:
    """arange(starts_S[s], starts_S[s] + lens_S[s]) for every s, concatenated, as int64: one shift
    per run of arange(sum of lens) instead of an arange and a concatenation per run (a host cost
    paid per micro-batch)."""
    return np.repeat(starts_S - (np.cumsum(lens_S) - lens_S), lens_S) + np.arange(int(lens_S.sum()), dtype=np.int64)


def scatter_rows(flat_N: torch.Tensor, lens: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-response-token values (sequence-major, unpadded) in the padded [B, T] layout, given each
    row's token count on the host: row b's first lens[b] positions take the next lens[b] values,
    and positions where mask_BT is 0 are 0 (all of the placeholder micro-batch's, select_micro).
    flat_N may carry trailing dimensions ([N, k] -> [B, T, k]: several values, one index).
    An index_put, whose backward is a gather: masked_scatter's backward (masked_select) reads a
    count back from the device, which would stop the host once per micro-batch of the update."""
    B, T = mask_BT.shape
    rest = flat_N.shape[1:]
    idx_N = ragged_arange(np.arange(B, dtype=np.int64) * T, np.asarray(lens, dtype=np.int64))  # row b from b * T
    idx_N = to_device(torch.from_numpy(idx_N), flat_N.device)
    flat_BT = flat_N.new_zeros(B * T, *rest).index_put((idx_N,), flat_N).view(B, T, *rest)
    keep = mask_BT.to(flat_BT.device).bool().view(B, T, *([1] * len(rest)))
    return torch.where(keep, flat_BT, 0.0)


def mini_batches(n_seqs: int, seqs_per_mini: int, order: torch.Tensor | None = None) -> list[list[int]]:
    """Cut the rank's sequences into mini-batches of `seqs_per_mini` (whole prompt groups)."""
    idx = list(range(n_seqs)) if order is None else order.tolist()
    return [idx[i : i + seqs_per_mini] for i in range(0, n_seqs, seqs_per_mini)]


@dataclass(frozen=True)
class MicroBatching:
    """How a pass cuts its sequences into micro-batches, built once from its config section
    (minirl.build): `per_gpu` sequences each, or with `dynamic` (use_dynamic_bsz) the fewest
    micro-batches of at most `max_tokens` tokens per GPU each."""

    per_gpu: int
    dynamic: bool = False
    max_tokens: int = 0

    def describe(self) -> str:
        return f"dynamic, <= {self.max_tokens} tokens/GPU" if self.dynamic else f"{self.per_gpu} sequences/GPU"


def _by_tokens(lens: list[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """Balanced partition into the fewest micro-batches whose token counts stay near `budget`.

    Longest-first onto the lightest bin (LPT). `min_count` lets data-parallel ranks agree on one
    number of micro-batches (every rank must run the same number of forwards under FSDP).
    """
    # validation refuses a budget below max_prompt_length + max_response_length (minirl.validate)
    assert max(lens, default=0) <= budget, f"a sequence of {max(lens)} tokens exceeds the budget {budget}"
    idx = list(range(len(lens)))
    count = max(min_count, -(-sum(lens) // budget), 1)
    count = min(count, len(idx)) if idx else count
    bins: list[tuple[int, int, list[int]]] = [(0, b, []) for b in range(count)]
    for n, i in sorted(zip(lens, idx), reverse=True):
        load, b, members = heapq.heappop(bins)
        members.append(i)
        heapq.heappush(bins, (load + n, b, members))
    return [sorted(members) for _, _, members in sorted(bins, key=lambda x: x[1]) if members]


def split_micro(batch: RolloutBatch, micro: MicroBatching, agree=None, sp_size: int = 1) -> list[list[int]]:
    """The batch's sequence indices cut into micro-batches as `micro` says.

    With Ulysses each GPU holds 1/sp_size of a micro-batch's tokens, so the budget grows with it.
    `agree(count)` returns the largest count over the data-parallel ranks: under FSDP every rank
    must run the same number of forward passes (collectives inside). A rank left with fewer
    micro-batches gets empty ones ([]); `select_micro` turns those into placeholders.
    """
    if micro.dynamic:
        lens, budget = batch.seq_lens(), micro.max_tokens * sp_size
        parts = _by_tokens(lens, budget)
    else:
        idx = list(range(len(batch)))
        parts = [idx[i : i + micro.per_gpu] for i in range(0, len(idx), micro.per_gpu)]
    count = agree(len(parts)) if agree else len(parts)
    if micro.dynamic and count > len(parts):
        parts = _by_tokens(lens, budget, min_count=count)
    return parts + [[] for _ in range(count - len(parts))]


def select_micro(batch: RolloutBatch, idx: list[int]) -> RolloutBatch:
    """batch.select(idx); for an empty idx a placeholder: sequence 0 with an all-zero mask. It runs
    the same forward and backward as a real micro-batch and adds nothing to any loss, gradient or
    metric (they are all sums over masked tokens)."""
    if idx:
        return batch.select(idx)
    sub = batch.select([0])
    sub.mask_BT = torch.zeros_like(sub.mask_BT)
    return sub


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """The batches one after another. [B, T] tensors are re-padded with zeros to the longest
    response of the result (past its length a row holds only padding); [B] tensors are joined.
    The batches must hold the same fields."""
    width = max(1, max((len(r) for b in batches for r in b.responses), default=0))
    names = batches[0].tensors().keys()
    for b in batches[1:]:
        if b.tensors().keys() != names:
            raise ValueError(f"cannot join batches holding {sorted(names)} and {sorted(b.tensors())}")
    return RolloutBatch(
        prompts=[p for b in batches for p in b.prompts],
        responses=[r for b in batches for r in b.responses],
        records=[rec for b in batches for rec in b.records],
        finish_reasons=[f for b in batches for f in b.finish_reasons],
        trajectories=[t for b in batches for t in b.trajectories],
        **{k: torch.cat([_to_width(getattr(b, k), width) for b in batches]) for k in names},
    )


def _to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.ndim < 2:
        return x
    if x.shape[1] >= width:
        return x[:, :width]
    out = x.new_zeros((x.shape[0], width, *x.shape[2:]))
    out[:, : x.shape[1]] = x
    return out
