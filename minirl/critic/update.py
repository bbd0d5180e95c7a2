"""The critic's two phases of a step: the values pass (before the advantages) and the update
(beside the actor's), in the actor's loop (minirl.update.loop) with the clipped value loss.

The update's loss is minirl.critic.value_loss's, aggregated with critic.loss_agg_mode over the
whole global mini-batch (minirl.algo.loss_agg), exactly as the policy loss. Its metrics:
critic/vf_loss, vf_clipfrac, vpred_mean (means over the optimizer steps), grad_norm (mean over
the finite ones) and nonfinite_steps.
Legend: B sequences, T response positions, R response tokens of a micro-batch.
"""

from __future__ import annotations

import functools

import torch

from minirl.algo.loss_agg import AggNorm, aggregate
from minirl.algo.stats import DeviceSums
from minirl.batch import RolloutBatch, scatter_rows
from minirl.critic import Critic
from minirl.critic.model import response_values, value_head
from minirl.critic.value_loss import clipped_value_loss
from minirl.dist.context import DistContext
from minirl.forward.packed import per_token_pass
from minirl.update.loop import run_update


def compute_values(critic: Critic, batch: RolloutBatch, dist: DistContext) -> torch.Tensor:
    """V [B, T] of the batch's responses (0 at masked positions), in the values pass's own
    micro-batches (critic.forward_micro_batch_size_per_gpu / forward_max_token_len_per_gpu)."""
    return per_token_pass(critic.model, batch, critic.values_micro, value_head, dist)


def update_critic(critic: Critic, batch: RolloutBatch, dist: DistContext) -> dict[str, float]:
    """critic.ppo_epochs passes over the batch in mini-batches of critic.ppo_mini_batch_size
    prompts; reads the batch's values_BT (the values pass) and returns_BT (the estimator's)."""
    loss = functools.partial(_micro_batch_loss, critic, dist)
    metrics, _ = run_update(critic.update, batch, loss, dist)
    return metrics


def _micro_batch_loss(critic: Critic, dist: DistContext, mb: RolloutBatch, norm: AggNorm, sums: DeviceSums):
    cfg, mask_BT = critic.cfg, mb.mask_BT
    values_R = response_values(critic.model, mb.prompts, mb.responses, dist.device)
    vpred_BT = scatter_rows(values_R, [len(r) for r in mb.responses], mask_BT)
    out = clipped_value_loss(vpred_BT, mb.values_BT, mb.returns_BT, mask_BT, cfg.cliprange_value)
    loss = aggregate(out.loss_BT, mask_BT, cfg.loss_agg_mode, norm)
    sums.add("vf_loss", loss)
    sums.add("vf_clipfrac", aggregate(out.clipped_BT, mask_BT, "token-mean", norm))
    sums.add("vpred_mean", aggregate(vpred_BT.detach(), mask_BT, "token-mean", norm))
    return loss
