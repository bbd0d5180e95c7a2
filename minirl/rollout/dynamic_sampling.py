"""Dynamic sampling (DAPO, Yu et al. 2025, §3.2; verl's algorithm.filter_groups): groups without
signal are dropped (minirl.algo.dynamic_sampling says which) and further prompt batches are
generated until the step holds data.train_batch_size informative groups, the first ones in global
prompt order, balanced over the ranks. docs/plugins.md has the keys, the metrics, the data
position and where this departs from verl (a capped short step instead of an error).
Legend: B sequences, G groups of this rank's generation batch, R data-parallel ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minirl.algo.dynamic_sampling import Key, choose_groups, informative_groups
from minirl.batch import RolloutBatch, concat
from minirl.dist.context import DistContext
from minirl.reward.metrics import merge_reward_metrics
from minirl.rollout.source import Rollout
from minirl.rollout.trajectories import model_tokens

log = logging.getLogger(__name__)


class FilterGroups:
    """A collocated source (minirl.rollout.collocated.Collocated) whose step holds only
    informative groups. A generation batch's number (its seed and uids) is the loader's count of
    batches drawn, unique per batch."""

    sampled_by_current_weights = True

    def __init__(self, inner, loader, cfg, dist: DistContext):
        self.inner, self.loader, self.dist = inner, loader, dist
        self.filter_cfg, self.n = cfg.algorithm.filter_groups, cfg.rollout.n
        self.train_batch_size = cfg.data.train_batch_size
        self.old_log_probs_note = inner.old_log_probs_note

    def next(self, step: int, timer) -> Rollout:
        generated = []  # every batch drawn: what the generation time was spent on

        def gen_and_score(records, number: int):
            batch, metrics = self.inner.generate_and_score(records, number, timer)
            generated.append(model_tokens(batch.trajectories))
            return batch, metrics

        first = self.loader.next_batch()
        fg, size = self.filter_cfg, self.train_batch_size
        batch, metrics = fill_batch(gen_and_score, first, self.loader, fg, size, self.n, self.dist)
        return Rollout(batch, metrics, sum(generated), self.inner.source_metrics())

    def validate(self) -> dict[str, float]:
        return self.inner.validate()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Generated:
    """One generation batch of the step: the informative flags of all ranks, and this rank's groups
    that may be kept (all of the step's first batch, which padding draws on; the informative ones
    of later batches, so that a long search holds no more than it can use)."""

    informative_RG: torch.Tensor  # bool
    batch: RolloutBatch  # this rank's groups `groups` of the generation batch
    groups: list[int]
    score_sum: torch.Tensor  # of every sequence this rank generated, before the filter
    num_sequences: int


def fill_batch(gen_and_score, records, loader, cfg, train_batch_size: int, n: int, dist: DistContext):
    """The step's batch of informative groups, and its metrics.

    gen_and_score(prompts, number) generates and scores one prompt batch; `number` (the loader's
    count of batches drawn) names the generation batch, so seeds and group uids differ between
    them. `records` is the step's first batch, already drawn from `loader`; every further one is
    loader.next_batch(). cfg is algorithm.filter_groups. All ranks draw equally many batches: the
    decision reads the informative flags of every rank.
    """
    drawn: list[Generated] = []
    reward_metrics: list[dict[str, float]] = []
    while True:
        batch, metrics = gen_and_score(records, loader.drawn)
        flags_RG = _gather_flags(informative_groups(batch, cfg.metric, n), dist)
        drawn.append(_generated(batch, flags_RG, first=not drawn, n=n, rank=dist.dp_rank))
        reward_metrics.append(metrics)
        found = sum(int(g.informative_RG.sum()) for g in drawn)
        if found >= train_batch_size or _capped(len(drawn), cfg.max_num_gen_batches):
            break
        _warn_if_epoch_drawn(len(drawn), loader.steps_per_epoch, found, train_batch_size, dist)
        records = loader.next_batch()
    keys, padded = choose_groups([g.informative_RG for g in drawn], train_batch_size, dist.dp_size)
    counts = [sum(1 for _, r, _ in keys if r == rank) for rank in range(dist.dp_size)]
    batch, moved = balance(_own_groups(drawn, keys, dist.dp_rank, n), counts, n, dist)
    out = merge_reward_metrics(reward_metrics)
    out.update(_metrics(drawn, train_batch_size, len(keys), padded, moved, loader.epoch, dist))
    if found < train_batch_size:
        _warn_short(cfg.max_num_gen_batches, found, train_batch_size, len(keys), padded, dist)
    return batch, out


def _generated(batch: RolloutBatch, informative_RG: torch.Tensor, first: bool, n: int, rank: int) -> Generated:
    groups = list(range(informative_RG.shape[1])) if first else informative_RG[rank].nonzero()[:, 0].tolist()
    scores_B = batch.scores_B.detach().double()
    kept = batch if first else batch.select(_sequences(groups, n))
    return Generated(informative_RG, kept, groups, scores_B.sum(), len(scores_B))


def _capped(num_gen_batches: int, cap: int) -> bool:
    return cap > 0 and num_gen_batches >= cap


def _gather_flags(flags_G: torch.Tensor, dist: DistContext) -> torch.Tensor:
    """[R, G] bool: every rank's flags (each rank generates the same number of groups)."""
    rows_RG = torch.zeros(dist.dp_size, len(flags_G), device=dist.device)
    rows_RG[dist.dp_rank] = flags_G.to(device=dist.device, dtype=rows_RG.dtype)
    return dist.all_reduce(rows_RG).cpu() > 0


def _own_groups(drawn: list[Generated], keys: list[Key], rank: int, n: int) -> list[RolloutBatch]:
    """This rank's kept groups, one batch per generation batch that holds some, in global order."""
    parts = []
    for d, g in enumerate(drawn):
        position = {j: p for p, j in enumerate(g.groups)}
        groups = [position[j] for dd, r, j in keys if dd == d and r == rank]
        if groups:
            parts.append(g.batch.select(_sequences(groups, n)))
    return parts


def _sequences(groups, n: int) -> list[int]:
    return [j * n + i for j in groups for i in range(n)]


def balance(own: list[RolloutBatch], counts: list[int], n: int, dist: DistContext) -> tuple[RolloutBatch, int]:
    """Every rank ends with sum(counts) / R groups: a rank holding more hands its last ones over;
    ranks short of groups take them in rank order. Returns (this rank's batch, groups moved)."""
    share, rank = sum(counts) // len(counts), dist.dp_rank
    if all(c == share for c in counts):
        return concat(own), 0
    mine = concat(own) if own else None
    keep = min(counts[rank], share)
    give = mine.select(list(range(keep * n, counts[rank] * n))) if counts[rank] > share else None
    give = None if give is None else give.to(torch.device("cpu"))
    pool = [b for b in dist.all_gather_objects(give) if b is not None]
    moved = sum(max(0, c - share) for c in counts)
    if counts[rank] >= share:
        return mine.select(list(range(keep * n))), moved
    start = sum(max(0, share - c) for c in counts[:rank])
    taken = concat(pool).to(dist.device).select(_sequences(range(start, start + share - counts[rank]), n))
    return concat(([mine] if mine is not None else []) + [taken]), moved


def _metrics(drawn: list[Generated], target: int, kept: int, padded: int, moved: int, epoch: float, dist):
    generated = sum(g.informative_RG.numel() for g in drawn)
    informative = sum(int(g.informative_RG.sum()) for g in drawn)
    score_sum = sum(g.score_sum for g in drawn)
    count = torch.tensor(float(sum(g.num_sequences for g in drawn)), dtype=torch.float64, device=score_sum.device)
    totals = dist.all_reduce(torch.stack([score_sum, count]))
    return {
        "filter_groups/num_gen_batches": float(len(drawn)),
        "filter_groups/groups_generated": float(generated),
        "filter_groups/groups_informative": float(informative),
        "filter_groups/groups_kept": float(kept),
        "filter_groups/groups_dropped": float(generated - kept),
        "filter_groups/groups_padded": float(padded),  # uninformative groups kept to fill a short step
        "filter_groups/groups_moved": float(moved),  # handed between ranks to balance them
        "filter_groups/cap_hit": float(informative < target),  # a short step
        "filter_groups/epoch": epoch,  # prompt batches drawn so far / batches per epoch
        "filter_groups/generated_score_mean": float(totals[0] / totals[1]),  # before filtering
    }


def _warn_short(cap: int, found: int, target: int, kept: int, padded: int, dist: DistContext) -> None:
    if dist.is_main:
        log.warning(
            f"algorithm.filter_groups.max_num_gen_batches = {cap} reached with {found} of {target} informative "
            f"groups: this step trains on {kept} group(s), {padded} of them uninformative (padding to a multiple "
            "of the dp size)"
        )


def _warn_if_epoch_drawn(num: int, per_epoch: int, found: int, target: int, dist: DistContext) -> None:
    """Without a cap a step may draw forever on data the model always (or never) solves."""
    if dist.is_main and num % per_epoch == 0:
        log.warning(
            f"algorithm.filter_groups: one step drew {num} prompt batches ({num // per_epoch} epoch(s)) and found "
            f"{found} of {target} informative groups; set algorithm.filter_groups.max_num_gen_batches to cap it"
        )
