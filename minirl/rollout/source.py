"""The two parts of a run that depend on where rollouts happen, chosen once when the trainer is
built (docs/architecture.md, "One step"): the batch source (where a step's scored batch comes
from) and the weight sync (how the actor's weights reach the engines after an update). The
collocated pair is minirl.rollout.collocated; an asynchronous job's is minirl.async_training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from minirl.batch import RolloutBatch


@dataclass
class Rollout:
    """A step's scored batch, and what its source measured on the way."""

    batch: RolloutBatch
    metrics: dict[str, float]  # the reward's (and dynamic sampling's)
    generated: int  # response tokens this rank generated for the step (dynamic sampling keeps fewer)
    source_metrics: dict[str, float] = field(default_factory=dict)  # the engine's, or the queue's


class BatchSource(Protocol):
    sampled_by_current_weights: bool  # then the update's own forward may give the old log-probs
    old_log_probs_note: str  # where the old log-probs come from otherwise, for the start-up line

    def next(self, step: int, timer: Any) -> Rollout:
        """The step's batch: its rollout (timed as phase "gen") and its scores (phase "reward").
        A source that knows the old log-probs (the behaviour policy's) sets old_log_probs_BT."""

    def validate(self) -> dict[str, float]:
        """Greedy validation on data.val_files (minirl.observe.evaluate), at the current weights."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the source (trainer_state.json's "extra")."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class WeightSync(Protocol):
    def start(self, resumed: bool) -> None:
        """Before the first step: the engines hold the actor's weights (a resumed run's, restored)."""

    def after_update(self) -> dict[str, float]:
        """After the step's update: the engines get the new weights when due; returns its metrics."""


@dataclass
class Parts:
    """What the trainer builds first, from which a batch source and a weight sync are made."""

    pm: Any
    cfg: Any
    dist: Any
    adapter: Any  # the model adapter (minirl.adapter): the actor and the weights an engine gets
    tokenizer: Any
    agents: Any  # minirl.agent.loop.AgentRollout
    loader: Any  # this rank's prompts (minirl.data.prompts.PromptLoader)


Rollouts = Callable[[Parts], tuple[BatchSource, WeightSync]]
"""rollouts(parts) -> (batch source, weight sync): collocated, or an asynchronous job's."""
