"""The actor's update: its micro-batch loss (policy loss, entropy bonus, KL loss, TIS weight) in
the shared loop of minirl.update.loop, and when the update may skip the old-log-prob pass.

Legend: B sequences, T response positions, R response tokens of a micro-batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from minirl.algo.guard import PHASE_METRIC, first_nonfinite_input, phase_code
from minirl.algo.loss_agg import AggNorm, aggregate
from minirl.algo.rollout_corr import MismatchStats, tis_weights
from minirl.algo.stats import DeviceSums
from minirl.batch import RolloutBatch, scatter_rows
from minirl.dist.context import DistContext
from minirl.forward.packed import hidden_head, packed_forward, response_logprobs
from minirl.update.loop import Update, run_update


def logprob_temperature(rollout_cfg) -> float:
    """Log-probs use the sampling temperature's logits; greedy rollouts are scored at 1."""
    r = rollout_cfg
    return r.temperature if r.do_sample and r.temperature > 0 else 1.0


def on_policy(actor_cfg, train_batch_size: int, use_kl_in_reward: bool) -> bool:
    """True when the update's one optimizer step sees the weights that generated the batch.

    With one mini-batch (ppo_mini_batch_size = train_batch_size) and one epoch, the policy that
    the old log-probs would come from is the one the update's forward runs, so those log-probs
    are that forward's own, detached: the ratio is exactly 1, and loss and gradient are what the
    separate pass gives (tests/unit/test_on_policy.py). KL in the reward reads them before the
    update, so it keeps the pass.
    """
    return (
        actor_cfg.on_policy_shortcut
        and actor_cfg.ppo_epochs == 1
        and actor_cfg.ppo_mini_batch_size == train_batch_size
        and not use_kl_in_reward
    )


@dataclass
class Losses:
    """The components the update needs, resolved from the registries once at start-up."""

    policy_loss: Any
    kl_estimator: Any = None  # None when actor.use_kl_loss is false
    reference: Any = None  # `with reference() as ref` (minirl.adapter.Reference): for the exact full KL


@dataclass
class ActorUpdate:
    """Everything the actor's update needs besides the batch, built once by minirl.build.

    on_policy: the trainer skipped the old-log-prob pass (`on_policy` above); the old log-probs
    are then each micro-batch's own forward, detached.
    """

    update: Update
    cfg: Any  # the actor section (the policy loss reads its clip keys)
    losses: Losses
    temperature: float
    on_policy: bool


def update_actor(job: ActorUpdate, batch: RolloutBatch, dist: DistContext) -> dict[str, float]:
    """ppo_epochs passes over the batch in mini-batches of ppo_mini_batch_size prompts.

    The metrics count the optimizer steps skipped for non-finite numbers and name the phase of
    the first non-finite value: an input of the update, else "loss" or "grad_norm".
    """
    # a third-party estimator's output shape is checked where it returns (minirl.plugins.guarded)
    assert batch.advantages_BT.shape == batch.mask_BT.shape, "advantages must be [B, T]"
    assert job.on_policy == (batch.old_log_probs_BT is None), "the old-log-prob pass runs unless on-policy"
    input_phase = first_nonfinite_input(batch, dist.all_reduce)
    mismatch = _mismatch_stats(batch, dist)
    loss = functools.partial(_micro_batch_loss, job, mismatch, dist)
    metrics, bad_phases = run_update(job.update, batch, loss, dist)
    metrics[PHASE_METRIC] = phase_code((input_phase or bad_phases[0]) if bad_phases else "")
    if mismatch is not None:
        metrics.update(mismatch.reduced(dist))
    return metrics


def _mismatch_stats(batch: RolloutBatch, dist: DistContext) -> MismatchStats | None:
    """None without rollout log-probs. With the separate pass the whole batch's old log-probs
    are known now; with the on-policy shortcut each micro-batch adds its own in the update."""
    if batch.rollout_log_probs_BT is None:
        return None
    stats = MismatchStats(dist.device)
    if batch.old_log_probs_BT is not None:
        stats.add(batch.old_log_probs_BT, batch.rollout_log_probs_BT, batch.mask_BT)
    return stats


def _micro_batch_loss(job: ActorUpdate, mismatch, dist, mb: RolloutBatch, norm: AggNorm, sums: DeviceSums):
    cfg, mask_BT, model = job.cfg, mb.mask_BT, job.update.model
    logp_R, ent_R = response_logprobs(model, mb.prompts, mb.responses, job.temperature, dist.device, with_entropy=True)
    lens = [len(r) for r in mb.responses]
    logp_BT, ent_BT = scatter_rows(torch.stack([logp_R, ent_R], -1).float(), lens, mask_BT).unbind(-1)
    old_BT = logp_BT.detach() if job.on_policy else mb.old_log_probs_BT
    if job.on_policy and mismatch is not None:
        mismatch.add(old_BT, mb.rollout_log_probs_BT, mask_BT)
    pg = job.losses.policy_loss(logp_BT, old_BT, mb.advantages_BT, mask_BT, cfg)
    mode = cfg.loss_agg_mode
    pg_loss = aggregate(_tis(pg.loss_BT, old_BT, mb, cfg.tis_imp_ratio_cap, norm, sums), mask_BT, mode, norm)
    loss = pg_loss
    if cfg.entropy_coeff != 0:
        loss = loss - cfg.entropy_coeff * aggregate(ent_BT, mask_BT, mode, norm)
    sums.add("pg_loss", pg_loss)
    sums.add("entropy", aggregate(ent_BT.detach(), mask_BT, "token-mean", norm))
    sums.add("pg_clipfrac", aggregate(pg.clipped_BT, mask_BT, "token-mean", norm))
    sums.add("pg_clipfrac_lower", aggregate(pg.clipped_lower_BT, mask_BT, "token-mean", norm))
    sums.add("ppo_kl", aggregate(pg.approx_kl_BT, mask_BT, "token-mean", norm))
    if job.losses.kl_estimator is not None:
        kl = aggregate(_kl_loss_terms(job, mb, logp_BT, dist), mask_BT, mode, norm)
        sums.add("kl_loss", kl)
        loss = loss + cfg.kl_loss_coef * kl
    return loss


def _tis(loss_BT, old_BT, mb: RolloutBatch, cap: float, norm, sums: DeviceSums) -> torch.Tensor:
    """Truncated importance sampling (minirl.algo.rollout_corr): loss_BT · min(exp(lp_old − lp_roll), cap),
    the weight detached. Off (cap <= 0, i.e. -1) returns loss_BT itself, so the loss is bit for bit
    the unweighted one. Logs the token-mean weight and the share of valid tokens at the cap."""
    if not cap > 0:
        return loss_BT
    assert mb.rollout_log_probs_BT is not None, "TIS without rollout log-probs: the trainer's generate refuses it"
    w_BT = tis_weights(old_BT, mb.rollout_log_probs_BT, cap)
    sums.add("tis_weight_mean", aggregate(w_BT, mb.mask_BT, "token-mean", norm))
    sums.add("tis_capped_frac", aggregate((w_BT >= cap).to(w_BT.dtype), mb.mask_BT, "token-mean", norm))
    return loss_BT * w_BT


def _kl_loss_terms(job: ActorUpdate, mb: RolloutBatch, logp_BT, dist) -> torch.Tensor:
    est = job.losses.kl_estimator
    if not getattr(est, "needs_logits", False):
        return est(logp_BT, mb.ref_log_probs_BT)
    return scatter_rows(_full_kl(job, mb, dist), [len(r) for r in mb.responses], mb.mask_BT)


def _full_kl(job: ActorUpdate, mb: RolloutBatch, dist, chunk: int = 1024) -> torch.Tensor:
    """Exact KL over the vocabulary: one extra reference forward inside the micro-batch.

    Positions go through both output projections in chunks, each under activation
    checkpointing, so only [chunk, V] logits of each model exist at a time.
    """
    model, temperature = job.update.model, job.temperature
    with torch.no_grad(), job.losses.reference() as ref:
        (ref_h,) = packed_forward(ref, mb.prompts, mb.responses, dist.device, hidden_head)
    (h,) = packed_forward(model, mb.prompts, mb.responses, dist.device, hidden_head)
    head, ref_head = model.get_output_embeddings(), ref.get_output_embeddings()

    def chunk_kl(h_c, ref_c):
        with torch.no_grad():
            ref_logits = ref_head(ref_c).float() / temperature
        return job.losses.kl_estimator(head(h_c).float() / temperature, ref_logits)

    parts = [
        torch.utils.checkpoint.checkpoint(chunk_kl, h[i : i + chunk], ref_h[i : i + chunk], use_reentrant=False)
        for i in range(0, h.shape[0], chunk)
    ]
    return torch.cat(parts).float()
