"""Packed forward passes: per-token log-probs (and entropy) of response tokens, no padding.

A micro-batch of sequences becomes one packed row [1, N] (prompt + response of each sequence,
back to back); minirl's registered attention keeps the sequences apart. Only the hidden states
that predict response tokens go through the output projection, in chunks, so the float32 logits
of a whole batch never exist at once.
Legend: N packed tokens, R response tokens of the micro-batch, H hidden size.
"""

from __future__ import annotations

import torch

from minirl.logprob import chunked_logprobs
from minirl.models.attention import packed_forward_kwargs

LOGIT_CHUNK = 2048  # response positions per output-projection chunk


def pack(prompts: list[list[int]], responses: list[list[int]], device) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """Return input_ids [1, N], the sequence lengths, the predicting positions [R], the labels [R]."""
    ids, lens, pred_pos, labels, offset = [], [], [], [], 0
    for p, r in zip(prompts, responses):
        ids += p + r
        lens.append(len(p) + len(r))
        # position offset + len(p) - 1 + t predicts response token t
        pred_pos.append(torch.arange(len(r)) + offset + len(p) - 1)
        labels += r
        offset += len(p) + len(r)
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)[None]
    return input_ids, lens, torch.cat(pred_pos).to(device), torch.tensor(labels, dtype=torch.long, device=device)


def hidden_states(model: torch.nn.Module, input_ids_1N: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Last hidden states [N, H] of a packed row."""
    kwargs = packed_forward_kwargs(seq_lens, device=input_ids_1N.device)
    out = model.get_decoder()(input_ids=input_ids_1N, **kwargs)
    return out.last_hidden_state[0]


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
    hidden_NH = hidden_states(model, input_ids, lens)
    return chunked_logprobs(
        hidden_NH[pred_pos], model.get_output_embeddings(), labels, temperature,
        chunk_size=LOGIT_CHUNK, with_entropy=with_entropy, recompute=torch.is_grad_enabled(),
    )


def response_hidden(model: torch.nn.Module, prompts, responses, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [R, H] that predict the response tokens, and the labels [R] (for full KL)."""
    input_ids, lens, pred_pos, labels = pack(prompts, responses, device)
    return hidden_states(model, input_ids, lens)[pred_pos], labels
