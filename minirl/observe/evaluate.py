"""Validation: greedy generation on `data.val_files`, scored by the same reward functions.

Greedy decoding measures what the policy has learned without the sampling noise of the
training rollouts (verl's val-score). Every rank takes a strided share of the prompts; sums and
counts are all-reduced, so the score is the mean over the whole validation set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minirl.data.prompts import PromptRecord, load_prompts
from minirl.dist.context import DistContext
from minirl.protocols import SamplingParams
from minirl.reward.trajectory import rule_scores


@dataclass
class ValSet:
    records: list[PromptRecord]  # this rank's share
    sources: list[str]  # every data_source of the whole set, the same list on every rank


def load_val_set(data_cfg, tokenizer, dist: DistContext, tools_for=None) -> ValSet:
    records = load_prompts(data_cfg.val_files, tokenizer, data_cfg, tools_for)
    sources = sorted({r.data_source for r in records})
    return ValSet(records[dist.dp_rank :: dist.dp_size], sources)


def greedy_params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)


def validate(rollout, rewards, tokenizer, val: ValSet, max_new_tokens: int, dist: DistContext) -> dict[str, float]:
    """val/score/mean over all ranks, plus val/<data_source>/score/mean when there are several.
    rollout(records, params) -> one Trajectory per record (each row's agent loop, greedy)."""
    trajectories = rollout(val.records, greedy_params(max_new_tokens)) if val.records else []
    return val_metrics(trajectories, rewards, tokenizer, val, dist)


def val_metrics(trajectories: list, rewards, tokenizer, val: ValSet, dist: DistContext) -> dict[str, float]:
    """validate's metrics of the trajectories of val.records (an asynchronous job's rollout rank
    generates them itself)."""
    scores = rule_scores(rewards, tokenizer, val.records, trajectories).scores if val.records else []
    pairs = [(sum(scores), len(scores))]
    for src in val.sources:
        mine = [s for s, r in zip(scores, val.records) if r.data_source == src]
        pairs.append((sum(mine), len(mine)))
    t = dist.all_reduce(torch.tensor(pairs, dtype=torch.float64, device=dist.device))
    means = (t[:, 0] / t[:, 1].clamp(min=1)).tolist()
    out = {"val/score/mean": means[0]}
    if len(val.sources) > 1:
        out.update({f"val/{src}/score/mean": m for src, m in zip(val.sources, means[1:])})
    return out
