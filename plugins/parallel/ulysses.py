"""Ulysses sequence parallelism (actor.ulysses_sequence_parallel_size = sp > 1): the first assembly
step, for the actor, the reference and the critic.

The sp ranks of a group hold the same micro-batch; each runs the decoder on a contiguous slice of
the packed row (`SequenceParallel.split`). Attention, the one part of a layer that needs whole
sequences, trades the sequence split for a head split with an all-to-all, runs minirl's varlen
attention with the row's global cu_seqlens, and trades back; the slices' outputs are all-gathered
into the row's order, so the loss code sees what one process would. all_to_all_single exists in
gloo too, so this runs in CPU CI. docs/architecture.md ("How the packed forward meets FSDP2 and
Ulysses") walks through it.
Legend: N padded packed tokens, n = N / sp tokens of a slice, H query heads, K key/value heads,
D head dim, R (r) response positions of the row (of a slice).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F

from minirl import hookimpl
from minirl.dist.transfer import to_device
from minirl.errors import UserError
from minirl.models.attention import minirl_attention_forward, packed_forward_kwargs, padding_mask_only
from minirl.models.varlen import varlen_attention
from minirl.protocols import SEQUENCE_PARALLEL

ATTN_NAME = "minirl_ulysses"
_KWARG = "minirl_ulysses"  # the forward kwarg that carries the SequenceParallel to the attention


@hookimpl
def minirl_apply_sequence_parallel(model, cfg, mesh):
    if mesh is None or "sp" not in (mesh.mesh_dim_names or ()) or mesh["sp"].size() == 1:
        return
    # the mesh's sp degree is the actor's key; the reference follows it (minirl.validate.layout)
    key = "actor.ulysses_sequence_parallel_size"
    sp = SequenceParallel(mesh["sp"].get_group(), mesh["sp"].size(), mesh["sp"].get_local_rank())
    check_heads(model.config, sp.size, key)
    register_attention()
    model.set_attn_implementation(ATTN_NAME)
    setattr(model, SEQUENCE_PARALLEL, sp)


def check_heads(config, sp: int, key: str) -> None:
    """Heads must split evenly over sp; key/value heads too, or be repeatable up to sp."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % sp:
        raise UserError(
            f"{key} = {sp}: the model's {heads} attention heads do not divide over {sp} ranks; use a divisor of {heads}"
        )
    if kv % sp and sp % kv:
        raise UserError(
            f"{key} = {sp}: the model's {kv} key/value heads neither divide over {sp} ranks nor "
            f"repeat evenly up to {sp}; use a divisor or a multiple of {kv} that divides {heads}"
        )


def register_attention() -> None:
    """Register the all-to-all wrapper with transformers (idempotent; the registry is by name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, padding_mask_only)


# ---------------------------------------------------------------------------------------------
# input slicing and output gathering (called by minirl.forward.packed)
# ---------------------------------------------------------------------------------------------


@dataclass
class SequenceParallel:
    group: Any
    size: int
    rank: int

    def split(self, input_ids_1N, seq_lens: list[int], pred_pos_R, labels_R):
        """This rank's slice of the packed row (minirl.protocols.SequenceParallel.split)."""
        total = input_ids_1N.shape[1]
        pad = -total % self.size
        lens = list(seq_lens) + ([pad] if pad else [])  # the padding is a sequence of its own
        kwargs = packed_forward_kwargs(lens, input_ids_1N.device, stand_in_mask=True)  # reads cu_seq_lens only
        n = (total + pad) // self.size
        lo = self.rank * n
        kwargs["position_ids"] = kwargs["position_ids"][:, lo : lo + n]
        kwargs[_KWARG] = self
        ids_1n = F.pad(input_ids_1N, (0, pad))[:, lo : lo + n]
        # predicting positions are sorted, so each slice owns one contiguous run of them; they are a
        # numpy array on the host (minirl.forward.packed.pack): the cuts need no read-back from the device
        cuts = np.searchsorted(pred_pos_R, np.arange(self.size + 1) * n).tolist()
        counts = [b - a for a, b in itertools.pairwise(cuts)]
        start, stop = cuts[self.rank], cuts[self.rank + 1]
        gather = lambda x_r: _GatherSlices.apply(x_r, self, counts)  # [r, ...] -> [R, ...]
        pos_r = to_device(torch.from_numpy(pred_pos_R[start:stop] - lo), input_ids_1N.device)
        return ids_1n, kwargs, pos_r, labels_R[start:stop], gather


class _GatherSlices(torch.autograd.Function):
    """[r, ...] of each slice -> [R, ...] in row order (an all_gather of padded pieces). Backward
    keeps this slice's part of the gradient: every rank of the sp group computes the same loss
    from the gathered tensor, so each slice's gradient is already whole on its rank."""

    @staticmethod
    def forward(ctx, x_r, sp: SequenceParallel, counts: list[int]):
        ctx.start, ctx.count = sum(counts[: sp.rank]), counts[sp.rank]
        width = max(counts)
        padded = x_r.new_zeros((width, *x_r.shape[1:]))
        padded[: x_r.shape[0]] = x_r
        pieces = [torch.empty_like(padded) for _ in range(sp.size)]
        tdist.all_gather(pieces, padded.contiguous(), group=sp.group)
        return torch.cat([piece[:c] for piece, c in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad_R):
        return grad_R[ctx.start : ctx.start + ctx.count], None, None


# ---------------------------------------------------------------------------------------------
# the attention wrapper
# ---------------------------------------------------------------------------------------------


def ulysses_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention signature. Calls that carry no SequenceParallel (generate, padded
    batches, a model used whole) are minirl's own attention unchanged."""
    sp = kwargs.pop(_KWARG, None)
    if sp is None or sp.size == 1:
        return minirl_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    dropout, window = kwargs.get("dropout", 0.0), kwargs.get("sliding_window")
    if dropout or window is not None:  # let minirl's attention raise its clear errors
        minirl_attention_forward(module, query, key, value, attention_mask, dropout=dropout, sliding_window=window)
    q_nHD = query[0].transpose(0, 1)
    k_nKD, v_nKD = (_repeat_kv_to(t[0].transpose(0, 1), sp.size) for t in (key, value))
    q_NhD, k_NkD, v_NkD = (_AllToAll.apply(x, sp, True) for x in (q_nHD, k_nKD, v_nKD))
    out_NhD = varlen_attention(q_NhD, k_NkD, v_NkD, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), scaling)
    return _AllToAll.apply(out_NhD, sp, False).unsqueeze(0), None


def _repeat_kv_to(x_nKD: torch.Tensor, sp: int) -> torch.Tensor:
    """Fewer key/value heads than ranks: repeat each up to sp, keeping GQA's head-to-group map."""
    kv = x_nKD.shape[1]
    return x_nKD if kv % sp == 0 else x_nKD.repeat_interleave(sp // kv, dim=1)


def _seq_to_heads(x_nHD: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[n, H, D] (this rank's tokens, all heads) -> [N, H/sp, D] (all tokens, this rank's heads)."""
    n, heads, dim = x_nHD.shape
    send = x_nHD.reshape(n, sp.size, heads // sp.size, dim).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # recv[j] = rank j's tokens, my heads
    tdist.all_to_all_single(recv, send, group=sp.group)
    return recv.reshape(sp.size * n, heads // sp.size, dim)


def _heads_to_seq(x_NhD: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[N, H/sp, D] -> [n, H, D]: the inverse of _seq_to_heads."""
    total, heads, dim = x_NhD.shape
    send = x_NhD.reshape(sp.size, total // sp.size, heads, dim).contiguous()
    recv = torch.empty_like(send)  # recv[j] = my tokens, rank j's heads
    tdist.all_to_all_single(recv, send, group=sp.group)
    return recv.transpose(0, 1).reshape(total // sp.size, sp.size * heads, dim)


class _AllToAll(torch.autograd.Function):
    """_seq_to_heads (to_heads) or _heads_to_seq, whose backward is the other one."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return _seq_to_heads(x, sp) if to_heads else _heads_to_seq(x, sp)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (_heads_to_seq(grad, ctx.sp) if ctx.to_heads else _seq_to_heads(grad, ctx.sp)), None, None
