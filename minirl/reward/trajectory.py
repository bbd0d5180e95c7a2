"""Scoring trajectories, written once for training, the asynchronous rollout ranks and validation:
the text a reward function sees (the final turn, decoded: verl's solution_str), what a reward
function that takes `trajectory` sees of a multi-turn one, and the training score, which adds
DAPO's overlong penalty. Legend: B trajectories.
"""

from __future__ import annotations

import torch

from minirl.models.tokenizers import decode_batch
from minirl.protocols import Trajectory
from minirl.reward.manager import RewardResult
from minirl.reward.metrics import reward_metrics
from minirl.reward.overlong import overlong_penalty


def final_turn_ids(t: Trajectory) -> list[int]:
    """The model's last turn: the tokens after the last tool/user token (the whole response of
    a single turn)."""
    mask = t.response_mask
    if 0 not in mask:  # a single turn (a scan in C, not a Python loop over 28k positions)
        return t.response_ids
    last_tool = len(mask) - 1 - mask[::-1].index(0)
    return t.response_ids[last_tool + 1 :]


def reward_view(t: Trajectory) -> dict | None:
    """What a reward function that takes `trajectory` sees: the conversation (prompt messages,
    assistant turns with their parsed tool calls, tool results), the turn counts (num_turns as
    verl counts it), verl tools' step rewards, or None for a plain single turn."""
    if not t.messages:
        return None
    return {
        "messages": t.messages,
        "num_turns": t.num_turns,
        "assistant_turns": t.assistant_turns,
        "tool_rewards": [m["reward"] for m in t.messages if m.get("role") == "tool" and "reward" in m],
        "finish_reason": t.finish_reason,
    }


def rule_scores(rewards, tokenizer, records: list, trajectories: list[Trajectory]) -> RewardResult:
    """The reward of each trajectory's final turn, by its row's data_source (or the custom function)."""
    texts = decode_batch(tokenizer, [final_turn_ids(t) for t in trajectories])
    return rewards.score(records, texts, [reward_view(t) for t in trajectories])


def training_scores(
    rewards, tokenizer, records: list, trajectories: list[Trajectory], overlong_cfg, max_response_length: int, dist
) -> tuple[torch.Tensor, dict[str, float]]:
    """scores_B (float32, on dist.device): the rule score plus the overlong penalty
    (reward.overlong_buffer), whose lengths count model tokens; and the reward metrics over
    dist's ranks."""
    result = rule_scores(rewards, tokenizer, records, trajectories)
    lengths = [sum(t.response_mask) for t in trajectories]
    penalty_B = overlong_penalty(lengths, max_response_length, overlong_cfg).to(dist.device)
    scores_B = torch.tensor(result.scores, dtype=torch.float32, device=dist.device) + penalty_B
    return scores_B, reward_metrics(result, penalty_B if overlong_cfg.enable else None, dist)
