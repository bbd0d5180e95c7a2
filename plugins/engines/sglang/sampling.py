"""Our SamplingParams to SGLang's sampling_params dict, and SGLang's outputs to TurnOutputs.

The translation (docs/plugins.md has the rules; the whys are here):
- temperature 0: SGLang makes temperature < 1e-6 top_k = 1 and returns log_softmax of the raw
  logits, our greedy log-probs. top_k <= 0 goes as -1, the whole vocabulary in every version.
- Stopping: the engine's config has no eos_token_id (engine.py), so SGLang stops only on the
  stop_token_ids sent. Its own ignore_eos would drop those too, so it is always False.
- n samples: each sample id is its own request of n = 1 with the prompt (SGLang's n > 1 warms up
  a prefix first and warns above 128 prompts; the radix cache shares the prefix anyway).
- One Engine.generate call per step takes a list of per-request dicts (every supported version
  does); when they are all equal one dict goes, so generate() of one SamplingParams makes the
  same call it always made (one dict, each prompt n times in a row).
- cached_tokens: SGLang's meta_info counts every prompt token its radix cache matched, from any
  earlier request; the protocol counts only the request's own earlier turns, so a first turn
  reports 0 and a continuation at most its held context.
- params.seed is not sent: SGLang honours a per-request seed only under deterministic inference,
  where the n copies of a prompt would sample the same tokens.
"""

from __future__ import annotations

from minirl.protocols import SamplingParams, TurnOutput

FINISH_REASONS = {"stop": "stop", "length": "length"}


def sampling_dict(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> dict:
    """The sampling_params of one request."""
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "stop_token_ids": sorted(stop),
        "ignore_eos": False,
    }


def shared_or_list(dicts: list[dict]) -> dict | list[dict]:
    """Engine.generate's sampling_params: one dict when every request has the same, else the list."""
    return dicts[0] if all(d == dicts[0] for d in dicts) else dicts


def to_turn(output: dict, sample_id: str, held_len: int) -> TurnOutput:
    """One SGLang output dict -> TurnOutput (ids incl. the stop token, log-probs, finish reason)."""
    meta = output["meta_info"]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in FINISH_REASONS:
        raise RuntimeError(f"sglang request {sample_id!r} did not finish normally: finish_reason = {reason!r}")
    token_ids = [int(t) for t in output["output_ids"]]
    logprobs = [float(lp) for lp, _tok, *_ in meta["output_token_logprobs"]]
    logprob_ids = [int(tok) for _lp, tok, *_ in meta["output_token_logprobs"]]
    if logprob_ids != token_ids:
        raise RuntimeError(
            f"sglang request {sample_id!r}: output_token_logprobs name tokens {logprob_ids[:8]}... but output_ids "
            f"are {token_ids[:8]}...; the log-probs would not belong to the tokens"
        )
    cached = min(int(meta.get("cached_tokens") or 0), held_len)
    return TurnOutput(sample_id, token_ids, logprobs, FINISH_REASONS[kind], cached)


def aborted_turn(sample_id: str) -> TurnOutput:
    """The turn of a request aborted before its step: no tokens were sampled."""
    return TurnOutput(sample_id, [], [], "abort")
