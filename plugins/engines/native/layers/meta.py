"""What the ops are told besides the tokens: the attention heads' shape, and where one step's
keys and values go and come from.

Shape legend: N packed tokens, B decode rows, S sequences of a prefill, L layers, K KV slots,
Hk KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Heads(NamedTuple):
    """The attention heads of a layer: H query heads, Hk KV heads, D head dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class StepMeta:
    is_prefill: bool
    slot_mapping_N: torch.Tensor  # int64 KV slot that each token's K/V is written to
    kv_cache: torch.Tensor  # [2, L, K, Hk, D]
    # prefill: packed causal sequences
    cu_seqlens_S1: torch.Tensor | None = None  # int32
    max_seqlen: int = 0
    # extend (a prefill that continues cached sequences): queries are the new tokens (cu_seqlens_S1),
    # keys and values every cached position of each sequence, read from the cache at these slots
    ctx_slots_M: torch.Tensor | None = None  # int64, M = the sequences' whole lengths summed
    cu_ctx_S1: torch.Tensor | None = None  # int32 boundaries of each sequence's context in ctx_slots_M
    max_ctx_len: int = 0
    # decode: one query token per row, keys read through the page table
    rows_B: torch.Tensor | None = None  # int64 row of the device state (page table row)
    ctx_lens_B: torch.Tensor | None = None  # int32 tokens to attend to, the new one included
    page_table: torch.Tensor | None = None  # [rows, max_pages] int32
    page_size: int = 16
    num_splits: int = 1
    # int32 [>= B], zeros between kernels: a split-K kernel's programs count themselves done here,
    # and the last of a row merges its splits (and sets its count back to 0); None: a merge kernel
    split_counts: torch.Tensor | None = None
    max_ctx: int = 0  # host bound on ctx_lens (the pure-torch decode needs it; 0: read it)
