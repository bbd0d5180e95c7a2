"""Dynamic sampling (algorithm.filter_groups) with a deterministic fake engine and reward: which
groups are kept, how many prompt batches are drawn, the cap, and the batch the rest of the step
sees. The fake numbers its batches as the trainer does (uids from the generation batch number).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.algo.dynamic_sampling import choose_groups, informative_groups
from minirl.batch import RolloutBatch, concat, response_mask
from minirl.config.schema import FilterGroupsConfig
from minirl.data.prompts import PromptLoader, PromptRecord, expand_groups
from minirl.dist.context import DistContext
from minirl.reward.manager import place_scores
from minirl.reward.metrics import merge_reward_metrics
from minirl.rollout.dynamic_sampling import fill_batch

CPU = torch.device("cpu")
N = 4


def records(count: int) -> list[PromptRecord]:
    return [PromptRecord([1, 2, i + 3], "fake", str(i), {}, f"f:{i}", i) for i in range(count)]


def half_solved(rec: PromptRecord, i: int) -> float:
    """Even prompts: every sample correct (no signal); odd prompts: samples alternate 1, 0."""
    return 1.0 if rec.index % 2 == 0 else float(i % 2)


def fake_engine(score_of=half_solved, rank: int = 0, dp: int = 1, calls: list | None = None):
    """gen_and_score(prompts, number) as FilterGroups builds it: responses of 2-4 tokens that
    depend on the prompt, the sample and the batch number; uids as Collocated.generate makes them."""

    def gen_and_score(prompts, number):
        expanded, uids = expand_groups(prompts, N, (number * dp + rank) * len(prompts))
        responses = [[rec.index + 10, number, i, 7][: 2 + (rec.index + i) % 3] for rec in prompts for i in range(N)]
        scores_B = torch.tensor([score_of(rec, i) for rec in prompts for i in range(N)])
        mask_BT = response_mask(responses, CPU)
        batch = RolloutBatch(
            prompts=[rec.prompt_ids for rec in expanded],
            responses=responses,
            group_B=torch.tensor(uids),
            mask_BT=mask_BT,
            records=expanded,
            finish_reasons=["stop"] * len(expanded),
            scores_B=scores_B,
            token_scores_BT=place_scores(scores_B, mask_BT),
        )
        if calls is not None:
            calls.append(number)
        return batch, {"reward/errors": 1.0, "reward/x/mean": float(number), "reward/x/max": float(number)}

    return gen_and_score


def run(loader, score_of=half_solved, cap: int = 0, metric: str = "score", target: int = 8, calls=None):
    cfg = FilterGroupsConfig(enable=True, metric=metric, max_num_gen_batches=cap)
    first = loader.next_batch()
    return fill_batch(fake_engine(score_of, calls=calls), first, loader, cfg, target, N, DistContext(device=CPU))


def group_indices(batch: RolloutBatch) -> list[int]:
    """The prompt index of each group of a prompt-major batch."""
    return [rec.index for rec in batch.records[::N]]


def test_half_all_correct_is_refilled_to_the_full_number_of_informative_groups():
    """8 prompts per batch, 4 of them all-correct: a second batch is drawn, and the step holds the
    8 informative groups of both, in prompt order; the rest of the step sees a normal batch."""
    loader, calls = PromptLoader(records(40), 8, shuffle=False), []
    batch, metrics = run(loader, calls=calls)
    assert group_indices(batch) == [1, 3, 5, 7, 9, 11, 13, 15]
    assert calls == [1, 2] and loader.drawn == 2  # batch numbers = the loader's count: unique seeds/uids
    assert metrics["filter_groups/num_gen_batches"] == 2.0
    assert metrics["filter_groups/groups_generated"] == 16.0
    assert metrics["filter_groups/groups_kept"] == 8.0 and metrics["filter_groups/groups_dropped"] == 8.0
    assert metrics["filter_groups/cap_hit"] == 0.0 and metrics["filter_groups/groups_padded"] == 0.0
    assert metrics["filter_groups/epoch"] == 2 / 5
    assert metrics["filter_groups/generated_score_mean"] == 0.75  # 24 of 32 samples correct per batch
    assert metrics["reward/errors"] == 2.0 and metrics["reward/x/mean"] == 1.5 and metrics["reward/x/max"] == 2.0
    assert len(batch) == 8 * N and len(set(batch.group_B.tolist())) == 8
    assert informative_groups(batch, "score", N).all()
    width = max(len(r) for r in batch.responses)
    assert batch.mask_BT.shape == (8 * N, width) and batch.token_scores_BT.shape == (8 * N, width)
    assert torch.equal(batch.mask_BT, response_mask(batch.responses, CPU))
    assert torch.equal(batch.token_scores_BT.sum(-1), batch.scores_B)


def test_more_informative_groups_than_needed_are_trimmed_in_prompt_order():
    """3 of 4 prompts informative: 12 found in two batches, the first 8 kept."""

    def three_quarters(rec, i):
        return 1.0 if rec.index % 4 == 0 else float(i % 2)

    batch, metrics = run(PromptLoader(records(40), 8, shuffle=False), three_quarters)
    assert group_indices(batch) == [1, 2, 3, 5, 6, 7, 9, 10]
    assert metrics["filter_groups/groups_informative"] == 12.0 and metrics["filter_groups/groups_kept"] == 8.0


def test_the_cap_stops_the_step_short_and_says_so(caplog):
    """max_num_gen_batches = 1: the 4 informative groups of the one batch are trained on."""
    loader = PromptLoader(records(40), 8, shuffle=False)
    with caplog.at_level(logging.WARNING):
        batch, metrics = run(loader, cap=1)
    assert group_indices(batch) == [1, 3, 5, 7] and loader.drawn == 1
    assert metrics["filter_groups/cap_hit"] == 1.0 and metrics["filter_groups/num_gen_batches"] == 1.0
    assert "max_num_gen_batches = 1 reached with 4 of 8 informative groups" in caplog.text


def test_no_informative_group_at_the_cap_keeps_one_uninformative_group():
    """Every prompt solved: the step still holds a group (the first), with zero spread."""
    batch, metrics = run(PromptLoader(records(40), 8, shuffle=False), lambda rec, i: 1.0, cap=3)
    assert group_indices(batch) == [0] and len(batch) == N
    assert metrics["filter_groups/num_gen_batches"] == 3.0 and metrics["filter_groups/groups_padded"] == 1.0
    assert metrics["filter_groups/groups_dropped"] == 23.0


def test_no_cap_draws_into_the_next_epoch_and_warns_once_per_epoch(caplog):
    """Without a cap the step draws past the end of an epoch (2 batches here) until it is full."""
    loader = PromptLoader(records(16), 8, shuffle=True, seed=5)

    def rare(rec, i):  # informative only for prompts 0 and 1
        return float(i % 2) if rec.index < 2 else 0.0

    with caplog.at_level(logging.WARNING):
        batch, metrics = run(loader, rare, target=8)
    assert sorted(set(group_indices(batch))) == [0, 1] and len(group_indices(batch)) == 8
    assert loader.drawn == metrics["filter_groups/num_gen_batches"] == 8.0  # 4 epochs, 2 per epoch
    assert caplog.text.count("set algorithm.filter_groups.max_num_gen_batches") == 3


def test_seq_reward_reads_the_token_scores():
    """seq_reward is the sum of the token-level scores: a shaping term placed on tokens counts."""
    batch, _ = fake_engine()(records(2), 1)
    batch.token_scores_BT[:, 0] += torch.arange(2 * N, dtype=torch.float32)  # every sample differs
    assert informative_groups(batch, "score", N).tolist() == [False, True]
    assert informative_groups(batch, "seq_reward", N).tolist() == [True, True]


@pytest.mark.parametrize(
    "flags, target, ranks, want, padded",
    [
        ([[[1, 0], [1, 1]]], 4, 2, [(0, 0, 0), (0, 1, 0), (0, 1, 1), (0, 0, 1)], 1),  # 3 found, 1 padding
        ([[[0, 0], [0, 0]], [[0, 1], [1, 1]]], 4, 2, [(1, 0, 1), (1, 1, 0), (1, 1, 1), (0, 0, 0)], 1),
        ([[[1, 1], [1, 1]], [[1, 1], [1, 1]]], 4, 2, [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)], 0),
        ([[[0, 0], [0, 0]]], 4, 2, [(0, 0, 0), (0, 0, 1)], 2),
    ],
)
def test_choose_groups_keeps_the_first_informative_in_global_order(flags, target, ranks, want, padded):
    keys, n_padded = choose_groups([torch.tensor(f, dtype=torch.bool) for f in flags], target, ranks)
    assert keys == sorted(want) and n_padded == padded and len(keys) % ranks == 0


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(1, 3), per_rank=st.integers(1, 3), batches=st.integers(1, 4), data=st.data())
def test_choose_groups_properties(ranks, per_rank, batches, data):
    """For any flags: the kept informative groups are the first min(target, found) in global
    order; the count is a positive multiple of the ranks, at most the target; padding only when
    short, and then the earliest uninformative groups."""
    target = ranks * per_rank
    flags = [
        torch.tensor(
            data.draw(
                st.lists(st.lists(st.booleans(), min_size=per_rank, max_size=per_rank), min_size=ranks, max_size=ranks)
            )
        )
        for _ in range(batches)
    ]
    keys, padded = choose_groups(flags, target, ranks)
    order = [(d, r, j) for d in range(batches) for r in range(ranks) for j in range(per_rank)]
    informative = [k for k in order if flags[k[0]][k[1], k[2]]]
    uninformative = [k for k in order if not flags[k[0]][k[1], k[2]]]
    kept_informative = min(target, len(informative))
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert len(keys) % ranks == 0 and ranks <= len(keys) <= target
    assert [k for k in keys if k in informative] == informative[:kept_informative]
    assert sorted(k for k in keys if k not in informative) == uninformative[:padded]
    assert padded == len(keys) - kept_informative and padded < ranks + (kept_informative == 0)
    if padded:  # only a short step is padded, and the first batch holds what it needs
        assert kept_informative < target and all(d == 0 for d, _, _ in uninformative[:padded])


def test_concat_repads_token_tensors_and_joins_sequence_tensors():
    a = RolloutBatch([[1]], [[5, 6, 7]], torch.tensor([0]), torch.ones(1, 3), scores_B=torch.ones(1))
    b = RolloutBatch([[2]], [[8]], torch.tensor([1]), torch.ones(1, 5), scores_B=torch.zeros(1))
    b.mask_BT[0, 1:] = 0  # padding past the response, wider than needed
    joined = concat([a, b])
    assert joined.responses == [[5, 6, 7], [8]] and joined.group_B.tolist() == [0, 1]
    assert torch.equal(joined.mask_BT, torch.tensor([[1.0, 1, 1], [1, 0, 0]]))
    assert torch.equal(joined.scores_B, torch.tensor([1.0, 0.0]))
    assert joined.values_BT is None  # a field neither batch holds stays unset
    with pytest.raises(ValueError, match="cannot join"):
        concat([a, dataclasses.replace(b, scores_B=None)])


def test_select_and_to_carry_every_field():
    """Every tensor field of the batch (declared in RolloutBatch) goes through select and to."""
    lists = ("prompts", "responses", "records", "finish_reasons", "trajectories")
    names = [f.name for f in dataclasses.fields(RolloutBatch) if f.name not in lists]
    batch = RolloutBatch([[1], [2]], [[5, 6], [7]], torch.tensor([0, 1]), torch.ones(2, 2), trajectories=["a", "b"])
    for i, name in enumerate(names):
        if getattr(batch, name) is None:
            setattr(batch, name, torch.full((2, 2), float(i)) * torch.tensor([[1.0], [2.0]]))
    assert list(batch.tensors()) == names
    picked = batch.select([1]).to(CPU)
    for name in names:
        assert torch.equal(getattr(picked, name), getattr(batch, name)[1:]), name
    assert picked.trajectories == ["b"]


def test_merge_reward_metrics_sums_counts_and_averages_means():
    merged = merge_reward_metrics([{"e": 1.0, "a/mean": 2.0, "a/min": 3.0}, {"e": 2.0, "a/mean": 4.0, "a/min": 1.0}])
    assert merged == {"e": 3.0, "a/mean": 3.0, "a/min": 1.0}
