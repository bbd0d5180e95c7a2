"""The fake's scheduler: a tiny transformers model in this process, in place of SGLang's
scheduler subprocess. It samples the way SGLang's sampler does and loads weights by Hugging Face
name, refusing what the real one refuses (or, for unknown names, what it would only log).

Sampling: temperature < 1e-6 is greedy (top_k = 1 and temperature 1, as SamplingParams.normalize
does); the returned log-prob is log_softmax(logits / temperature) of the sampled token, before
top-k / top-p renormalisation, as in SGLang's sampler. A request stops on a token in its
stop_token_ids or the model config's eos_token_id, unless ignore_eos, which disables both.

Radix cache: the fake prefills every prompt whole (same numbers), but keeps the token sequences
whose KV SGLang's radix cache would hold: a finished request's prompt and output minus its last
token (sampled, never fed). meta_info["cached_tokens"] is a prompt's longest prefix shared with
one of them, at most len(prompt) - 1 (SGLang always computes the last prompt position), as in
every version played. flush() forgets them: flush_cache, a weight update that flushes, releasing
the KV cache.
"""

from __future__ import annotations

import uuid

import torch
from sglang._profile import at_least

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
SAMPLING_KEYS = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "n": 1,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "no_stop_trim": False,
}
if at_least("0.5.5"):
    SAMPLING_KEYS["sampling_seed"] = None
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
DTYPES.update(float32=torch.float32, float=torch.float32)


class Scheduler:
    def __init__(self, args):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.model_path)
        archs = list(getattr(config, "architectures", None) or [])
        if not set(archs) & set(SUPPORTED):
            raise ValueError(f"Model architectures {archs} are not supported for now.")
        dtype = DTYPES[args.dtype] or getattr(config, "torch_dtype", None) or torch.float32
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        if args.load_format != "dummy":
            raise NotImplementedError("the fake loads dummy weights only (load_format='dummy')")
        with torch.no_grad():  # SGLang's DummyModelLoader: uniform(-1e-3, 1e-3)
            for p in self.model.parameters():
                p.uniform_(-1e-3, 1e-3)
        eos = config.eos_token_id
        self.eos_ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        self.vocab_size = config.vocab_size
        self.context_length = args.context_length or config.max_position_embeddings
        self.gen = torch.Generator().manual_seed(args.random_seed or 0)
        self.radix: set[tuple[int, ...]] = set()
        self.radix_enabled = not args.disable_radix_cache

    def flush(self) -> None:
        self.radix.clear()

    def cached_prefix(self, prompt: list[int]) -> int:
        best = max((_common_prefix(prompt, seq) for seq in self.radix), default=0)
        return min(best, len(prompt) - 1)

    # ------------------------------------------------------------------------ sampling params

    def normalize(self, sampling: dict) -> dict:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
        sp = {**SAMPLING_KEYS, **sampling}
        if 0 <= sp["temperature"] < 1e-6:
            sp["temperature"], sp["top_k"] = 1.0, 1
        if sp["top_k"] < 1 and sp["top_k"] != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}.")
        if sp["temperature"] < 0:
            raise ValueError(f"temperature must be non-negative, got {sp['temperature']}.")
        if not 0.0 < sp["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {sp['top_p']}.")
        if sp["max_new_tokens"] is not None and sp["max_new_tokens"] < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {sp['max_new_tokens']}.")
        if sp["n"] != 1:
            raise NotImplementedError("the fake serves n = 1 requests only (minirl repeats prompts itself)")
        return sp

    # ------------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sps: list[dict], return_logprob: bool) -> list[dict]:
        for p in prompts:
            if not p or max(p) >= self.vocab_size or min(p) < 0 or len(p) >= self.context_length:
                raise ValueError(f"invalid input_ids of length {len(p)} (vocab {self.vocab_size})")
        done = [None] * len(prompts)
        tokens = [[] for _ in prompts]
        logps = [[] for _ in prompts]
        steps = max(sp["max_new_tokens"] for sp in sps)
        logits_BV, cache, mask_BT = self._prefill(prompts)
        for _ in range(steps):
            next_B, logp_B = self._sample(logits_BV, sps)
            for i, (tok, lp) in enumerate(zip(next_B.tolist(), logp_B.tolist())):
                if done[i] is None:
                    tokens[i].append(tok)
                    logps[i].append(lp)
                    done[i] = self._finished(tok, len(tokens[i]), sps[i])
            if all(d is not None for d in done):
                break
            mask_BT = torch.cat([mask_BT, torch.ones_like(mask_BT[:, :1])], 1)
            out = self.model(
                input_ids=next_B[:, None],
                attention_mask=mask_BT,
                position_ids=mask_BT.sum(1, keepdim=True) - 1,
                past_key_values=cache,
                use_cache=True,
            )
            logits_BV, cache = out.logits[:, -1].float(), out.past_key_values
        cached = [self.cached_prefix(p) for p in prompts]
        if self.radix_enabled:
            self.radix.update(tuple(p + t[:-1]) for p, t in zip(prompts, tokens))
        rows = zip(prompts, tokens, logps, done, cached)
        return [self._output(p, t, lp, d, c, return_logprob) for p, t, lp, d, c in rows]

    def _prefill(self, prompts):
        width = max(len(p) for p in prompts)
        ids_BT = torch.zeros(len(prompts), width, dtype=torch.long)
        mask_BT = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids_BT[i, width - len(p) :] = torch.tensor(p)
            mask_BT[i, width - len(p) :] = 1
        pos_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, use_cache=True)
        return out.logits[:, -1].float(), out.past_key_values, mask_BT

    def _sample(self, logits_BV, sps):
        temp_B = torch.tensor([sp["temperature"] for sp in sps])[:, None]
        logp_BV = torch.log_softmax(logits_BV / temp_B, -1)
        probs_BV = logp_BV.exp()
        for i, sp in enumerate(sps):
            probs_BV[i] = _top_k_top_p(probs_BV[i], sp["top_k"], sp["top_p"])
        next_B = torch.multinomial(probs_BV, 1, generator=self.gen).squeeze(1)
        greedy_B = torch.tensor([sp["top_k"] == 1 for sp in sps])
        next_B = torch.where(greedy_B, logits_BV.argmax(-1), next_B)
        return next_B, logp_BV.gather(1, next_B[:, None]).squeeze(1)

    def _finished(self, tok: int, length: int, sp: dict):
        if not sp["ignore_eos"] and (tok in (sp["stop_token_ids"] or ()) or tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if length >= sp["max_new_tokens"]:
            return {"type": "length", "length": sp["max_new_tokens"]}
        return None

    @staticmethod
    def _output(prompt, tokens, logps, finish, cached, return_logprob) -> dict:
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "cached_tokens": cached,
        }
        if return_logprob:
            meta["input_token_logprobs"] = [(None, prompt[0], None)]
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(logps, tokens)]
        return {"output_ids": tokens, "meta_info": meta}

    # ------------------------------------------------------------------------ weights

    @torch.no_grad()
    def load_weights(self, named_tensors) -> tuple[bool, str]:
        """By Hugging Face name; a shape mismatch fails as the real weight_loader's assert would.
        The real Qwen2 loader only logs an unknown name and drops the tensor; the fake refuses it,
        so a naming bug cannot leave stale weights unnoticed."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if "rotary_emb.inv_freq" in name:
                continue
            if name not in params:
                return False, f"fake sglang: parameter {name} not found in params_dict"
            if tuple(tensor.shape) != tuple(params[name].shape):
                return False, f"fake sglang: {name} shape {tuple(tensor.shape)} != {tuple(params[name].shape)}"
            params[name].copy_(tensor)
        return True, "Success"


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _top_k_top_p(probs_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < probs_V.numel():
        kth = probs_V.topk(top_k).values[-1]
        probs_V = torch.where(probs_V < kth, torch.zeros_like(probs_V), probs_V)
    if top_p < 1.0:
        sorted_V, order_V = probs_V.sort(descending=True)
        keep_V = (sorted_V.cumsum(0) - sorted_V) < top_p * sorted_V.sum()
        probs_V = torch.zeros_like(probs_V).scatter(0, order_V, sorted_V * keep_V)
    return probs_V / probs_V.sum()
