"""Packed forward passes: per-token log-probs (and entropy) of response tokens, no padding.

A micro-batch of sequences becomes one packed row [1, N] (prompt + response of each sequence,
back to back); minirl's registered attention keeps the sequences apart. Only the hidden states
that predict response tokens go through the output projection, in chunks, so the float32 logits
of a whole batch never exist at once.
Legend: N packed tokens, R response tokens of the micro-batch, H hidden size.
"""

from __future__ import annotations

import contextlib
from itertools import chain

import numpy as np
import torch

from minirl.batch import ragged_arange
from minirl.dist.transfer import to_device
from minirl.forward.logprob import chunked_logprobs
from minirl.models.attention import ATTN_NAME, packed_forward_kwargs


def mixed_precision(device: torch.device):
    """bf16 matmuls over fp32 master weights on CUDA (what FSDP2's MixedPrecisionPolicy does
    when sharded); the log-softmax stays float32 (chunked_logprobs computes it in float32 from
    each bf16 logits chunk)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def hidden_states(model: torch.nn.Module, input_ids_1N: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Last hidden states [N, H] of a packed row."""
    kwargs = packed_forward_kwargs(seq_lens, input_ids_1N.device, _reads_no_mask(model))
    out = model.get_decoder()(input_ids=input_ids_1N, **kwargs)
    return out.last_hidden_state[0]


def run_packed(model: torch.nn.Module, fn, *args):
    """fn(model, *args), through `model.minirl_forward` when a data-parallel plugin installed one.

    The packed passes call the decoder and the lm_head directly, never model.forward, so FSDP2's
    root hooks would not gather the root's parameters (embeddings, lm_head); the FSDP2 plugin
    registers `minirl_forward` as a forward method to run them around fn.
    """
    method = getattr(model, "minirl_forward", None)
    return fn(model, *args) if method is None else method(fn, *args)


def split(model: torch.nn.Module, input_ids_1N, seq_lens: list[int], pred_pos_R, labels_R):
    """This rank's share of a packed row: (input_ids [1, n], forward kwargs, predicting positions
    [r] within it on the row's device, their labels [r], gather: [r, ...] -> [R, ...]).
    pred_pos_R is `pack`'s numpy array.

    Without sequence parallelism that is the whole row. A sequence-parallel plugin (Ulysses)
    installs `model.minirl_sequence_parallel`, whose `split` cuts the row into slices.
    """
    sp = getattr(model, "minirl_sequence_parallel", None)
    if sp is not None:
        return sp.split(input_ids_1N, seq_lens, pred_pos_R, labels_R)
    kwargs = packed_forward_kwargs(seq_lens, input_ids_1N.device, _reads_no_mask(model))
    return input_ids_1N, kwargs, to_device(torch.from_numpy(pred_pos_R), input_ids_1N.device), labels_R, _whole


def _reads_no_mask(model: torch.nn.Module) -> bool:
    """minirl's attention takes packed rows' boundaries from cu_seq_lens and never reads the mask."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_NAME


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


def _packed_logprobs(model, input_ids_1N, seq_lens, pred_pos_R, labels_R, temperature, with_entropy):
    ids_1n, kwargs, pos_r, labels_r, gather = split(model, input_ids_1N, seq_lens, pred_pos_R, labels_R)
    hidden_nH = model.get_decoder()(input_ids=ids_1n, **kwargs).last_hidden_state[0]
    logp_r, ent_r = chunked_logprobs(
        hidden_nH[pos_r],
        model.get_output_embeddings(),
        labels_r,
        temperature,
        with_entropy=with_entropy,
        recompute=torch.is_grad_enabled(),
    )
    if pos_r.numel() == 0 and torch.is_grad_enabled():
        # a slice that predicts no response token must still run its backward: the
        # sequence-parallel all-to-alls inside it are collectives the other slices wait on
        logp_r = logp_r + 0.0 * hidden_nH.sum()
    return gather(logp_r), (None if ent_r is None else gather(ent_r))


def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float,
    device: torch.device,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] (and entropies [R]) of the response tokens, sequence-major, unpadded."""
    input_ids, lens, pred_pos, labels = pack(prompts, responses, device)
    with mixed_precision(device):
        return run_packed(model, _packed_logprobs, input_ids, lens, pred_pos, labels, temperature, with_entropy)


def _packed_hidden(model, input_ids_1N, seq_lens, pred_pos_R, labels_R):
    ids_1n, kwargs, pos_r, _, gather = split(model, input_ids_1N, seq_lens, pred_pos_R, labels_R)
    hidden_nH = model.get_decoder()(input_ids=ids_1n, **kwargs).last_hidden_state[0]
    return gather(hidden_nH[pos_r])


def response_hidden(model: torch.nn.Module, prompts, responses, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [R, H] that predict the response tokens, and the labels [R] (for full KL)."""
    input_ids, lens, pred_pos, labels = pack(prompts, responses, device)
    with mixed_precision(device):
        return run_packed(model, _packed_hidden, input_ids, lens, pred_pos, labels), labels
