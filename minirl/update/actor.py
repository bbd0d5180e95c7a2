"""Log-prob passes and the PPO-style actor update over mini- and micro-batches.

Losses are normalised by counts over the whole global mini-batch (minirl.algo.loss_agg), so the
gradient does not depend on how sequences are split into micro-batches or ranks.
Legend: B sequences, T response positions, R response tokens of a micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from minirl.algo.guard import PHASE_METRIC, STEPS_METRIC, first_nonfinite_input, nonfinite_step, phase_code
from minirl.algo.loss_agg import aggregate, mini_batch_norm
from minirl.algo.rollout_corr import ROLLOUT_LOG_PROBS, MismatchStats, require_rollout_log_probs, tis_weights
from minirl.algo.stats import DeviceSums
from minirl.batch import (
    RolloutBatch,
    mini_batches,
    scatter_rows,
    scatter_tokens,
    select_micro,
    split_micro,
)
from minirl.dist.context import DistContext
from minirl.dist.transfer import tensor_to
from minirl.errors import UserError
from minirl.forward.packed import response_hidden, response_logprobs
from minirl.models import assembly


@torch.no_grad()
def compute_logprobs(model, batch: RolloutBatch, temperature: float, micro, dist: DistContext) -> torch.Tensor:
    """Per-token log-probs [B, T] of the responses under `model` (old or reference policy).

    `micro` is (per_micro, dynamic, budget, key) of the phase's config section.
    """
    out_BT = torch.zeros(batch.mask_BT.shape, device=dist.device)
    for idx in split_micro(batch, list(range(len(batch))), *micro, dist.max_over_ranks, dist.sp_size):
        sub = select_micro(batch, idx)  # an empty idx still runs its forward: FSDP ranks run in step
        logp_R, _ = response_logprobs(model, sub.prompts, sub.responses, temperature, dist.device)
        if idx:
            out_BT[tensor_to(idx, torch.long, dist.device)] = scatter_tokens(logp_R.float(), sub.mask_BT)
    assembly.reshard(model)
    return out_BT


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
    ref_model: Any = None  # only for an estimator with needs_logits (the exact full KL)


class MetricSums(DeviceSums):
    """Sums of per-micro-batch loss contributions; each already carries its global normaliser.

    mismatch: the step's rollout / training mismatch (None without rollout log-probs).
    """

    def __init__(self, mismatch: MismatchStats | None = None):
        super().__init__()
        self.mismatch = mismatch

    def reduced(self, dist: DistContext, n_minis: int) -> dict[str, float]:
        return self.means(n_minis, "actor/", dist.reduce_sum)


def update_actor(
    model,
    optimizer,
    batch: RolloutBatch,
    cfg,
    temperature: float,
    max_response_length: int,
    losses: Losses,
    dist: DistContext,
    n: int,
) -> dict[str, float]:
    """ppo_epochs passes over the batch in mini-batches of ppo_mini_batch_size prompts.

    An optimizer step whose loss or gradient norm is non-finite on any rank is skipped
    (minirl.algo.guard); the metrics count those and name the phase of the first non-finite value.
    Without "old_log_probs" in the batch the update must be on-policy (one epoch, one mini-batch):
    the old log-probs are then each micro-batch's own forward, detached.
    """
    check_advantages(batch)
    require_rollout_log_probs(batch.tensors, cfg.tis_imp_ratio_cap)
    input_phase = first_nonfinite_input(batch.tensors, dist.reduce_sum)
    seqs_per_mini = cfg.ppo_mini_batch_size * n // dist.dp_size
    sums, grad_norms, bad_phases = MetricSums(_mismatch_stats(batch, dist)), [], []
    for _epoch in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch)) if cfg.shuffle else None
        for mini in mini_batches(len(batch), seqs_per_mini, order):
            grad_norm, bad = _mini_batch_step(
                model, optimizer, batch, mini, cfg, temperature, max_response_length, losses, dist, sums
            )
            grad_norms.append(grad_norm)
            bad_phases += [bad] if bad else []
    metrics = sums.reduced(dist, len(grad_norms))
    finite = [g for g in grad_norms if math.isfinite(g)]
    metrics["actor/grad_norm"] = sum(finite) / max(1, len(finite))
    metrics[STEPS_METRIC] = float(len(bad_phases))
    metrics[PHASE_METRIC] = phase_code((input_phase or bad_phases[0]) if bad_phases else "")
    if sums.mismatch is not None:
        metrics.update(sums.mismatch.reduced(dist))
    return metrics


def _mismatch_stats(batch: RolloutBatch, dist: DistContext) -> MismatchStats | None:
    """None without rollout log-probs. With the separate pass the whole batch's old log-probs
    are known now; with the on-policy shortcut each micro-batch adds its own in the update."""
    if ROLLOUT_LOG_PROBS not in batch.tensors:
        return None
    stats = MismatchStats(dist.device)
    if "old_log_probs" in batch.tensors:
        stats.add(batch.tensors["old_log_probs"], batch.tensors[ROLLOUT_LOG_PROBS], batch.mask_BT)
    return stats


def check_advantages(batch: RolloutBatch) -> None:
    """The estimator's output must be [B, T] like the mask (a plugin may return anything)."""
    adv, mask = batch.tensors.get("advantages"), batch.mask_BT
    if not isinstance(adv, torch.Tensor) or adv.shape != mask.shape:
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise UserError(
            f"algorithm.adv_estimator: the estimator returned advantages of shape {got}, expected "
            f"[B, T] = {tuple(mask.shape)} (one value per response token); fix the estimator"
        )


def _mini_batch_step(model, optimizer, batch, mini, cfg, temperature, max_len, losses, dist, sums):
    """Backward over the micro-batches, then one optimizer step unless a number is non-finite.

    Returns (grad_norm, "" or the phase of the first non-finite value: "loss" or "grad_norm").
    """
    mb = batch.select(mini)
    norm = mini_batch_norm([mb.mask_BT], dist.reduce_sum, cfg.loss_scale_factor, max_len)
    micro = split_micro(
        mb,
        list(range(len(mb))),
        cfg.ppo_micro_batch_size_per_gpu,
        cfg.use_dynamic_bsz,
        cfg.ppo_max_token_len_per_gpu,
        "actor.ppo_max_token_len_per_gpu",
        dist.max_over_ranks,
        dist.sp_size,
    )
    loss_sum = torch.zeros((), device=dist.device)
    for idx in micro:
        loss = _micro_batch_loss(model, select_micro(mb, idx), cfg, temperature, norm, losses, dist, sums)
        (loss * dist.loss_scale).backward()
        loss_sum = loss_sum + loss.detach().float()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    bad, norm = nonfinite_step(loss_sum, grad_norm, dist.reduce_sum)
    if not bad:
        optimizer.step()  # a skipped step keeps NaN and inf out of the weights and the optimizer state
    optimizer.zero_grad(set_to_none=True)
    return norm, bad


def _micro_batch_loss(model, mb: RolloutBatch, cfg, temperature, norm, losses: Losses, dist, sums) -> torch.Tensor:
    mask_BT = mb.mask_BT
    logp_R, ent_R = response_logprobs(model, mb.prompts, mb.responses, temperature, dist.device, with_entropy=True)
    lens = [len(r) for r in mb.responses]
    logp_BT, ent_BT = scatter_rows(torch.stack([logp_R, ent_R], -1).float(), lens, mask_BT).unbind(-1)
    on_policy = "old_log_probs" not in mb.tensors
    old_BT = logp_BT.detach() if on_policy else mb.tensors["old_log_probs"]
    if on_policy and sums.mismatch is not None:
        sums.mismatch.add(old_BT, mb.tensors[ROLLOUT_LOG_PROBS], mask_BT)
    pg = losses.policy_loss(logp_BT, old_BT, mb.tensors["advantages"], mask_BT, cfg)
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
    if losses.kl_estimator is not None:
        kl_BT = _kl_loss_terms(model, mb, logp_BT, temperature, losses, dist)
        kl = aggregate(kl_BT, mask_BT, mode, norm)
        sums.add("kl_loss", kl)
        loss = loss + cfg.kl_loss_coef * kl
    return loss


def _tis(loss_BT, old_BT, mb: RolloutBatch, cap: float, norm, sums: MetricSums) -> torch.Tensor:
    """Truncated importance sampling (minirl.algo.rollout_corr): loss_BT · min(exp(lp_old − lp_roll), cap),
    the weight detached. Off (cap <= 0, i.e. -1) returns loss_BT itself, so the loss is bit for bit
    the unweighted one. Logs the token-mean weight and the share of valid tokens at the cap."""
    if not cap > 0:
        return loss_BT
    w_BT = tis_weights(old_BT, mb.tensors[ROLLOUT_LOG_PROBS], cap)
    sums.add("tis_weight_mean", aggregate(w_BT, mb.mask_BT, "token-mean", norm))
    sums.add("tis_capped_frac", aggregate((w_BT >= cap).to(w_BT.dtype), mb.mask_BT, "token-mean", norm))
    return loss_BT * w_BT


def _kl_loss_terms(model, mb: RolloutBatch, logp_BT, temperature, losses: Losses, dist) -> torch.Tensor:
    est = losses.kl_estimator
    if not getattr(est, "needs_logits", False):
        return est(logp_BT, mb.tensors["ref_log_probs"])
    return scatter_rows(_full_kl(model, mb, temperature, losses, dist), [len(r) for r in mb.responses], mb.mask_BT)


def _full_kl(model, mb, temperature, losses: Losses, dist, chunk: int = 1024) -> torch.Tensor:
    """Exact KL over the vocabulary: one extra reference forward inside the micro-batch.

    Positions go through both output projections in chunks, each under activation
    checkpointing, so only [chunk, V] logits of each model exist at a time.
    """
    with torch.no_grad():
        ref_h, _ = response_hidden(losses.ref_model, mb.prompts, mb.responses, dist.device)
    h, _ = response_hidden(model, mb.prompts, mb.responses, dist.device)
    head, ref_head = model.get_output_embeddings(), losses.ref_model.get_output_embeddings()

    def chunk_kl(h_c, ref_c):
        with torch.no_grad():
            ref_logits = ref_head(ref_c).float() / temperature
        return losses.kl_estimator(head(h_c).float() / temperature, ref_logits)

    parts = [
        torch.utils.checkpoint.checkpoint(chunk_kl, h[i : i + chunk], ref_h[i : i + chunk], use_reentrant=False)
        for i in range(0, h.shape[0], chunk)
    ]
    return torch.cat(parts).float()
