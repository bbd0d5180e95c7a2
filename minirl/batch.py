"""The rollout batch of one step and how it is cut into mini- and micro-batches.

Sequences are kept unpadded (lists of token ids) for the packed forward passes, and as padded
[B, T] tensors (T = the longest response of the step) for the per-token math.
Legend: B sequences, T response positions.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from minirl.dist.transfer import to_device
from minirl.errors import UserError


@dataclass
class RolloutBatch:
    """One step's sequences on this rank, prompt-major (the n samples of a prompt are adjacent)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    group_B: torch.Tensor  # int64 uid
    records: list = field(default_factory=list)  # the PromptRecord of each sequence
    finish_reasons: list[str] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, T] or [B]

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def mask_BT(self) -> torch.Tensor:
        return self.tensors["mask"]

    def seq_lens(self, idx: list[int] | None = None) -> list[int]:
        idx = range(len(self)) if idx is None else idx
        return [len(self.prompts[i]) + len(self.responses[i]) for i in idx]

    def select(self, idx: list[int]) -> "RolloutBatch":
        t = torch.tensor(idx, dtype=torch.long)
        on_device = {}  # the index, copied once to each device the tensors live on
        for v in self.tensors.values():
            if v.device not in on_device:
                on_device[v.device] = to_device(t, v.device)
        return RolloutBatch(
            prompts=[self.prompts[i] for i in idx],
            responses=[self.responses[i] for i in idx],
            group_B=self.group_B[t],
            records=[self.records[i] for i in idx] if self.records else [],
            finish_reasons=[self.finish_reasons[i] for i in idx] if self.finish_reasons else [],
            tensors={k: v[on_device[v.device]] for k, v in self.tensors.items()},
        )


def response_mask(responses: list[list[int]], device) -> torch.Tensor:
    """1.0 for each generated token (EOS included), 0.0 in the padding after it."""
    width = max(1, max(len(r) for r in responses))
    lens = torch.tensor([len(r) for r in responses], device=device)
    return (torch.arange(width, device=device)[None, :] < lens[:, None]).float()


def scatter_tokens(flat_N: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Put per-response-token values (sequence-major, unpadded) into the padded [B, T] layout."""
    out_BT = torch.zeros(mask_BT.shape, dtype=flat_N.dtype, device=flat_N.device)
    return out_BT.masked_scatter(mask_BT.bool().to(flat_N.device), flat_N)


def ragged_arange(starts_S: np.ndarray, lens_S: np.ndarray) -> np.ndarray:
    """arange(starts_S[s], starts_S[s] + lens_S[s]) for every s, concatenated, as int64: one shift
    per run of arange(sum of lens) instead of an arange and a concatenation per run (a host cost
    paid per micro-batch)."""
    return np.repeat(starts_S - (np.cumsum(lens_S) - lens_S), lens_S) + np.arange(int(lens_S.sum()), dtype=np.int64)


def scatter_rows(flat_N: torch.Tensor, lens: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
    """scatter_tokens for the training loss, given each row's token count on the host: row b's
    first lens[b] positions take the next lens[b] values, and positions where mask_BT is 0 are 0
    (all of the placeholder micro-batch's, select_micro). flat_N may carry trailing dimensions
    ([N, k] -> [B, T, k]: several per-token values, one index). The same values as scatter_tokens
    for a response mask, through an index_put whose backward is a gather; masked_scatter's
    backward (masked_select) reads a count back from the device, which would stop the host once
    per micro-batch of the update."""
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


def micro_batches_by_count(idx: list[int], per_micro: int) -> list[list[int]]:
    return [idx[i : i + per_micro] for i in range(0, len(idx), per_micro)]


def micro_batches_by_tokens(
    idx: list[int], lens: list[int], budget: int, key: str, min_count: int = 1
) -> list[list[int]]:
    """Balanced partition into the fewest micro-batches whose token counts stay near `budget`.

    Longest-first onto the lightest bin (LPT). `min_count` lets data-parallel ranks agree on one
    number of micro-batches (every rank must run the same number of forwards under FSDP).
    """
    too_long = [(i, n) for i, n in zip(idx, lens) if n > budget]
    if too_long:
        i, n = too_long[0]
        raise UserError(
            f"{key} = {budget}: sequence {i} has {n} tokens (prompt + response), more than the budget; "
            f"raise {key} to at least max_prompt_length + max_response_length"
        )
    count = max(min_count, -(-sum(lens) // budget), 1)
    count = min(count, len(idx)) if idx else count
    bins: list[tuple[int, int, list[int]]] = [(0, b, []) for b in range(count)]
    for n, i in sorted(zip(lens, idx), reverse=True):
        load, b, members = heapq.heappop(bins)
        members.append(i)
        heapq.heappush(bins, (load + n, b, members))
    return [sorted(members) for _, _, members in sorted(bins, key=lambda x: x[1]) if members]


def split_micro(
    batch: RolloutBatch,
    idx: list[int],
    per_micro: int,
    dynamic: bool,
    budget: int,
    key: str,
    agree=None,
    sp_size: int = 1,
) -> list[list[int]]:
    """Micro-batches by count (`per_micro` sequences) or by token budget (`use_dynamic_bsz`).

    With Ulysses each GPU holds 1/sp_size of a micro-batch's tokens, so the budget grows with it.
    `agree(count)` returns the largest count over the data-parallel ranks: under FSDP every rank
    must run the same number of forward passes (collectives inside). A rank left with fewer
    micro-batches gets empty ones ([]); `select_micro` turns those into placeholders.
    """
    if not dynamic:
        micro = micro_batches_by_count(idx, per_micro)
        count = agree(len(micro)) if agree else len(micro)
        return micro + [[] for _ in range(count - len(micro))]
    lens = batch.seq_lens(idx)
    if sp_size > 1:
        _check_sp_budget(lens, budget, sp_size, key)
        budget *= sp_size
    micro = micro_batches_by_tokens(idx, lens, budget, key)
    count = agree(len(micro)) if agree else len(micro)
    if count > len(micro):
        micro = micro_batches_by_tokens(idx, lens, budget, key, min_count=count)
    return micro + [[] for _ in range(count - len(micro))]


def _check_sp_budget(lens: list[int], budget: int, sp_size: int, key: str) -> None:
    longest = max(lens, default=0)
    if longest > budget * sp_size:
        raise UserError(
            f"{key} = {budget} (x ulysses_sequence_parallel_size {sp_size} = {budget * sp_size} tokens per "
            f"micro-batch): a sequence has {longest} tokens (prompt + response); raise {key} to at least "
            f"{-(-longest // sp_size)}"
        )


def select_micro(batch: RolloutBatch, idx: list[int]) -> RolloutBatch:
    """batch.select(idx); for an empty idx a placeholder: sequence 0 with an all-zero mask. It runs
    the same forward and backward as a real micro-batch and adds nothing to any loss, gradient or
    metric (they are all sums over masked tokens)."""
    if idx:
        return batch.select(idx)
    sub = batch.select([0])
    sub.tensors["mask"] = torch.zeros_like(sub.tensors["mask"])
    return sub


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """The batches one after another. [B, T] tensors are re-padded with zeros to the longest
    response of the result (past its length a row holds only padding); [B] tensors are joined."""
    width = max(1, max((len(r) for b in batches for r in b.responses), default=0))
    names = batches[0].tensors.keys()
    for b in batches[1:]:
        if b.tensors.keys() != names:
            raise ValueError(f"cannot join batches holding {sorted(names)} and {sorted(b.tensors)}")
    return RolloutBatch(
        prompts=[p for b in batches for p in b.prompts],
        responses=[r for b in batches for r in b.responses],
        group_B=torch.cat([b.group_B for b in batches]),
        records=[rec for b in batches for rec in b.records],
        finish_reasons=[f for b in batches for f in b.finish_reasons],
        tensors={k: torch.cat([_to_width(b.tensors[k], width) for b in batches]) for k in names},
    )


def _to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.ndim < 2:
        return x
    if x.shape[1] >= width:
        return x[:, :width]
    out = x.new_zeros((x.shape[0], width, *x.shape[2:]))
    out[:, : x.shape[1]] = x
    return out
