"""Rewards: scoring decoded responses (manager, scorers, custom file, worker pool), DAPO's
overlong shaping, placing scores on tokens and the step's reward metrics."""

from minirl.reward.manager import RewardManager, RewardResult, build_reward_manager, place_scores
from minirl.reward.metrics import reward_metrics
from minirl.reward.overlong import overlong_penalty

__all__ = [
    "RewardManager",
    "RewardResult",
    "build_reward_manager",
    "overlong_penalty",
    "place_scores",
    "reward_metrics",
]
