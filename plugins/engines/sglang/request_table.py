"""The request level's bookkeeping: queued turns, held contexts and the shared-sampler rule.

SGLang's offline Engine.generate is one blocking call, so the sglang engine runs a turn start to
end inside step(): between steps nothing is in flight. What the protocol calls "in flight" is
then the queue of submitted turns that the next step() sends; a finished sample id stays held
(its prompt and sampled tokens) until release, so that a later submit may continue it. The KV of
a held context is SGLang's business: its radix cache keeps the finished tokens and matches them
as a prefix of the next turn's prompt, while memory lasts (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from minirl.protocols import SamplingParams, sample_ids


@dataclass
class Pending:
    """One sample's queued turn. held_len: the length of the held context it continues (0 for a
    first turn); sampling: the SGLang sampling_params dict it goes with."""

    sample_id: str
    prompt_ids: list[int]
    sampling: dict
    held_len: int = 0
    aborted: bool = False


def sampler_key(params: SamplingParams) -> tuple[float, int, float]:
    """What every turn in flight must share: temperature, top_k (any value <= 0 is "off") and top_p."""
    return float(params.temperature), int(params.top_k) if params.top_k > 0 else -1, float(params.top_p)


class RequestTable:
    """Queued turns in submission order, and the contexts of finished, unreleased sample ids."""

    def __init__(self):
        self.queued: dict[str, Pending] = {}
        self.held: dict[str, list[int]] = {}  # sample id -> prompt + every token sampled so far
        self.sampler: tuple[float, int, float] | None = None

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sampling: dict) -> None:
        """Queue params.n samples of prompt_ids (one, continuing a held id, when it names one)."""
        check_params(request_id, prompt_ids, params)
        ids = sample_ids(request_id, params.n)
        running = [sid for sid in ids if sid in self.queued]
        if running:
            raise ValueError(f"request {running[0]!r} is still running: wait for its turn from step() or abort it")
        self._check_sampler(request_id, params)
        held = [sid for sid in dict.fromkeys([request_id, *ids]) if sid in self.held]
        if held and params.n != 1:
            raise ValueError(
                f"request {request_id!r} with n={params.n}: sample {held[0]!r} is still held; a continuation is "
                f"one sample (n = 1, its sample id), and a new request needs ids that are released"
            )
        held_len = self._check_prefix(request_id, prompt_ids) if held else 0
        prompt = [int(t) for t in prompt_ids]
        for sid in ids:
            self.queued[sid] = Pending(sid, prompt, sampling, held_len)
        self.sampler = sampler_key(params)

    def _check_sampler(self, request_id: str, params: SamplingParams) -> None:
        if self.queued and sampler_key(params) != self.sampler:
            t, k, p = self.sampler
            raise ValueError(
                f"request {request_id!r}: temperature/top_k/top_p = {sampler_key(params)}, but the requests in "
                f"flight sample with {(t, k, p)}; every request in flight shares one sampler, so submit it "
                f"after they finish"
            )

    def _check_prefix(self, request_id: str, prompt_ids: list[int]) -> int:
        context = self.held[request_id]
        if list(prompt_ids[: len(context)]) != context:
            raise ValueError(
                f"request {request_id!r} continues a held request, so its prompt_ids must start with that "
                f"request's {len(context)} tokens (its prompt and sampled tokens); they differ (first at "
                f"{first_difference(prompt_ids, context)}). Release it first to start a new request under this id"
            )
        return len(context)

    def abort(self, sample_id: str) -> None:
        """Mark a queued turn aborted; unknown and finished ids are ignored."""
        if sample_id in self.queued:
            self.queued[sample_id].aborted = True

    def take(self) -> list[Pending]:
        """Every queued turn, in submission order; the queue (and its sampler) is empty after."""
        batch, self.queued, self.sampler = list(self.queued.values()), {}, None
        return batch

    def finish(self, pending: Pending, token_ids: list[int]) -> None:
        """Hold the sample's context after its turn: the prompt and the tokens it sampled."""
        self.held[pending.sample_id] = pending.prompt_ids + list(token_ids)

    def release(self, sample_id: str) -> None:
        """Forget a held context; unknown ids are ignored, a queued one is refused."""
        if sample_id in self.queued:
            raise ValueError(f"release({sample_id!r}): the request is still running; abort it and step() first")
        self.held.pop(sample_id, None)


def check_params(request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
    """The user errors SGLang would report later, or not at all."""
    if params.n < 1 or params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams n={params.n}, max_new_tokens={params.max_new_tokens}: both must be >= 1")
    if len(prompt_ids) == 0:
        raise ValueError(f"request {request_id!r}: prompt_ids is empty; a request needs at least one prompt token")


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where a and b differ (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
