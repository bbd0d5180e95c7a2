"""The call signatures of minirl's pluggable components.

Every registry (advantage estimators, KL estimators, policy losses, reward functions, rollout
engines, loggers) maps a name to a component with one of the shapes below. The trainer calls
them directly; hooks only build the registries.

Shape legend: B sequences, T response positions, N packed tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

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
    actor: the policy module (plain or sharded); engines copy weights from it, never alias it.
    device: where the engine runs. dtype: the engine's compute dtype.
    eos_token_ids / pad_token_id: from the tokenizer and generation config.
    """

    model_config: Any
    actor: torch.nn.Module | None
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    extra: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
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
