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
    concurrently) and appends their results as tool messages (mask 0), in call order; the next
    turn continues the same engine request, so only the new tokens are prefilled. It stops at a
    turn without calls, a turn cut by the budget or max_tokens_per_turn, max_assistant_turns or
    max_user_turns, or when the tool messages would not leave room for another turn (they are
    then not appended, as in verl).
    """

    def __init__(self, rollout_cfg):
        self.cfg = rollout_cfg.multi_turn

    async def run(self, ctx, sample) -> Trajectory:
        cfg, budget = self.cfg, sample.params.max_new_tokens
        t = Trajectory(list(sample.prompt_ids), logprobs=[], messages=list(sample.messages), assistant_turns=0)
        context, stats = list(sample.prompt_ids), Counter()
        thinking = ctx.chat.opens_thought(context)  # R1-Distill's generation prompt opens <think>
        while True:
            turn = await self._model_turn(ctx, sample, context, budget - len(t.response_ids), thinking)
            _append(t, turn.token_ids, 1, turn.logprobs)
            context += turn.token_ids
            t.assistant_turns, t.finish_reason = t.assistant_turns + 1, turn.finish_reason
            t.messages.append({"role": "assistant", "content": turn.content, "tool_calls": turn.call_dicts()})
            if turn.finish_reason != "stop" or not turn.calls or _reached(cfg.max_assistant_turns, t.assistant_turns):
                break
            if _reached(cfg.max_user_turns, t.user_turns):
                break
            outcomes = await ctx.call_tools(sample, turn.calls, t.messages)
            _count(stats, outcomes)
            ids = ctx.chat.append_ids([{"role": "tool", "content": o.text} for o in outcomes], context[-1])
            t.messages += [_tool_message(o) for o in outcomes]
            if len(t.response_ids) + len(ids) >= budget:  # no room left for the model to answer
                t.finish_reason = "length"
                break
            _append(t, ids, 0, None)
            context += ids
            t.user_turns += 1
            thinking = ctx.chat.opens_thought(ids)
        t.metrics = dict(stats)
        return t

    async def _model_turn(self, ctx, sample, context: list[int], left: int, thinking: bool) -> "_Turn":
        """One model turn. The engine stops at a token that closes a call (Qwen2.5's </tool_call>);
        the turn goes on from there until it holds max_parallel_calls complete calls (outside
        thinking), ends by itself (its end-of-turn token), or reaches its token limit."""
        cap, turn = _turn_budget(self.cfg, left), _Turn()
        while True:
            out = await ctx.generate(sample, context + turn.token_ids, cap - len(turn.token_ids), ctx.chat.stop_ids)
            turn.add(out)
            turn.content, turn.calls = ctx.parse(ctx.chat.decode(turn.token_ids), thinking=thinking)
            at_close = out.finish_reason == "stop" and out.token_ids and out.token_ids[-1] in ctx.chat.stop_ids
            complete = sum(call.closed for call in turn.calls)
            if not at_close or complete >= self.cfg.max_parallel_calls or len(turn.token_ids) >= cap:
                return turn


class _Turn:
    """A model turn, possibly sampled in pieces (each piece stopped at a closing tag)."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = []
        self.finish_reason, self.content, self.calls = "length", "", []

    def add(self, out) -> None:
        self.token_ids += out.token_ids
        both = self.logprobs is not None and out.logprobs is not None
        self.logprobs = self.logprobs + list(out.logprobs) if both else None
        self.finish_reason = out.finish_reason

    def call_dicts(self) -> list[dict]:
        return [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in self.calls]


def _tool_message(outcome) -> dict:
    """A tool result as the trajectory's messages keep it; `reward`: a verl tool's step reward."""
    message = {"role": "tool", "name": outcome.name, "content": outcome.text}
    if outcome.reward is not None:
        message["reward"] = outcome.reward
    return message


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
