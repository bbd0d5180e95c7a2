"""The PPO update loop, written once for the actor and the critic: epochs, mini-batches (one
optimizer step each), micro-batches (one backward each). Each model supplies only its
micro-batch loss (minirl.update.actor, minirl.critic.update).

Losses are normalised by counts over the whole global mini-batch (minirl.algo.loss_agg), so the
gradient does not depend on how sequences are split into micro-batches or ranks. An optimizer
step whose loss or gradient norm is non-finite on any rank is skipped (minirl.algo.guard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from minirl.algo.guard import NONFINITE_STEPS, nonfinite_step
from minirl.algo.loss_agg import AggNorm, mini_batch_norm
from minirl.algo.stats import DeviceSums
from minirl.batch import MicroBatching, RolloutBatch, mini_batches, select_micro, split_micro
from minirl.dist.context import DistContext

MicroBatchLoss = Callable[[RolloutBatch, AggNorm, DeviceSums], torch.Tensor]
"""loss(micro_batch, norm, sums) -> this micro-batch's share of the mini-batch loss (already
divided by the global counts in `norm`); it adds its metric terms to `sums` the same way."""


@dataclass
class Update:
    """One model's update: the model and its optimizer, and how the loop walks a batch, from the
    model's config section (actor, or critic with its unset keys the actor's), built once by
    minirl.build."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    prefix: str  # of the metrics: "actor/" or "critic/"
    epochs: int
    shuffle: bool
    seqs_per_mini: int  # this rank's sequences per mini-batch: ppo_mini_batch_size x rollout.n / dp
    micro: MicroBatching
    grad_clip: float
    max_response_length: int  # seq-mean-token-sum-norm's divisor unless loss_scale_factor is set
    loss_scale_factor: float | None = None


def run_update(update: Update, batch: RolloutBatch, loss: MicroBatchLoss, dist: DistContext):
    """epochs passes over the batch in mini-batches. Returns (metrics, the phase of each skipped
    optimizer step): the loss terms' means over the optimizer steps, grad_norm (mean over the
    finite ones) and nonfinite_steps, each under update.prefix."""
    sums, grad_norms, bad_phases = DeviceSums(), [], []
    for _epoch in range(update.epochs):
        order = torch.randperm(len(batch)) if update.shuffle else None
        for mini in mini_batches(len(batch), update.seqs_per_mini, order):
            grad_norm, bad = _mini_batch_step(update, batch.select(mini), loss, dist, sums)
            grad_norms.append(grad_norm)
            bad_phases += [bad] if bad else []
    metrics = sums.means(len(grad_norms), update.prefix, dist.all_reduce)
    finite = [g for g in grad_norms if math.isfinite(g)]
    metrics[f"{update.prefix}grad_norm"] = sum(finite) / max(1, len(finite))
    metrics[f"{update.prefix}{NONFINITE_STEPS}"] = float(len(bad_phases))
    return metrics, bad_phases


def _mini_batch_step(update: Update, mb: RolloutBatch, loss: MicroBatchLoss, dist: DistContext, sums: DeviceSums):
    """Backward over the micro-batches, then one optimizer step unless a number is non-finite.

    Returns (grad_norm, "" or the phase of the first non-finite value: "loss" or "grad_norm").
    """
    norm = mini_batch_norm(mb.mask_BT, dist.all_reduce, update.loss_scale_factor, update.max_response_length)
    loss_sum = torch.zeros((), device=dist.device)
    for idx in split_micro(mb, update.micro, dist.max_over_ranks, dist.sp_size):
        micro_loss = loss(select_micro(mb, idx), norm, sums)
        micro_loss.backward()
        loss_sum = loss_sum + micro_loss.detach().float()
    grad_norm = torch.nn.utils.clip_grad_norm_(update.model.parameters(), update.grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    bad, norm = nonfinite_step(loss_sum, grad_norm, dist.all_reduce)
    if not bad:
        update.optimizer.step()  # a skipped step keeps NaN and inf out of the weights and the optimizer state
    update.optimizer.zero_grad(set_to_none=True)
    return norm, bad
