"""Built-in agent loops: single_turn (one model turn, the default) and tool_agent (docs/agents.md).

Both build the trajectory from token ids only: the model's tokens exactly as sampled, and each
appended tool message tokenized once (minirl.agent.chat), so the trainer scores exactly the
tokens the policy produced.
"""

from __future__ import annotations

from collections import Counter

from minirl import hookimpl
from minirl.protocols import Trajectory


class SingleTurn:
    """One model turn over the prompt: what the batch generate() does, sample by sample."""

    def __init__(self, rollout_cfg):
        pass

    async def run(self, ctx, sample) -> Trajectory:
        out = await ctx.generate(sample, sample.prompt_ids, sample.params.max_new_tokens)
        n = len(out.token_ids)
        return Trajectory(sample.prompt_ids, out.token_ids, [1] * n, out.logprobs, out.finish_reason, 1)


class ToolAgent:
    """Model turn, tool calls, tool results, model turn, ... until a turn calls no tool.

    A turn that names tools (rollout.multi_turn.format) runs them (at most max_parallel_calls,
    concurrently) and appends their results as tool messages (mask 0); the next turn continues
    the same engine request, so only the new tokens are prefilled. It stops at a turn without
    calls, a turn cut by the budget or max_tokens_per_turn, max_assistant_turns or max_user_turns, or when the tool
    messages would not leave room for another turn (they are then not appended, as in verl).
    """

    def __init__(self, rollout_cfg):
        self.cfg = rollout_cfg.multi_turn

    async def run(self, ctx, sample) -> Trajectory:
        cfg, budget = self.cfg, sample.params.max_new_tokens
        t = Trajectory(list(sample.prompt_ids), logprobs=[], messages=list(sample.messages), num_turns=0)
        context, tools_run, stats = list(sample.prompt_ids), 0, Counter()
        while True:
            turn_budget = _turn_budget(cfg, budget - len(t.response_ids))
            out = await ctx.generate(sample, context, turn_budget, ctx.chat.stop_ids)
            _append(t, out.token_ids, 1, out.logprobs)
            context += out.token_ids
            t.num_turns, t.finish_reason = t.num_turns + 1, out.finish_reason
            content, calls = ctx.parse(ctx.chat.decode(out.token_ids))
            t.messages.append({"role": "assistant", "content": content, "tool_calls": [_call_dict(c) for c in calls]})
            if out.finish_reason != "stop" or not calls or _reached(cfg.max_assistant_turns, t.num_turns):
                break
            if _reached(cfg.max_user_turns, tools_run):
                break
            outcomes = await ctx.call_tools(sample, calls)
            _count(stats, outcomes)
            replies = [{"role": "tool", "name": o.name, "content": o.text} for o in outcomes]
            ids = ctx.chat.append_ids([{"role": "tool", "content": o.text} for o in outcomes], context[-1])
            t.messages += replies
            if len(t.response_ids) + len(ids) >= budget:  # no room left for the model to answer
                t.finish_reason = "length"
                break
            _append(t, ids, 0, None)
            context += ids
            tools_run += 1
        t.metrics = dict(stats)
        return t


def _turn_budget(cfg, left: int) -> int:
    """Tokens the next model turn may generate: what is left of the response budget, at most
    rollout.multi_turn.max_tokens_per_turn."""
    return left if cfg.max_tokens_per_turn is None else min(left, cfg.max_tokens_per_turn)


def _reached(limit: int | None, count: int) -> bool:
    return limit is not None and count >= limit


def _append(t: Trajectory, ids: list[int], mask: int, logprobs: list[float] | None) -> None:
    """Add tokens; tool tokens get log-prob 0.0 (never used: their mask is 0). An engine that
    returned no log-probs leaves the trajectory without any (None)."""
    t.response_ids += ids
    t.response_mask += [mask] * len(ids)
    if t.logprobs is None or (mask and logprobs is None):
        t.logprobs = None
    else:
        t.logprobs += list(logprobs) if mask else [0.0] * len(ids)


def _call_dict(call) -> dict:
    return {"name": call.name, "arguments": call.arguments, "error": call.error}


def _count(stats: Counter, outcomes) -> None:
    """Per-sample tool counts, summed into the step's agent/* metrics."""
    for o in outcomes:
        stats["tool_calls"] += 1
        stats[f"tool_{o.status}"] += 1
        stats["tool_latency_s"] += o.latency_s
        stats["tool_latency_max_s"] = max(stats["tool_latency_max_s"], o.latency_s)


@hookimpl
def minirl_agent_loops() -> dict:
    return {"single_turn": SingleTurn, "tool_agent": ToolAgent}
