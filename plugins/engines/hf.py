"""Rollout engine `hf`: transformers' `generate`, the slow but universal reference engine.

It keeps its own copy of the policy (in the rollout dtype), so weight sync is an in-place copy
by parameter name, exactly like the native engine. Its request level is the simplest one: step()
runs one `generate` over the queued requests (as many as one batch takes) and finishes them all;
a continuation prefills its whole conversation again (no KV is kept between turns).
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
from torch.nn.utils.rnn import pad_sequence

from minirl import hookimpl
from minirl.models.compile import uncompile_layers
from minirl.models.fused_mlp import unfuse_mlps
from minirl.protocols import Completion, EngineContext, SamplingParams, TurnOutput, generate_batch, sample_ids


class HFEngine:
    """Batched `model.generate` over left-padded prompts."""

    def __init__(self, rollout_cfg, ctx: EngineContext):
        if ctx.actor is None:
            raise ValueError("rollout.name = 'hf' needs the actor module to copy")
        self.model = copy.deepcopy(ctx.actor).to(device=ctx.device, dtype=ctx.dtype).eval()
        uncompile_layers(self.model)  # generate's KV-cache forwards run eagerly (model.compile_layers)
        unfuse_mlps(self.model)  # and with Hugging Face's MLP (model.fused_mlp)
        self.model.requires_grad_(False)
        # generate() pads; the packed-sequence attention is for training forwards.
        self.model.set_attn_implementation("sdpa")
        self.device = ctx.device
        self.eos = ctx.eos_token_ids
        self.pad = ctx.pad_token_id
        self.batch_size = rollout_cfg.max_num_seqs
        self.params = dict(self.model.named_parameters())

        self.queue: list[tuple[str, list[int], SamplingParams]] = []  # submitted, not yet generated
        self.held: dict[str, list[int]] = {}  # sample id -> its conversation after its last turn
        self.aborted: list[TurnOutput] = []
        self.paused = False

    # ---------------------------------------------------------------------------- request level

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if any(request_id == queued for queued, _, _ in self.queue):
            raise ValueError(f"hf engine: request {request_id!r} is still running; wait for its turn to finish")
        if request_id in self.held:
            context = self.held[request_id]
            if params.n != 1 or prompt_ids[: len(context)] != context:
                raise ValueError(
                    f"hf engine: continuing request {request_id!r} needs n = 1 and prompt_ids that start "
                    f"with its {len(context)} tokens so far"
                )
        elif any(sid in self.held for sid in sample_ids(request_id, params.n)):
            raise ValueError(f"hf engine: request id {request_id!r} is held; release it or use a new id")
        if self.queue:
            first = self.queue[0][2]
            if (first.temperature, first.top_k, first.top_p) != (params.temperature, params.top_k, params.top_p):
                raise ValueError("hf engine: requests in flight sample at other temperature/top_k/top_p settings")
        elif params.seed is not None:  # a busy period starts: seeded as generate() always was
            torch.manual_seed(params.seed)
        self.queue.append((request_id, list(prompt_ids), params))

    @torch.no_grad()
    def step(self) -> list[TurnOutput]:
        """One generate over the leading queued requests with the first one's parameters."""
        if self.paused:
            raise RuntimeError("hf engine: step() while paused; call continue_generation() first")
        out, self.aborted = self.aborted, []
        if not self.queue:
            return out
        params = self.queue[0][2]
        per_call = max(1, self.batch_size // params.n)
        taken = []
        while self.queue and len(taken) < per_call and self.queue[0][2] == params:
            taken.append(self.queue.pop(0))
        completions = self._generate_chunk([prompt for _, prompt, _ in taken], params)
        for i, (request_id, prompt, _) in enumerate(taken):
            for sid, c in zip(sample_ids(request_id, params.n), completions[i * params.n : (i + 1) * params.n]):
                self.held[sid] = prompt + c.token_ids
                out.append(TurnOutput(sid, c.token_ids, c.logprobs, c.finish_reason))
        return out

    def has_work(self) -> bool:
        return bool(self.queue or self.aborted)

    def abort(self, request_id: str) -> None:
        for i, (queued, _, params) in enumerate(self.queue):
            if queued == request_id:
                del self.queue[i]
                self.aborted += [TurnOutput(sid, [], [], "abort") for sid in sample_ids(queued, params.n)]
                return

    def release(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def pause_generation(self) -> None:
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    # ---------------------------------------------------------------------------- batch level

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_batch(self, prompts, params)

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
