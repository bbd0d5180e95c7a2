"""The packed forward: a micro-batch of sequences run as one row, with a head on the positions
that predict response tokens; and the gradient-free pass of such forwards over a whole batch.

A micro-batch becomes one packed row [1, N] (prompt + response of each sequence, back to back);
minirl's registered attention keeps the sequences apart. Only the hidden states that predict
response tokens reach the head, so nothing the size of the whole row's logits ever exists. The
heads: `logprob_head` (log-probs and entropies, chunked: minirl.forward.logprob), `hidden_head`
(the hidden states themselves, for the exact full KL) and the critic's value head
(minirl.critic.model).
Legend: B sequences, T response positions, N packed tokens, R response tokens of the
micro-batch (n, r: of this rank's slice under sequence parallelism), H hidden size.
"""

from __future__ import annotations

import contextlib
from itertools import chain
from typing import Callable

import numpy as np
import torch

from minirl.batch import MicroBatching, RolloutBatch, ragged_arange, scatter_rows, split_micro
from minirl.dist.context import DistContext
from minirl.dist.transfer import tensor_to, to_device
from minirl.forward.logprob import chunked_logprobs
from minirl.models import assembly
from minirl.models.attention import ATTN_NAME, packed_forward_kwargs
from minirl.protocols import PACKED_FORWARD, SEQUENCE_PARALLEL

Head = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple]
"""head(model, hidden_rH, labels_r) -> a tuple of per-position outputs [r, ...] (or None)."""


def matmul_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype every pass multiplies the model's matrices in on `device`, whatever dtype they
    are stored in (None: their own): bf16 on CUDA, through mixed_precision's autocast."""
    return torch.bfloat16 if device.type == "cuda" else None


def param_dtype(fsdp_cfg, device_type: str) -> torch.dtype | None:
    """fsdp_config.param_dtype resolved (validated up front): the dtype data-parallel sharding
    gathers every parameter in, so the dtype every pass reads the weights in; "auto" is bf16 on
    CUDA and, elsewhere, None (the model's own)."""
    name = fsdp_cfg.param_dtype
    if name == "auto":
        name = "bfloat16" if device_type == "cuda" else None
    return getattr(torch, name) if name else None


def mixed_precision(device: torch.device):
    """bf16 matmuls over fp32 master weights on CUDA (what FSDP2's MixedPrecisionPolicy does
    when sharded); the log-softmax stays float32 (chunked_logprobs computes it in float32 from
    each bf16 logits chunk)."""
    dtype = matmul_dtype(device)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def pack(
    prompts: list[list[int]], responses: list[list[int]], device
) -> tuple[torch.Tensor, list[int], np.ndarray, torch.Tensor]:
    """Return input_ids [1, N], the sequence lengths, the predicting positions [R], the labels [R].

    The predicting positions stay a numpy array on the host: `split` places them (a pinned copy),
    and a sequence-parallel split cuts its slices by them without reading anything back from the
    device. Not a CPU tensor: FSDP2's root forward (`run_packed` under FSDP2) moves every tensor
    argument to the device with a blocking copy, and leaves other objects alone.
    Built in numpy: this runs on the host before the first kernel of every pass. Through
    torch.tensor(list), 2 ms for each 30k-id list, the whole pack took 4 ms; with np.fromiter, 1.
    """
    p_S = np.fromiter(map(len, prompts), np.int64, len(prompts))
    r_S = np.fromiter(map(len, responses), np.int64, len(responses))
    seq_S = p_S + r_S
    ids_N = np.fromiter(chain.from_iterable(chain.from_iterable(zip(prompts, responses))), np.int64, int(seq_S.sum()))
    labels_R = np.fromiter(chain.from_iterable(responses), np.int64, int(r_S.sum()))
    # response token t of sequence s sits at row offset_s + len(p_s) + t, predicted by the one before
    pred_pos_R = ragged_arange((np.cumsum(seq_S) - seq_S) + p_S - 1, r_S)
    input_ids = to_device(torch.from_numpy(ids_N), device)[None]
    return input_ids, seq_S.tolist(), pred_pos_R, to_device(torch.from_numpy(labels_R), device)


def packed_forward(model: torch.nn.Module, prompts, responses, device: torch.device, head: Head) -> tuple:
    """head's outputs [R, ...] at the positions that predict the response tokens, sequence-major."""
    input_ids, lens, pred_pos, labels = pack(prompts, responses, device)
    with mixed_precision(device):
        return run_packed(model, _forward_with_head, input_ids, lens, pred_pos, labels, head)


def run_packed(model: torch.nn.Module, fn, *args):
    """fn(model, *args), through the model's PackedForward hook when a data-parallel plugin
    installed one (minirl.protocols says why FSDP2 needs it)."""
    hook = getattr(model, PACKED_FORWARD, None)
    return fn(model, *args) if hook is None else hook(fn, *args)


def _forward_with_head(model, input_ids_1N, seq_lens, pred_pos_R, labels_R, head: Head) -> tuple:
    ids_1n, kwargs, pos_r, labels_r, gather = split(model, input_ids_1N, seq_lens, pred_pos_R, labels_R)
    hidden_nH = model.get_decoder()(input_ids=ids_1n, **kwargs).last_hidden_state[0]
    outs_r = head(model, hidden_nH[pos_r], labels_r)
    if pos_r.numel() == 0 and torch.is_grad_enabled():
        # a slice that predicts no response token must still run its backward: the
        # sequence-parallel all-to-alls inside it are collectives the other slices wait on
        anchor = 0.0 * hidden_nH.sum()
        outs_r = tuple(None if x is None else x + anchor for x in outs_r)
    return tuple(None if x is None else gather(x) for x in outs_r)


def split(model: torch.nn.Module, input_ids_1N, seq_lens: list[int], pred_pos_R, labels_R):
    """This rank's share of a packed row (minirl.protocols.SequenceParallel.split's contract):
    the whole row, unless a sequence-parallel plugin cuts it into slices."""
    sp = getattr(model, SEQUENCE_PARALLEL, None)
    if sp is not None:
        return sp.split(input_ids_1N, seq_lens, pred_pos_R, labels_R)
    kwargs = packed_forward_kwargs(seq_lens, input_ids_1N.device, _reads_no_mask(model))
    return input_ids_1N, kwargs, to_device(torch.from_numpy(pred_pos_R), input_ids_1N.device), labels_R, _whole


def _reads_no_mask(model: torch.nn.Module) -> bool:
    """minirl's attention takes packed rows' boundaries from cu_seq_lens and never reads the mask."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_NAME


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


# ---------------------------------------------------------------------------------------------
# heads
# ---------------------------------------------------------------------------------------------


def logprob_head(temperature: float, with_entropy: bool = False) -> Head:
    """(log-probs [r], entropies [r] or None) of the labels under lm_head(h) / temperature; with
    gradients each chunk's logits are recomputed in the backward instead of kept."""

    def head(model, hidden_rH, labels_r):
        out = model.get_output_embeddings()
        return chunked_logprobs(hidden_rH, out, labels_r, temperature, with_entropy=with_entropy)

    return head


def hidden_head(model, hidden_rH: torch.Tensor, labels_r: torch.Tensor) -> tuple[torch.Tensor]:
    """The hidden states [r, H] themselves (the exact full KL applies both output heads)."""
    return (hidden_rH,)


def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float,
    device: torch.device,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] (and entropies [R]) of the response tokens, sequence-major, unpadded."""
    return packed_forward(model, prompts, responses, device, logprob_head(temperature, with_entropy))


# ---------------------------------------------------------------------------------------------
# the gradient-free pass over a batch (old and reference log-probs, the critic's values)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def per_token_pass(model, batch: RolloutBatch, micro: MicroBatching, head: Head, dist: DistContext) -> torch.Tensor:
    """head's first output at every response token as [B, T] float32 (0 at padding), micro-batch
    by micro-batch; the model is resharded after (no backward follows to do it).

    A micro-batch reads only its token ids and mask rows: no RolloutBatch.select, which would
    gather every tensor field of the batch and copy the index to the device a second time."""
    mask_BT = batch.mask_BT.to(dist.device)
    out_BT = torch.zeros(mask_BT.shape, device=dist.device)
    for idx in split_micro(batch, micro, dist.max_over_ranks, dist.sp_size):
        rows = idx or [0]  # an empty idx still runs a forward (sequence 0's): FSDP ranks run in step
        responses = [batch.responses[i] for i in rows]
        flat_R = packed_forward(model, [batch.prompts[i] for i in rows], responses, dist.device, head)[0]
        if idx:
            idx_B = tensor_to(idx, torch.long, dist.device)
            out_BT[idx_B] = scatter_rows(flat_R.float(), [len(r) for r in responses], mask_BT[idx_B])
    assembly.reshard(model)
    return out_BT
