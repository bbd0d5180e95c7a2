"""A test plugin (config: plugins.modules, rollout.agent.default_agent_loop=asks_lookup): an agent
loop that always calls the lookup tool between two one-token turns, so that a job on a
random-weight model calls tools from its first step."""

from minirl import hookimpl
from minirl.agent.parser import ToolCall
from minirl.protocols import Trajectory


class AsksLookup:
    def __init__(self, cfg):
        pass

    async def run(self, ctx, sample):
        t = Trajectory(list(sample.prompt_ids), assistant_turns=2, user_turns=1)
        out = await ctx.generate(sample, sample.prompt_ids, 1)
        (outcome,) = await ctx.call_tools(sample, [ToolCall("lookup", {"key": "k1"}, "")])
        tool_ids = ctx.chat.append_ids([{"role": "tool", "content": outcome.text}], out.token_ids[-1])
        again = await ctx.generate(sample, sample.prompt_ids + out.token_ids + tool_ids, 1)
        t.response_ids = out.token_ids + tool_ids + again.token_ids
        t.response_mask = [1] * len(out.token_ids) + [0] * len(tool_ids) + [1] * len(again.token_ids)
        t.logprobs = out.logprobs + [0.0] * len(tool_ids) + again.logprobs
        t.messages = [{"role": "tool", "content": outcome.text}]
        t.metrics = {"tool_calls": 1, f"tool_{outcome.status}": 1}
        return t


@hookimpl
def minirl_agent_loops():
    return {"asks_lookup": AsksLookup}
