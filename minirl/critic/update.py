"""The critic's two phases of a step: the values pass (before the advantages) and the update
(beside the actor's), with the actor's mini-/micro-batching and global loss normalisation.

The update's loss is minirl.critic.value_loss's, aggregated with critic.loss_agg_mode over the
whole global mini-batch (minirl.algo.loss_agg): each micro-batch contributes its partial sum divided
by the mini-batch's global counts, so the gradient is the same for any split over micro-batches
and data-parallel ranks. An optimizer step whose loss or gradient norm is non-finite on any rank
is skipped (counted in critic/nonfinite_steps), as the actor's.
Legend: B sequences, T response positions, R response tokens of a micro-batch.
"""

from __future__ import annotations

import math

import torch

from minirl.algo.guard import nonfinite_step
from minirl.algo.loss_agg import aggregate, mini_batch_norm
from minirl.algo.stats import DeviceSums
from minirl.batch import RolloutBatch, mini_batches, scatter_rows, scatter_tokens, select_micro, split_micro
from minirl.critic.model import response_values
from minirl.critic.value_loss import clipped_value_loss
from minirl.dist.context import DistContext
from minirl.dist.transfer import tensor_to
from minirl.models import assembly


def _micro(batch: RolloutBatch, cfg, dist: DistContext, forward: bool = False) -> list[list[int]]:
    """critic.ppo_micro_batch_size_per_gpu sequences, or critic.ppo_max_token_len_per_gpu tokens;
    forward (the values pass): critic.forward_micro_batch_size_per_gpu / forward_max_token_len_per_gpu."""
    prefix = "forward" if forward else "ppo"
    return split_micro(
        batch,
        list(range(len(batch))),
        getattr(cfg, f"{prefix}_micro_batch_size_per_gpu"),
        cfg.use_dynamic_bsz,
        getattr(cfg, f"{prefix}_max_token_len_per_gpu"),
        f"critic.{prefix}_max_token_len_per_gpu",
        dist.max_over_ranks,
        dist.sp_size,
    )


@torch.no_grad()
def compute_values(model, batch: RolloutBatch, cfg, dist: DistContext) -> torch.Tensor:
    """V [B, T] of the batch's responses (0 at masked positions); cfg is the `critic` section."""
    out_BT = torch.zeros(batch.mask_BT.shape, device=dist.device)
    for idx in _micro(batch, cfg, dist, forward=True):
        sub = select_micro(batch, idx)  # an empty idx still runs its forward: FSDP ranks run in step
        values_R = response_values(model, sub.prompts, sub.responses, dist.device)
        if idx:
            out_BT[tensor_to(idx, torch.long, dist.device)] = scatter_tokens(values_R, sub.mask_BT)
    assembly.reshard(model)
    return out_BT


def update_critic(model, optimizer, batch: RolloutBatch, cfg, max_response_length: int, dist: DistContext, n: int):
    """critic.ppo_epochs passes over the batch in mini-batches of critic.ppo_mini_batch_size prompts.

    Reads batch.tensors "values" (the values pass) and "returns" (the estimator's). Returns the
    critic/ metrics: vf_loss, vf_clipfrac, vpred_mean (means over the optimizer steps),
    grad_norm (mean over the finite ones) and nonfinite_steps.
    """
    seqs_per_mini = cfg.ppo_mini_batch_size * n // dist.dp_size
    sums = DeviceSums()
    grad_norms, skipped = [], 0
    for _epoch in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch)) if cfg.shuffle else None
        for mini in mini_batches(len(batch), seqs_per_mini, order):
            mb = batch.select(mini)
            grad_norm, bad = _mini_batch_step(model, optimizer, mb, cfg, max_response_length, dist, sums)
            grad_norms.append(grad_norm)
            skipped += int(bad)
    metrics = sums.means(len(grad_norms), "critic/", dist.reduce_sum)
    finite = [g for g in grad_norms if math.isfinite(g)]
    metrics["critic/grad_norm"] = sum(finite) / max(1, len(finite))
    metrics["critic/nonfinite_steps"] = float(skipped)
    return metrics


def _mini_batch_step(model, optimizer, mb: RolloutBatch, cfg, max_len: int, dist: DistContext, sums) -> tuple:
    """Backward over the micro-batches, then one optimizer step unless a number is non-finite.

    Returns (grad_norm, skipped: bool)."""
    norm = mini_batch_norm([mb.mask_BT], dist.reduce_sum, None, max_len)
    loss_sum = torch.zeros((), device=dist.device)
    for idx in _micro(mb, cfg, dist):
        loss = _micro_batch_loss(model, select_micro(mb, idx), cfg, norm, dist, sums)
        (loss * dist.loss_scale).backward()
        loss_sum = loss_sum + loss.detach().float()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    phase, norm = nonfinite_step(loss_sum, grad_norm, dist.reduce_sum)
    if not phase:
        optimizer.step()  # a skipped step keeps NaN and inf out of the weights and the optimizer state
    optimizer.zero_grad(set_to_none=True)
    return norm, bool(phase)


def _micro_batch_loss(model, mb: RolloutBatch, cfg, norm, dist: DistContext, sums) -> torch.Tensor:
    mask_BT = mb.mask_BT
    values_R = response_values(model, mb.prompts, mb.responses, dist.device)
    vpred_BT = scatter_rows(values_R, [len(r) for r in mb.responses], mask_BT)
    out = clipped_value_loss(vpred_BT, mb.tensors["values"], mb.tensors["returns"], mask_BT, cfg.cliprange_value)
    loss = aggregate(out.loss_BT, mask_BT, cfg.loss_agg_mode, norm)
    for name, value in (
        ("vf_loss", loss),
        ("vf_clipfrac", aggregate(out.clipped_BT, mask_BT, "token-mean", norm)),
        ("vpred_mean", aggregate(vpred_BT.detach(), mask_BT, "token-mean", norm)),
    ):
        sums.add(name, value)
    return loss
