"""Running agent loops: one per sample, all at once, over the engine's request level.

AgentRollout is built once per run. run() takes a step's samples (the n samples of each prompt
one after another), starts the agent loop each row names (agent_name, else
rollout.agent.default_agent_loop) on one event loop, and returns one checked Trajectory per
sample, in order. The built-in loops are plugins (minirl_plugins.agents); docs/agents.md says
how to write one.
"""

from __future__ import annotations

import asyncio
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from minirl.agent.chat import ChatTokens
from minirl.agent.parser import PARSERS, ToolCall
from minirl.agent.server import EngineServer, ToolTime, request_level
from minirl.agent.tools import ToolOutcome, ToolSet
from minirl.agent.verl_tools import AgentData
from minirl.errors import UserError
from minirl.protocols import RolloutEngine, SamplingParams, Trajectory, TurnOutput


@dataclass
class Sample:
    """One sample as its agent loop sees it: the row, and how to sample its turns.

    params.max_new_tokens is the whole response budget (data.max_response_length): model and
    tool tokens together, as verl counts rollout.response_length.
    """

    request_id: str  # the engine's id for this sample's sequence, "<group uid>/<k>"
    prompt_ids: list[int]
    params: SamplingParams
    messages: list[dict] = field(default_factory=list)
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict = field(default_factory=dict)
    source: str = ""  # file:row, for messages
    state: dict = field(default_factory=dict)  # kept across the sample's tool calls (verl's agent_data.extra_fields)

    @property
    def tools_kwargs(self) -> dict:
        """The row's per-tool arguments, extra_info.tools_kwargs (verl's layout)."""
        return dict(self.extra_info.get("tools_kwargs") or {})


class AgentContext:
    """What an agent loop may use: the engine, the tools, the chat template, the settings."""

    def __init__(self, server: EngineServer, chat: ChatTokens, tools: ToolSet, multi_turn_cfg: Any):
        self.server, self.chat, self.tools, self.cfg = server, chat, tools, multi_turn_cfg
        self.parse = PARSERS[multi_turn_cfg.format]

    async def generate(
        self, sample: Sample, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()
    ) -> TurnOutput:
        """One model turn of this sample: prompt_ids is its whole conversation so far (the engine
        keeps the KV of the earlier turns and prefills only what was appended). The turn gets at
        most what is left of the response budget."""
        used, budget = len(prompt_ids) - len(sample.prompt_ids), sample.params.max_new_tokens
        if used >= budget:
            raise UserError(
                f"{sample.source}: the conversation holds {used} response tokens, the whole budget "
                f"(data.max_response_length = {budget}); the agent loop must stop before asking for another turn"
            )
        stops = tuple(sample.params.stop_token_ids) + tuple(stop_token_ids)
        params = replace(sample.params, max_new_tokens=min(max_new_tokens, budget - used), stop_token_ids=stops)
        return await self.server.generate(sample.request_id, prompt_ids, params)

    async def call_tools(
        self, sample: Sample, calls: list[ToolCall], messages: list[dict] | None = None
    ) -> list[ToolOutcome]:
        """Run the calls (concurrently, each under its timeout; the outcomes in call order); the
        engine decodes meanwhile. messages: the conversation so far, for verl tools' agent_data."""
        agent_data = AgentData(sample.request_id, sample.tools_kwargs, messages or [], sample.state)
        return await self.server.idle(self.tools.call_all(calls, sample.tools_kwargs, agent_data))


class AgentRollout:
    """The agent loops and tools of one run, and the event loop they run on."""

    def __init__(
        self,
        rollout_cfg: Any,
        loops_registry: Any,
        tools_registry: Any,
        tokenizer: Any,
        template: str = "the tokenizer",
    ):
        """template: where the tokenizer's chat template comes from, for messages (model.path = ...)."""
        self.cfg = rollout_cfg
        self.registry = loops_registry
        self.loops: dict[str, Any] = {}  # name -> the loop, built on first use
        mt = rollout_cfg.multi_turn
        self.tools = ToolSet.from_config(mt, tools_registry) if mt.enable else ToolSet()
        self.chat = ChatTokens(tokenizer, template=template)
        if self.tools.names:
            self._check_template()
        self.event_loop = asyncio.new_event_loop()
        self.last_steps = 0  # engine steps of the last run
        self.last_tool_time = ToolTime()  # the last run's tool seconds, and the engine's idle ones among them

    def _check_template(self) -> None:
        """Tools are configured: the template must render their answers, and should show them."""
        self.chat.check_tool_turns()
        if not self.chat.shows_tools(self.tools.schemas):
            warnings.warn(
                f"{self.chat.template}: its chat template does not show the tool list (apply_chat_template "
                f"ignores tools=), so the model learns of {', '.join(self.tools.names)} only if the prompt "
                "describes them",
                stacklevel=2,
            )

    def tool_schemas(self, agent_name: str) -> list[dict] | None:
        """The tool schemas a row's prompt shows: all configured tools, for multi-turn rows."""
        if not self.cfg.multi_turn.enable or self.loop_name(agent_name) == "single_turn":
            return None
        return self.tools.schemas or None

    def loop_name(self, agent_name: str) -> str:
        return agent_name or self.cfg.agent.default_agent_loop

    def check_rows(self, records: list) -> None:
        """Every row's loop is registered: a typo fails at start-up, naming the first such row."""
        for rec in records:
            self._loop(rec.agent_name, rec)

    def run(self, engine: RolloutEngine, samples: list[Sample], agent_names: list[str]) -> list[Trajectory]:
        """One trajectory per sample, in order; every request is released when it returns."""
        loops = [self._loop(name, sample) for name, sample in zip(agent_names, samples)]
        return self.event_loop.run_until_complete(self._run_all(request_level(engine), loops, samples))

    def close(self) -> None:
        self.tools.close()
        self.event_loop.close()

    def _loop(self, agent_name: str, sample: Any) -> tuple[str, Any]:
        name = self.loop_name(agent_name)
        if name not in self.loops:
            if name not in self.registry:
                where = f"{sample.source}: agent_name" if agent_name else "rollout.agent.default_agent_loop"
                rule, fix = self.registry.unknown_rule_fix(name)
                raise UserError(f"{where} = {name!r}: {rule}; {fix}")
            self.loops[name] = self.registry.get(name)(self.cfg)
        return name, self.loops[name]

    async def _run_all(self, engine: RolloutEngine, loops, samples: list[Sample]) -> list[Trajectory]:
        server = EngineServer(engine, 0, ordered=self.cfg.multi_turn.deterministic)
        serving = asyncio.ensure_future(server.serve())
        try:
            return await self._run_loops(server, loops, samples)
        except BaseException:
            server.abort_all()
            raise
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            self.last_steps, self.last_tool_time = server.steps, server.tools

    async def run_batch(self, server: EngineServer, samples: list[Sample], agent_names: list[str]):
        """One batch's trajectories on a server that the caller runs and shares between batches
        (asynchronous training)."""
        loops = [self._loop(name, sample) for name, sample in zip(agent_names, samples)]
        try:
            return await self._run_loops(server, loops, samples)
        except BaseException:
            for s in samples:
                server.engine.abort(s.request_id)
            raise

    async def _run_loops(self, server: EngineServer, loops, samples: list[Sample]) -> list[Trajectory]:
        server.busy += len(samples)
        server.wake.set()
        ctx = AgentContext(server, self.chat, self.tools, self.cfg.multi_turn)
        tasks = [asyncio.ensure_future(self._one(server, ctx, loop, s)) for loop, s in zip(loops, samples)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            for s in samples:
                server.engine.release(s.request_id)

    async def _one(self, server: EngineServer, ctx: AgentContext, loop: tuple[str, Any], sample: Sample) -> Trajectory:
        name, agent = loop
        try:
            trajectory = await agent.run(ctx, sample)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"agent loop {name!r} failed on {sample.source} ({type(exc).__name__}: {exc})") from exc
        finally:
            server.loop_finished()
        return checked(trajectory, sample, name)


def checked(t: Trajectory, sample: Sample, loop: str) -> Trajectory:
    """A loop's trajectory, made safe for the batch: consistent lengths, a 0/1 mask, and at
    most the response budget (longer ones are cut, finish_reason "length")."""
    if not isinstance(t, Trajectory):
        raise UserError(
            f"agent loop {loop!r} returned {type(t).__name__} for {sample.source}; it must return a Trajectory"
        )
    n = len(t.response_ids)
    if len(t.response_mask) != n or (t.logprobs is not None and len(t.logprobs) != n):
        raise UserError(
            f"agent loop {loop!r} on {sample.source}: {n} response ids but {len(t.response_mask)} mask values "
            f"and {len(t.logprobs or [])} log-probs; give one of each per response token (log-probs may be None)"
        )
    if any(m not in (0, 1) for m in t.response_mask):
        raise UserError(f"agent loop {loop!r} on {sample.source}: response_mask must hold only 0 and 1")
    if not t.prompt_ids:
        raise UserError(f"agent loop {loop!r} on {sample.source}: the trajectory has an empty prompt")
    budget = sample.params.max_new_tokens
    if n > budget:
        t = replace(
            t,
            response_ids=t.response_ids[:budget],
            response_mask=t.response_mask[:budget],
            logprobs=None if t.logprobs is None else t.logprobs[:budget],
            finish_reason="length",
        )
    return t


def to_samples(records: list, uids: list[int], params: SamplingParams, prefix: str = "") -> list[Sample]:
    """One Sample per expanded record (the n samples of a group adjacent, as expand_groups lays
    them out); the request id "<prefix><uid>/<k>" names sample k of group uid, so that the engine
    prefills a group's prompt once (minirl.protocols.sample_ids)."""
    samples, k = [], 0
    for i, (rec, uid) in enumerate(zip(records, uids)):
        k = k + 1 if i and uids[i - 1] == uid else 0
        samples.append(
            Sample(
                f"{prefix}{uid}/{k}",
                rec.prompt_ids,
                params,
                rec.messages,
                rec.data_source,
                rec.ground_truth,
                rec.extra_info,
                rec.source,
            )
        )
    return samples
