"""Agent loops over the request-level engine: token ids in, token ids out.

single_turn through the agent path samples exactly the batch generate()'s tokens; tool_agent
builds its trajectory from the engine's tokens and each tool message tokenized once (the whole
conversation re-rendered by the chat template gives the same ids, the turn separator included);
limits, malformed calls and failing tools end up in the trajectory and its metrics, never in a
crash; a slow tool never stalls the other samples' decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.agent import server as server_mod
from minirl.agent.chat import ChatTokens
from minirl.agent.loop import AgentRollout, checked, to_samples
from minirl.config.schema import MultiTurnConfig, RolloutConfig
from minirl.data.prompts import PromptRecord
from minirl.errors import UserError
from minirl.models.tokenizers import byte_tokenizer
from minirl.plugins import PluginManager
from minirl.protocols import SamplingParams, Trajectory, TurnOutput
from minirl.reward.trajectory import final_turn_ids, reward_view
from minirl_plugins.engines.native import build_native_engine
from tests.tiny_models import PROMPTS, engine_context, tiny_config, tiny_hf_model

TOK = byte_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")


def ids(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


class ScriptedEngine:
    """A request-level engine whose model says what a script says: script(request_id, turn,
    prompt_ids) -> the turn's token ids. Every submitted prompt is recorded."""

    def __init__(self, script, delay_s: float = 0.0):
        self.script, self.delay_s = script, delay_s
        self.queue: list[tuple[str, list[int], SamplingParams]] = []
        self.turns: dict[str, int] = {}
        self.prompts: dict[str, list[list[int]]] = {}
        self.released: set[str] = set()
        self.step_times: list[float] = []
        self.batches: list[list[str]] = []  # the request ids of every step, in queue order

    def submit(self, request_id, prompt_ids, params):
        self.queue.append((request_id, list(prompt_ids), params))
        self.prompts.setdefault(request_id, []).append(list(prompt_ids))

    def step(self):
        time.sleep(self.delay_s)
        self.step_times.append(time.monotonic())
        self.batches.append([request_id for request_id, _, _ in self.queue])
        out = []
        for request_id, prompt, params in self.queue:
            turn = self.turns.get(request_id, 0)
            self.turns[request_id] = turn + 1
            tokens = self.script(request_id, turn, prompt)[: params.max_new_tokens]
            stopped = bool(tokens) and tokens[-1] == IM_END
            lps = [-0.5] * len(tokens)
            out.append(TurnOutput(request_id, tokens, lps, "stop" if stopped else "length"))
        self.queue = []
        return out

    def has_work(self):
        return bool(self.queue)

    def abort(self, request_id):
        pass

    def release(self, request_id):
        self.released.add(request_id)


def rollout(tool_config: str = "", **multi_turn) -> AgentRollout:
    mt = MultiTurnConfig(enable=True, tool_config_path=tool_config, **multi_turn)
    cfg = RolloutConfig(multi_turn=mt)
    pm = PluginManager()
    return AgentRollout(cfg, pm["agent_loops"], pm["tools"], TOK)


def records(n: int, agent: str = "tool_agent") -> list[PromptRecord]:
    messages = [{"role": "user", "content": "what is 6*7?"}]
    prompt = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [PromptRecord(ids(prompt), "calc", "42", {}, f"data.parquet:{i}", i, "", agent, messages) for i in range(n)]


@pytest.fixture
def calc_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n    config: {type: native, timeout_s: 5}\n")
    return str(path)


def call(name: str, arguments: str) -> list[int]:
    return ids(f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>') + [IM_END]


def params(budget: int = 400) -> SamplingParams:
    return SamplingParams(n=1, temperature=1.0, max_new_tokens=budget)


def run(agents: AgentRollout, engine, recs, budget: int = 1000) -> list[Trajectory]:
    samples = to_samples(recs, list(range(len(recs))), params(budget))
    return agents.run(engine, samples, [r.agent_name for r in recs])


def test_tool_agent_trajectory_is_the_engine_tokens_plus_tool_messages(calc_config):
    script = lambda rid, turn, prompt: (
        call("calculator", '{"expression": "6*7"}') if turn == 0 else ids("42") + [IM_END]
    )
    engine = ScriptedEngine(script)
    [t] = run(rollout(calc_config), engine, records(1))
    first, second = engine.prompts["0/0"]
    turn1 = call("calculator", '{"expression": "6*7"}')
    tool_ids = second[len(first) + len(turn1) :]
    assert second[: len(first)] == first and second[len(first) : len(first) + len(turn1)] == turn1
    assert t.response_ids == turn1 + tool_ids + ids("42") + [IM_END]
    assert t.response_mask == [1] * len(turn1) + [0] * len(tool_ids) + [1] * 3
    assert t.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool_ids) + [-0.5] * 3
    assert TOK.decode(tool_ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert t.assistant_turns == 2 and t.finish_reason == "stop"
    assert t.metrics["tool_calls"] == 1 and t.metrics["tool_ok"] == 1
    assert TOK.decode(final_turn_ids(t)) == "42<|im_end|>"
    assert engine.released == {"0/0"}


def test_token_ids_are_never_re_tokenized(calc_config):
    """A turn whose bytes are not valid UTF-8 decodes to U+FFFD; re-encoding its text would give
    other ids. The trajectory keeps the sampled ids, and the whole conversation rendered by the
    template equals prompt + response (the separator after <|im_end|> included)."""
    odd = [0xC3, 0x28, 0xFF]  # invalid UTF-8
    script = lambda rid, turn, prompt: (
        (odd + call("calculator", '{"expression": "1+1"}')) if turn == 0 else odd + [IM_END]
    )
    [t] = run(rollout(calc_config), ScriptedEngine(script), records(1))
    assert t.response_ids[:3] == odd and t.response_ids[-4:] == odd + [IM_END]
    assert ids(TOK.decode(odd)) != odd
    text = TOK.decode(t.prompt_ids + t.response_ids)
    rendered = TOK.apply_chat_template(
        [
            *records(1)[0].messages,
            {"role": "assistant", "content": TOK.decode(t.response_ids[: t.response_mask.index(0) - 1])},
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": TOK.decode(odd)},
        ],
        tokenize=False,
    )
    assert text == rendered.rstrip("\n")


def test_malformed_and_unknown_calls_become_tool_messages_and_metrics(calc_config):
    bad = ids('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>') + [IM_END]
    turns = [bad, call("weather", "{}"), call("calculator", '{"expression": "1/0"}'), ids("done") + [IM_END]]
    [t] = run(rollout(calc_config), ScriptedEngine(lambda rid, turn, prompt: turns[turn]), records(1), budget=2000)
    tool_texts = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert len(tool_texts) == 3 and t.assistant_turns == 4
    assert "json" in tool_texts[0].lower() and "weather" in tool_texts[1] and "calculator" in tool_texts[1]
    assert "zero" in tool_texts[2].lower() or "error" in tool_texts[2].lower()
    assert t.metrics["tool_calls"] == 3
    assert t.metrics.get("tool_bad_call", 0) == 1 and t.metrics.get("tool_unknown_tool", 0) == 1
    assert t.metrics.get("tool_error", 0) == 1


@pytest.mark.parametrize(
    "limits, turns",
    [({"max_assistant_turns": 2}, 2), ({"max_user_turns": 1}, 2), ({}, 5)],
)
def test_turn_limits(calc_config, limits, turns):
    script = lambda rid, turn, prompt: call("calculator", '{"expression": "1"}') if turn < 4 else ids("1") + [IM_END]
    [t] = run(rollout(calc_config, **limits), ScriptedEngine(script), records(1))
    assert t.assistant_turns == turns
    assert t.response_mask[-1] == 1  # a trajectory ends with the model's tokens


def test_max_tokens_per_turn_caps_each_turn_and_a_cut_turn_ends_the_trajectory(calc_config):
    """Each turn asks the engine for at most max_tokens_per_turn tokens (never more than the budget
    leaves); a call turn that fits runs its tool, and the answer turn cut by the cap ends the sample
    with finish_reason "length"."""
    turn1 = call("calculator", '{"expression": "6*7"}')
    script = lambda rid, turn, prompt: turn1 if turn == 0 else ids("forty-two " * 20) + [IM_END]
    asked = []
    engine = ScriptedEngine(script)
    submit = engine.submit
    engine.submit = lambda rid, prompt, params: (asked.append(params.max_new_tokens), submit(rid, prompt, params))
    [t] = run(rollout(calc_config, max_tokens_per_turn=len(turn1)), engine, records(1))
    assert asked[0] == len(turn1) and asked[1] == len(turn1)
    assert t.assistant_turns == 2 and t.finish_reason == "length"
    assert t.response_ids[-len(turn1) :] == ids("forty-two " * 20)[: len(turn1)]
    [uncapped] = run(rollout(calc_config), ScriptedEngine(script), records(1))
    assert uncapped.finish_reason == "stop" and uncapped.response_ids[-1] == IM_END


def test_tool_message_that_leaves_no_room_is_not_appended(calc_config):
    turn1 = call("calculator", '{"expression": "1"}')
    script = lambda rid, turn, prompt: turn1 if turn == 0 else ids("x") + [IM_END]
    [t] = run(rollout(calc_config), ScriptedEngine(script), records(1), budget=len(turn1) + 5)
    assert t.response_ids == turn1 and t.finish_reason == "length" and t.assistant_turns == 1


def test_a_slow_tool_does_not_stall_the_other_samples(tmp_path):
    """Sample 0 calls a tool that sleeps 1.5 s in a thread; sample 1 runs 6 plain turns meanwhile.
    Its turns finish before sample 0's tool returns: the engine kept stepping."""
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: tests.unit.test_agent_loop.Sleeper\n    config: {type: native}\n"
        "    tool_schema: {type: function, function: {name: sleep, description: waits, "
        "parameters: {type: object, properties: {}}}}\n"
    )
    done_at = {}

    def script(rid, turn, prompt):
        if rid == "0/0":
            return call("sleep", "{}") if turn == 0 else ids("ok") + [IM_END]
        done_at[turn] = time.monotonic()
        return ids("again") + [IM_END]

    recs = records(2)
    recs[1] = dataclasses.replace(recs[1], agent_name="repeat")
    agents = rollout(str(path))
    agents.registry.items["repeat"] = Repeat
    start = time.monotonic()
    t0, t1 = run(agents, ScriptedEngine(script, delay_s=0.01), recs)
    assert t1.assistant_turns == 6 and t0.assistant_turns == 2
    assert max(done_at.values()) - start < 1.0 < time.monotonic() - start


class Sleeper:
    timeout_s = 10.0
    schema = None

    def __init__(self, config):
        self.seconds = config.get("seconds", 1.5)

    def __call__(self, arguments, **sample):
        time.sleep(self.seconds)
        return "slept"


def sleeper_config(tmp_path, seconds: float) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: tests.unit.test_agent_loop.Sleeper\n"
        f"    config: {{type: native, seconds: {seconds}}}\n"
        "    tool_schema: {type: function, function: {name: sleep, description: waits, "
        "parameters: {type: object, properties: {}}}}\n"
    )
    return str(path)


EVENTS = st.sampled_from(["call", "back", "wait", "wait_busy", "resume", "read"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(EVENTS, st.floats(0.0, 1.0)), max_size=80))
def test_tool_time_idle_is_a_part_of_the_wall_time(events):
    """Whatever the order of calls going out and coming back, the engine stopping and stepping
    again, and reads between them (an asynchronous rank reads a server that never drains): both
    totals only grow, the idle seconds never exceed the wall seconds, and neither does what they
    grew by between two reads (a step's figures)."""
    now = [0.0]
    tools, last = server_mod.ToolTime(), (0.0, 0.0)
    with unittest.mock.patch.object(server_mod.time, "perf_counter", lambda: now[0]):
        for event, dt in events:
            now[0] += dt
            if event == "call":
                tools.out(1)
            elif event == "back" and tools.pending:
                tools.out(-1)
            elif event in ("wait", "wait_busy"):
                tools.engine_waits(on_tools=event == "wait")
            elif event == "resume":
                tools.engine_resumes()
            wall, idle = tools.so_far()
            assert wall >= last[0] - 1e-9 and idle >= last[1] - 1e-9
            assert idle <= wall + 1e-9 and idle - last[1] <= wall - last[0] + 1e-9
            last = (wall, idle)


@pytest.mark.parametrize("others_decode, deterministic", [(True, False), (False, False), (True, True)])
def test_tool_time_counts_what_the_engine_decoded_meanwhile(tmp_path, others_decode, deterministic):
    """Sample 0 calls a 0.4 s tool. With sample 1 decoding 6 turns of 0.15 s meanwhile the engine
    is never idle on the tool (overlap near 1); with sample 1 calling the tool too it waits the
    whole time (near 0; the margin allows the two calls to come back apart under load), and so it
    does in ordered mode, which holds the engine for the tool."""

    def script(rid, turn, prompt):
        if rid == "0/0" or not others_decode:
            return call("sleep", "{}") if turn == 0 else ids("ok") + [IM_END]
        return ids("again") + [IM_END]

    recs = records(2)
    if others_decode:
        recs[1] = dataclasses.replace(recs[1], agent_name="repeat")
    agents = rollout(sleeper_config(tmp_path, 0.4), deterministic=deterministic)
    agents.registry.items["repeat"] = Repeat
    run(agents, ScriptedEngine(script, delay_s=0.15), recs)
    tools = agents.last_tool_time
    assert tools.pending == 0 and 0.4 <= tools.wall_s < 5.0
    if others_decode and not deterministic:
        assert tools.engine_idle_s < 0.25 * tools.wall_s, vars(tools)
    else:
        assert tools.engine_idle_s > 0.6 * tools.wall_s, vars(tools)


class Repeat:
    """A test loop: six model turns, a user message "go on" between them."""

    def __init__(self, cfg):
        pass

    async def run(self, ctx, sample):
        t = Trajectory(list(sample.prompt_ids), assistant_turns=0)
        context = list(sample.prompt_ids)
        for _ in range(6):
            out = await ctx.generate(sample, context, 50)
            add_model_turn(t, out)
            more = ctx.chat.append_ids([{"role": "user", "content": "go on"}], out.token_ids[-1])
            context += out.token_ids + more
            if t.assistant_turns < 6:
                add_masked(t, more)
        return t


def add_model_turn(t: Trajectory, out: TurnOutput) -> None:
    t.response_ids += out.token_ids
    t.response_mask += [1] * len(out.token_ids)
    t.logprobs += out.logprobs
    t.assistant_turns += 1


def add_masked(t: Trajectory, more: list[int]) -> None:
    t.response_ids += more
    t.response_mask += [0] * len(more)
    t.logprobs += [0.0] * len(more)


JITTER_TOOL = (
    "tools:\n  - class_name: tests.unit.test_agent_loop.Jitter\n    config: {{type: native, seed: {seed}}}\n"
    "    tool_schema: {{type: function, function: {{name: jitter, description: waits, "
    "parameters: {{type: object, properties: {{i: {{type: integer}}}}}}}}}}\n"
)


class Jitter:
    """A tool that returns after 0-24 ms, the order of its calls' returns set by config.seed."""

    timeout_s = 10.0
    schema = None

    def __init__(self, config):
        self.seed = config["seed"]

    def __call__(self, arguments, **sample):
        time.sleep(((arguments["i"] * 7 + self.seed * 5) % 13) * 0.002)
        return "back"


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_fixes_when_and_in_which_order_tool_results_rejoin(tmp_path, deterministic):
    """8 samples call a tool twice; its calls return in a different order in each run. Ordered
    mode: every engine step holds the same requests in sample order, whatever the order of the
    returns. Without it, the first result back is decoded before the others return."""
    script = lambda rid, turn, prompt: call("jitter", f'{{"i": {int(rid[0])}}}') if turn < 2 else ids("x") + [IM_END]
    runs = []
    for seed in (0, 1):
        path = tmp_path / f"jitter{seed}.yaml"
        path.write_text(JITTER_TOOL.format(seed=seed))
        engine = ScriptedEngine(script)
        trajectories = run(rollout(str(path), deterministic=deterministic), engine, records(8))
        assert all(t.assistant_turns == 3 for t in trajectories)
        runs.append(engine.batches)
    in_order = [[f"{i}/0" for i in range(8)]] * 3
    if deterministic:
        assert runs == [in_order, in_order]
    else:
        assert runs[0] != in_order and runs[0] != runs[1]


class WaitsBetweenTurns:
    """A test loop: three 4-token turns of the real model, and between them an idle wait (a
    stand-in for a tool) whose length depends on the sample and on the run."""

    delays: list[float] = []

    def __init__(self, cfg):
        pass

    async def run(self, ctx, sample):
        t = Trajectory(list(sample.prompt_ids), assistant_turns=0)
        context = list(sample.prompt_ids)
        for turn in range(3):
            out = await ctx.generate(sample, context, 4)
            add_model_turn(t, out)
            context += out.token_ids
            if turn < 2:
                await ctx.server.idle(asyncio.sleep(self.delays[int(sample.request_id.split("/")[0])]))
                add_masked(t, [7, 8])
                context += [7, 8]
        return t


def test_deterministic_multi_turn_rollouts_sample_the_same_tokens_run_after_run():
    """The native engine samples at temperature 1 with one random stream for the whole batch, so
    a continuation's row decides its random numbers: in ordered mode the waits' lengths (reversed
    between the runs) change nothing, token for token."""
    cfg = tiny_config("qwen2")
    hf = tiny_hf_model(cfg, seed=2, std=0.2)
    recs = [PromptRecord(p, "copy", "1", {}, f"f:{i}", i, "", "waits") for i, p in enumerate(PROMPTS * 2)]
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=40, seed=4)
    runs = []
    for delays in ([0.002 * i for i in range(len(recs))], [0.002 * (len(recs) - i) for i in range(len(recs))]):
        WaitsBetweenTurns.delays = delays
        agents = rollout(deterministic=True)
        agents.registry.items["waits"] = WaitsBetweenTurns
        engine = build_native_engine(None, engine_context(cfg, actor=hf))
        got = agents.run(engine, to_samples(recs, list(range(len(recs))), sampling), ["waits"] * len(recs))
        agents.close()
        assert all(t.assistant_turns == 3 for t in got)
        runs.append([(t.response_ids, t.logprobs) for t in got])
    assert runs[0] == runs[1]


def test_single_turn_through_the_agents_equals_generate():
    cfg = tiny_config("qwen2")
    hf = tiny_hf_model(cfg, seed=2, std=0.2)
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=4)
    want = build_native_engine(None, engine_context(cfg, actor=hf)).generate(PROMPTS, sampling)
    recs = [PromptRecord(p, "copy", "1", {}, f"f:{i}", i) for i, p in enumerate(PROMPTS)]
    expanded = [r for r in recs for _ in range(3)]
    uids = [i for i in range(len(recs)) for _ in range(3)]
    agents = AgentRollout(RolloutConfig(), PluginManager()["agent_loops"], PluginManager()["tools"], TOK)
    engine = build_native_engine(None, engine_context(cfg, actor=hf))
    got = agents.run(engine, to_samples(expanded, uids, dataclasses.replace(sampling, n=1)), [""] * len(expanded))
    assert [t.response_ids for t in got] == [c.token_ids for c in want]
    assert [t.logprobs for t in got] == [c.logprobs for c in want]
    assert all(t.response_mask == [1] * len(t.response_ids) for t in got)
    assert not engine.requests  # every request released


def test_unknown_agent_name_names_the_row():
    agents = rollout()
    with pytest.raises(UserError, match=r"data.parquet:0: agent_name = 'tool_agnt'.*did you mean 'tool_agent'"):
        run(agents, ScriptedEngine(lambda *a: [IM_END]), records(1, agent="tool_agnt"))


def test_a_failing_loop_names_itself_and_leaves_the_engine_clean():
    class Broken:
        def __init__(self, cfg):
            pass

        async def run(self, ctx, sample):
            if sample.request_id == "1/0":
                raise KeyError("oops")
            return await SingleTurnLike().run(ctx, sample)

    agents = rollout()
    agents.registry.items["broken"] = Broken
    engine = ScriptedEngine(lambda rid, turn, prompt: ids("x") + [IM_END])
    with pytest.raises(UserError, match=r"agent loop 'broken' failed on data.parquet:1 \(KeyError"):
        run(agents, engine, records(3, agent="broken"))
    assert engine.released == {"0/0", "1/0", "2/0"} and not engine.has_work()


class SingleTurnLike:
    async def run(self, ctx, sample):
        out = await ctx.generate(sample, sample.prompt_ids, 10)
        return Trajectory(sample.prompt_ids, out.token_ids, [1] * len(out.token_ids), out.logprobs)


def test_checked_trajectories():
    sample = to_samples(records(1), [0], params(budget=4))[0]
    with pytest.raises(UserError, match="3 response ids but 2 mask values"):
        checked(Trajectory([1], [1, 2, 3], [1, 1], [0.0] * 3), sample, "mine")
    with pytest.raises(UserError, match="only 0 and 1"):
        checked(Trajectory([1], [1], [2], [0.0]), sample, "mine")
    cut = checked(Trajectory([1], list(range(6)), [1] * 6, [0.0] * 6), sample, "mine")
    assert cut.response_ids == [0, 1, 2, 3] and cut.finish_reason == "length"


def test_reward_view_and_final_turn():
    t = Trajectory([1], [5, 6, 7, 8, 9], [1, 1, 0, 1, 1], [0.0] * 5, messages=[{"role": "user", "content": "q"}])
    assert final_turn_ids(t) == [8, 9]
    assert reward_view(t)["messages"] == [{"role": "user", "content": "q"}]
    assert reward_view(Trajectory([1], [5], [1], [0.0])) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1), max_size=30))
def test_final_turn_is_everything_after_the_last_tool_token(mask):
    """final_turn_ids against its definition: the ids after the last mask-0 position, all of them
    when there is none (a single turn), none when the response ends in tool tokens."""
    t = Trajectory([1], list(range(100, 100 + len(mask))), mask, [0.0] * len(mask))
    last_tool = max((i for i, m in enumerate(mask) if m == 0), default=-1)
    assert final_turn_ids(t) == t.response_ids[last_tool + 1 :]


def test_chat_tokens_stop_at_a_single_token_call_close():
    """A tokenizer whose </tool_call> is one token (Qwen2.5's) stops a turn there."""
    tok = byte_tokenizer()
    tok.add_tokens(["</tool_call>"])
    close = tok.convert_tokens_to_ids("</tool_call>")
    assert ChatTokens(tok).stop_ids == (close,)
    assert ChatTokens(TOK).stop_ids == ()


def test_rewards_may_take_the_trajectory():
    from minirl.reward.manager import RewardManager

    seen = {}

    def plain(response, ground_truth, extra_info):
        return 1.0

    def with_trajectory(response, ground_truth, extra_info, trajectory=None):
        seen["t"] = trajectory
        return float(trajectory["num_turns"])

    rm = RewardManager({"plain": plain, "traj": with_trajectory})
    recs = [PromptRecord([1], "plain", "x", {}, "f:0", 0), PromptRecord([1], "traj", "x", {}, "f:1", 1)]
    view = {"messages": [], "num_turns": 3, "finish_reason": "stop"}
    assert rm.score(recs, ["a", "b"], [view, view]).scores == [1.0, 3.0]
    assert seen["t"] is view


def test_events_loop_stays_responsive_while_tools_run(calc_config):
    """The server never blocks the event loop: a ticker task keeps running during a rollout."""
    agents = rollout(calc_config)
    ticks = []

    async def ticker(stop):
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    stop = threading.Event()
    script = lambda rid, turn, prompt: call("calculator", '{"expression": "2"}') if turn == 0 else ids("2") + [IM_END]
    task = agents.event_loop.create_task(ticker(stop))
    run(agents, ScriptedEngine(script, delay_s=0.02), records(4))
    stop.set()
    agents.event_loop.run_until_complete(task)
    assert len(ticks) >= 2
    assert torch.tensor(ticks).diff().max() < 0.5
