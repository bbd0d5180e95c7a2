"""The call signatures of minirl's pluggable components.

Every registry (advantage estimators, KL estimators, policy losses, reward functions, rollout
engines, loggers) maps a name to a component with one of the shapes below. The trainer calls
them directly; hooks only build the registries.

Shape legend: B sequences, T response positions, N packed tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Protocol

import torch

Reducer = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over all data-parallel ranks (identity at world size 1)."""


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """The reducer of a single process: batch-wide statistics are local statistics."""
    return x


# ---------------------------------------------------------------------------------------------
# advantage estimators
# ---------------------------------------------------------------------------------------------


@dataclass
class AdvantageInputs:
    """What an advantage estimator sees of the batch.

    token_rewards_BT: the outcome score on the last valid token (minus beta*kl with KL in reward).
    mask_BT: 1.0 for generated tokens up to and including EOS, 0.0 after.
    group_B: int64 group id (uid); the n samples of one prompt share it.
    values_BT: critic values (only gae needs them).
    reduce: sums a tensor over all data-parallel ranks, for batch-wide whitening.
    """

    token_rewards_BT: torch.Tensor
    mask_BT: torch.Tensor
    group_B: torch.Tensor
    values_BT: torch.Tensor | None = None
    reduce: Reducer = no_reduce


class AdvantageEstimator(Protocol):
    def __call__(self, inputs: AdvantageInputs, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (advantages_BT, returns_BT); cfg is the `algorithm` config section."""


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


class KLEstimator(Protocol):
    """Per-token KL estimate from log-probs: kl_BT = f(logp_BT, ref_logp_BT).

    An estimator that sets the attribute `needs_logits = True` (the exact `full` KL) is called
    instead as f(logits_NV, ref_logits_NV) -> kl_N, on temperature-scaled logits.
    """

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# policy losses
# ---------------------------------------------------------------------------------------------


@dataclass
class PolicyLossOutput:
    """Per-token pieces; the trainer aggregates them over the global mini-batch.

    loss_BT: per-token loss before aggregation (and before the TIS weight, actor.tis_imp_ratio_cap,
    which the trainer applies to any policy loss).
    clipped_BT: 1.0 where the clipped branch is active (pg_clipfrac).
    clipped_lower_BT: 1.0 where the dual clip is active (pg_clipfrac_lower).
    approx_kl_BT: lp_old - lp (ppo_kl).
    """

    loss_BT: torch.Tensor
    clipped_BT: torch.Tensor
    clipped_lower_BT: torch.Tensor
    approx_kl_BT: torch.Tensor


class PolicyLoss(Protocol):
    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        cfg: Any,
    ) -> PolicyLossOutput:
        """cfg is the `actor` config section (clip_ratio, clip_ratio_low/high, clip_ratio_c)."""


# ---------------------------------------------------------------------------------------------
# reward functions
# ---------------------------------------------------------------------------------------------


class RewardFunction(Protocol):
    def __call__(self, response: str, ground_truth: Any, extra_info: dict) -> float:
        """Score one decoded response (the rule reward); selected by the row's data_source."""


# ---------------------------------------------------------------------------------------------
# rollout engines
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. top_k <= 0 and top_p >= 1 disable those filters; temperature 0 is greedy."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class Completion:
    """One sampled response. logprobs are of the sampled tokens under temperature-scaled logits."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "length"  # "stop" (EOS / stop token) or "length"


@dataclass
class EngineContext:
    """Everything an engine factory may need to build an engine next to the actor.

    model_config: the transformers PretrainedConfig of the policy.
    actor: the policy module (plain or sharded); engines copy weights from it, and alias only
    what `shared` offers.
    device: where the engine runs. dtype: the engine's compute dtype.
    eos_token_ids / pad_token_id: from the tokenizer and generation config.
    shared: the actor's tensors that keep their values for the whole run and that engines load
    as they are (a LoRA run's frozen embedding, head and norms), by Hugging Face name. An engine
    on their device that computes in their dtype may hold these tensors themselves instead of
    copies; it must never write into them.
    """

    model_config: Any
    actor: torch.nn.Module | None
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    extra: dict = field(default_factory=dict)
    shared: dict = field(default_factory=dict)


@dataclass
class TurnOutput:
    """One finished turn of a request: the tokens sampled since the request's last submit.

    finish_reason: "stop" (EOS / stop token), "length" (max_new_tokens) or "abort".
    cached_tokens: prompt tokens whose KV the engine kept from the request's earlier turns
    (not prefilled again); 0 for a first turn or an engine without that reuse.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    cached_tokens: int = 0
    versions: list[int] | None = None  # per token: the engine's weight_version when it was sampled


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of the n samples a request of params.n = n becomes: the request's own id when
    n == 1, else request_id/0 ... request_id/(n-1). Outputs, continuations and release use them."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


class RolloutEngine(Protocol):
    """A rollout engine, at two levels.

    Request level (what agent loops and asynchronous rollouts drive): submit requests, step the
    engine, collect finished turns. A request id names one sequence for as long as it is held: a
    later submit under the same id continues it (the agent loop's next turn), and the engine may
    keep its KV cache across turns. Every request in flight is sampled with the same temperature,
    top_k and top_p (one sampler per busy period, seeded by the first request's params.seed);
    max_new_tokens, stop_token_ids and ignore_eos are per request.

    Batch level: generate(), a thin helper over the request level (generate_batch below).
    """

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request of params.n samples that share one prefill (ids: sample_ids).

        If request_id names a held request (finished, not released), this continues it:
        prompt_ids must start with that request's whole context (its prompt and every token
        sampled so far); only the tokens after it need prefilling. Raises ValueError for a
        request id that is still running, or a sampler setting that differs from the running
        requests'."""

    def step(self) -> list[TurnOutput]:
        """Advance the requests in flight by one engine step; returns the turns that finished."""

    def has_work(self) -> bool:
        """Whether any submitted request has not finished its turn yet."""

    def abort(self, request_id: str) -> None:
        """Stop a request (a sample id); its turn comes back from step() with finish_reason
        "abort" and the tokens sampled so far. Unknown or finished ids are ignored."""

    def release(self, request_id: str) -> None:
        """Forget a finished request (a sample id) and free what the engine held for it."""

    def pause_generation(self) -> None:
        """Finish the work in flight and stop stepping: the requests keep their state and KV
        cache, so that load_weights may run and continue_generation resume them. An engine that
        runs each turn to its end inside step() (sglang, GenerateOnly) has nothing in flight: step() then
        refuses until continue_generation (sglang's cache flush after a weight load may drop the
        held requests' KV; they are prefilled again)."""

    def continue_generation(self) -> None:
        """Resume the requests that pause_generation held."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample params.n responses for each prompt; returns len(prompts) * n completions,
        prompt-major (the n samples of prompt i are at [i*n, (i+1)*n))."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights in place, by Hugging Face parameter name."""

    def release_memory(self) -> None:
        """Free the KV cache (and other transient buffers) between rollout phases."""

    def resume_memory(self) -> None:
        """Re-acquire what release_memory freed."""


EngineFactory = Callable[[Any, EngineContext], RolloutEngine]
"""factory(rollout_cfg, ctx) -> engine; rollout_cfg is the `rollout` config section."""


def generate_batch(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    """RolloutEngine.generate over the request level: submit every prompt in order, step until
    all finished, release them. Prompt-major, as generate promises. It steps every request in
    flight, so it refuses to start while others are: their turns would be lost."""
    if engine.has_work():
        raise RuntimeError("generate() while requests submitted at the request level are in flight; step them first")
    ids = [f"generate-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.submit(request_id, prompt, params)
    done: dict[str, TurnOutput] = {}
    while engine.has_work():
        done.update((turn.request_id, turn) for turn in engine.step())
    out = []
    for request_id in ids:
        for sample in sample_ids(request_id, params.n):
            turn = done.pop(sample)
            engine.release(sample)
            out.append(Completion(turn.token_ids, turn.logprobs, turn.finish_reason))
    return out


# ---------------------------------------------------------------------------------------------
# tools (called by agent loops; minirl.agent.tools runs them)
# ---------------------------------------------------------------------------------------------


class Tool(Protocol):
    """A function the model may call. `schema` is the OpenAI function schema that the chat template
    shows the model ({"type": "function", "function": {"name", "description", "parameters"}});
    `name` is schema["function"]["name"]. Calling returns the tool message's text (or an awaitable
    of it); raising minirl.agent.tools.ToolError (or any exception) becomes an error message the
    model sees.
    `timeout_s` bounds one call's wall-clock time."""

    name: str
    schema: dict
    timeout_s: float

    def __call__(self, arguments: dict, **sample: Any) -> str | Awaitable[str]:
        """arguments: the call's parsed JSON arguments; sample: the row's tools_kwargs for this tool
        (extra_info.tools_kwargs[name], verl's layout) when the data gives any."""


ToolFactory = Callable[[dict], Tool]
"""factory(config) -> tool; config is the entry's `config` mapping of the tool config file
(rollout.multi_turn.tool_config_path), with its `tool_schema` (if any) under "tool_schema"."""


# ---------------------------------------------------------------------------------------------
# agent loops (minirl.agent runs many concurrently over the engine's request level)
# ---------------------------------------------------------------------------------------------


@dataclass
class Trajectory:
    """What one agent loop returns for one sample: token ids in, token ids out, never re-tokenized.

    response_ids: everything after the prompt, the model's tokens and the tool/user messages'
    tokens interleaved; response_mask: 1 where the model sampled the token, 0 for tool/user
    tokens; logprobs: the engine's log-prob of each model token, 0.0 at mask-0 positions.
    messages: the conversation as the reward may want it ({"role", "content"}, tool calls and
    results included). metrics: counts the loop wants summed into the step metrics.
    assistant_turns: model turns; user_turns: times tool or user messages were appended (one
    turn's parallel tool results count once); num_turns is verl's count of both plus the prompt.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)  # None: the engine returned none
    finish_reason: str = "stop"
    assistant_turns: int = 1
    messages: list[dict] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    user_turns: int = 0

    @property
    def num_turns(self) -> int:
        """verl's AgentLoopOutput.num_turns: the prompt, each model turn and each appended
        message turn (2 for a single turn; 4 for call, tool result, answer)."""
        return self.user_turns + self.assistant_turns + 1


class AgentLoop(Protocol):
    async def run(self, ctx: Any, sample: Any) -> Trajectory:
        """One sample's rollout. ctx (minirl.agent.loop.AgentContext) generates turns, calls tools
        and tokenizes messages; sample (minirl.agent.loop.Sample) is the row (prompt ids, messages,
        data_source, ground_truth, extra_info) and the sampling parameters."""


AgentLoopFactory = Callable[[Any], AgentLoop]
"""factory(rollout_cfg) -> loop, built once per run; rollout_cfg is the `rollout` config section."""


# ---------------------------------------------------------------------------------------------
# loggers
# ---------------------------------------------------------------------------------------------


class MetricsLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


LoggerFactory = Callable[[Any, str], MetricsLogger]
"""factory(trainer_cfg, run_dir) -> logger; trainer_cfg is the `trainer` config section."""


# ---------------------------------------------------------------------------------------------
# hooks a parallelism plugin installs on a model (read by minirl.forward.packed)
# ---------------------------------------------------------------------------------------------

PACKED_FORWARD = "minirl_forward"  # the attribute names under which a plugin installs the hooks
SEQUENCE_PARALLEL = "minirl_sequence_parallel"


class PackedForward(Protocol):
    """`model.minirl_forward(fn, *args)`: runs fn(model, *args), the whole packed computation.

    The packed forward calls the decoder and the output head directly, never model.forward, so
    a wrapper whose hooks fire around forward methods only (FSDP2's root all-gather and its
    post-backward reduce-scatter) would miss it. Installed by such a data-parallel plugin, which
    registers the method with the wrapper (FSDP2: `register_fsdp_forward_method`). Without it
    the forward calls fn(model, *args) itself.
    """

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class SequenceParallel(Protocol):
    """`model.minirl_sequence_parallel`: cuts a packed row into this rank's share.

    Installed by a sequence-parallel plugin (Ulysses); without it every rank runs the whole row.
    """

    def split(self, input_ids_1N: torch.Tensor, seq_lens: list[int], pred_pos_R: Any, labels_R: torch.Tensor):
        """Return (input_ids [1, n], the decoder's forward kwargs, the predicting positions [r]
        within the slice on the row's device, their labels [r], gather: [r, ...] -> [R, ...]).
        pred_pos_R is a sorted numpy int64 array on the host, so slices need no device read-back;
        gather's backward must hand each rank the gradient of its own slice."""


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------

Job = Callable[[Any, Any, Any], None]
"""job(cfg, pm, dist): what every rank runs (minirl.launch.fit); module level, so it pickles."""

Launcher = Callable[[Any, Any, Job], int]
"""launcher(cfg, pm, job) -> exit status: starts the ranks, runs job on each, reports the first
failure once (0 ok, 1 crash, 2 user error, 128 + signal stopped after a checkpoint)."""
