"""One sampled response while it is generated, and the group of samples that share a prompt."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minirl.protocols import TurnOutput


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """A response in progress.

    The host learns sampled tokens one step late (the engine overlaps the next step with reading
    this one's results), so two counters run ahead of `output`: `num_cached` tokens have their KV
    written (or being written) on the device, `num_scheduled` responses tokens have been sampled or
    are being sampled. `output` holds the tokens already read back.

    A request's next turn continues the same Sequence (`continue_with`): `prompt` becomes the whole
    conversation so far, and the KV of every token but the last sampled one stays cached.
    """

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    row: int = -1  # row of the device-side state (page table, length, last token)
    num_cached: int = 0
    num_scheduled: int = 0
    status: Status = Status.WAITING
    finish_reason: str = "length"
    reused: int = 0  # prompt tokens of this turn whose KV was kept from the earlier turns
    versions: list[int] = field(default_factory=list)  # the engine's weight_version per output token

    @property
    def tokens(self) -> list[int]:
        """Everything a recompute must prefill: the prompt and the tokens read back so far."""
        return self.prompt + self.output

    def extend(self, tokens: list[int], logprobs: list[float], version: int = 0) -> None:
        """Record tokens read back, up to a stop token or the length limit (later ones were
        sampled past the end and are dropped); mark the sequence finished there."""
        tokens = tokens[: self.max_new_tokens - len(self.output)]
        stopped = bool(self.stop_ids) and not self.stop_ids.isdisjoint(tokens)
        if stopped:
            tokens = tokens[: next(i for i, t in enumerate(tokens) if t in self.stop_ids) + 1]
        self.output += tokens
        self.logprobs += logprobs[: len(tokens)]
        self.versions += [version] * len(tokens)
        if stopped:
            self.status, self.finish_reason = Status.FINISHED, "stop"
        elif len(self.output) >= self.max_new_tokens:
            self.status, self.finish_reason = Status.FINISHED, "length"

    def to_turn(self) -> TurnOutput:
        turn = (list(self.output), list(self.logprobs), self.finish_reason, self.reused, list(self.versions))
        return TurnOutput(self.request_id, *turn)

    def continue_with(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> None:
        """The next turn: prompt (starting with self.tokens) is prefilled from num_cached on."""
        self.num_cached = min(self.num_cached, len(self.tokens) - 1)  # the last sampled token is not fed yet
        self.prompt, self.output, self.logprobs, self.versions = list(prompt), [], [], []
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.num_scheduled, self.status, self.finish_reason = 0, Status.WAITING, "length"
        self.reused = self.num_cached


@dataclass(eq=False)
class Group:
    """Sequences prefilled together: the n samples of a prompt share one prefill of it (a
    preempted sequence comes back as a group of its own, re-prefilling prompt + output)."""

    seqs: list[Sequence]

    @property
    def tokens(self) -> list[int]:
        return self.seqs[0].tokens

    @property
    def start(self) -> int:
        """The first position to prefill: 0, or a continuing sequence's cached length."""
        return self.seqs[0].num_cached
