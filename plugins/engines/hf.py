"""Rollout engine `hf`: transformers' `generate`, the slow but universal reference engine.

It keeps its own copy of the policy (in the rollout dtype), so weight sync is an in-place copy
by parameter name, exactly like the native engine. It implements the batch level only: agent
loops drive it through minirl.agent.server.GenerateOnly (a continuation prefills its whole
conversation again; no KV is kept between turns).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from minirl import hookimpl
from minirl.models.assembly import plain_copy
from minirl.protocols import Completion, EngineContext, SamplingParams


class HFEngine:
    """Batched `model.generate` over left-padded prompts."""

    def __init__(self, rollout_cfg, ctx: EngineContext):
        if ctx.actor is None:
            raise ValueError("rollout.name = 'hf' needs the actor module to copy")
        # adapters merged (the trainer sends merged weights), eager layers and Hugging Face's MLP
        self.model = plain_copy(ctx.actor, ctx.device, ctx.dtype).requires_grad_(False)
        # generate() pads; the packed-sequence attention is for training forwards.
        self.model.set_attn_implementation("sdpa")
        self.device = ctx.device
        self.eos = ctx.eos_token_ids
        self.pad = ctx.pad_token_id
        self.batch_size = rollout_cfg.max_num_seqs
        self.params = dict(self.model.named_parameters())
        self.progress = bool(ctx.extra.get("progress", False))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        per_call = max(1, self.batch_size // params.n)
        out: list[Completion] = []
        starts = range(0, len(prompts), per_call)
        for start in tqdm(starts, desc="generate", leave=False, disable=not self.progress or len(starts) < 2):
            out += self._generate_chunk(prompts[start : start + per_call], params)
        return out

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        ids_BP, attn_BP = left_pad(prompts, self.pad, self.device)
        greedy = params.temperature == 0
        gen = self.model.generate(
            input_ids=ids_BP,
            attention_mask=attn_BP,
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_k=params.top_k if params.top_k > 0 else None,
            top_p=params.top_p if not greedy else None,
            num_return_sequences=params.n,
            eos_token_id=None if params.ignore_eos else list(self.eos) + list(params.stop_token_ids),
            pad_token_id=self.pad,
            output_logits=True,
            return_dict_in_generate=True,
            min_new_tokens=params.max_new_tokens if params.ignore_eos else None,
        )
        new_BT = gen.sequences[:, ids_BP.shape[1] :]
        logits_BTV = torch.stack(gen.logits, dim=1).float()
        if not greedy:
            logits_BTV = logits_BTV / params.temperature
        logp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, new_BT.unsqueeze(-1)).squeeze(-1)
        stops = set() if params.ignore_eos else set(self.eos) | set(params.stop_token_ids)
        # one device-to-host copy per tensor, not one per row
        return [cut_at_stop(t, lp, stops) for t, lp in zip(new_BT.tolist(), logp_BT.tolist())]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name in self.params:
                self.params[name].data.copy_(tensor)

    def release_memory(self) -> None:
        """generate() allocates its KV cache per call, so there is nothing held between calls."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        pass


def left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids_BP and attention_mask_BP, padded on the left as generate() expects."""
    rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad, padding_side="left")
    attn = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
    return ids.to(device), attn.to(device)


def cut_at_stop(tokens: list[int], logprobs: list[float], stops: set[int]) -> Completion:
    """Keep tokens up to and including the first stop token; generate() pads after it."""
    for i, tok in enumerate(tokens):
        if tok in stops:
            return Completion(tokens[: i + 1], logprobs[: i + 1], "stop")
    return Completion(tokens, logprobs, "length")


@hookimpl
def minirl_rollout_engines():
    return {"hf": HFEngine}
