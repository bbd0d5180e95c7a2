"""Tiny transformers models for the rollout engines' tests (random weights, no network).

The shapes are the tiny presets' (minirl/models/presets.py); the engine tests compare with
transformers' own forward and generate on them.
"""

from __future__ import annotations

import torch

from minirl.models.presets import preset_config
from minirl.protocols import EngineContext, SamplingParams

FAMILY_PRESETS = {"qwen2": "tiny", "qwen3": "qwen3-tiny", "llama": "llama3-tiny"}
PROMPTS = [[5, 17, 42], [7] * 16, list(range(100, 131)), [9, 8, 7, 6, 5, 4, 3]]


def tiny_config(family: str, **overrides):
    """The family's tiny preset config. Token ids up to 299 (the tests draw them so) and no eos id:
    transformers' generate would hold an eos back until min_new_tokens, which the engines under
    test (ignore_eos) do not."""
    return preset_config(FAMILY_PRESETS[family], **{"vocab_size": 300, "eos_token_id": None, **overrides})


def tiny_hf_model(config, seed: int = 0, std: float = 0.02, dtype=torch.float32, device="cpu"):
    """transformers' causal LM for the config with normal(0, std) weights (biases and norms too,
    so that every parameter matters in a comparison)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_((1.0 + noise) if "norm" in name else noise)
    return model.eval()


def engine_context(config, actor=None, device="cpu", dtype=torch.float32, eos=(), **extra) -> EngineContext:
    extra = {"max_model_len": 256, **extra}
    return EngineContext(config, actor, torch.device(device), dtype, tuple(eos), 0, extra=extra)


def greedy(n: int = 1, max_new: int = 12, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, exactly max_new tokens."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt], device=hf.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_greedy_agree_until_parted(got, want, atol: float) -> None:
    """Greedy continuations of two engines that round differently (completions with token_ids and
    logprobs): the same tokens until a near tie parts them, and log-probs within atol up to and
    at the parting step, where each took its own argmax, so both tokens were at the top. A
    broken kernel parts early and far."""
    for g, w in zip(got, want, strict=True):
        same = (a == b for a, b in zip(g.token_ids, w.token_ids, strict=True))
        parted = next((i for i, equal in enumerate(same) if not equal), len(w.token_ids))
        upto = slice(0, parted + 1)
        torch.testing.assert_close(torch.tensor(g.logprobs[upto]), torch.tensor(w.logprobs[upto]), atol=atol, rtol=0)
