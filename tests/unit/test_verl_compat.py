"""A verl agent-loop setup moved over unchanged: truncation sides, the Hermes parser, parallel calls,
verl's tool classes and tool configs, num_turns.

verl's behaviour is restated here from its code (verl-project/verl 0.8+, tool_agent_loop.py,
tool_parser.py, tools/base_tool.py, the example tool configs), never imported: verl is not a
dependency. Where minirl does better on purpose (docs/agents.md, "Compared with verl's agent
loop"), the test says so.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.agent.loop import AgentRollout, to_samples
from minirl.agent.parser import parse_hermes
from minirl.agent.tools import ToolSet, truncate_response
from minirl.agent.verl_tools import AgentData
from minirl.config.schema import MultiTurnConfig, RolloutConfig
from minirl.data.prompts import PromptRecord
from minirl.dist.context import DistContext
from minirl.errors import UserError
from minirl.models.tokenizers import agent_byte_tokenizer
from minirl.observe.step_metrics import agent_metrics
from minirl.plugins import PluginManager
from minirl.protocols import SamplingParams, Trajectory, TurnOutput
from minirl.reward.manager import _with_turns
from minirl.reward.trajectory import reward_view
from tests.unit.test_agent_loop import ScriptedEngine

FAST = settings(max_examples=80, deadline=None)
TOK = agent_byte_tokenizer()  # <tool_call> and </tool_call> are single tokens, as in Qwen2.5's vocabulary
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
REGISTRY = PluginManager()["tools"]


def ids(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def hermes(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# --- tool_response_truncate_side -----------------------------------------------------------------


def verl_truncate(text: str, limit: int, side: str) -> str:
    """verl's ToolAgentLoop._call_tool (0.8 and later, after verl#6313), restated."""
    if not text or len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


@FAST
@given(st.text(max_size=300), st.integers(2, 200), st.sampled_from(["left", "right", "middle"]))
def test_truncation_is_verls_left_right_and_middle(text, limit, side):
    """Same text, same marker, same side as verl; left keeps the tail (as data.truncation's left
    does), right keeps the head, and at most `limit` characters of the reply survive."""
    out = truncate_response(text, limit, side)
    assert out == verl_truncate(text, limit, side)
    if len(text) > limit:
        kept = out.replace("(truncated)...", "", 1) if side == "left" else out.replace("...(truncated)", "", 1)
        kept = kept.replace("...", "", 1) if side == "middle" else kept
        assert len(kept) <= limit
        assert {"left": out.endswith(text[-limit:]), "right": out.startswith(text[:limit])}.get(side, True)


def test_truncation_middle_of_one_character_keeps_none():
    """verl's text[-0:] keeps the whole text when limit // 2 is 0; minirl keeps no character."""
    assert verl_truncate("abcdef", 1, "middle") == "...(truncated)...abcdef"
    assert truncate_response("abcdef", 1, "middle") == "...(truncated)..."


# --- the Hermes parser ---------------------------------------------------------------------------


def verl_hermes(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """verl's HermesToolParser.extract_tool_calls, restated: both tags needed, a non-greedy regex
    over the decoded turn, invalid JSON dropped, the blocks cut out of the content."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return text, []
    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    calls = []
    for body in pattern.findall(text):
        try:
            payload = json.loads(body)
            calls.append((payload["name"], payload["arguments"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return pattern.sub("", text), calls


PLAIN = st.text(st.characters(blacklist_characters='<>"\\', blacklist_categories=("Cs",)), max_size=20)
ARGS = st.dictionaries(PLAIN, st.one_of(st.integers(), PLAIN, st.booleans()), max_size=3)


@FAST
@given(st.lists(st.tuples(PLAIN, st.text(min_size=1, max_size=8).filter(str.isidentifier), ARGS), max_size=4), PLAIN)
def test_well_formed_calls_parse_as_verl_parses_them(parts, tail):
    """For well-formed calls with plain text around them the calls agree with verl's, in order,
    and rendering them back gives the same calls (a round trip)."""
    text = "".join(before + hermes(name, args) for before, name, args in parts) + tail
    content, calls = parse_hermes(text)
    verl_content, verl_calls = verl_hermes(text)
    assert [(c.name, c.arguments) for c in calls] == verl_calls == [(n, a) for _, n, a in parts]
    assert content == verl_content.strip()
    again = "".join(hermes(c.name, c.arguments) for c in calls)
    assert [(c.name, c.arguments) for c in parse_hermes(again)[1]] == verl_calls


def test_a_close_think_tag_inside_arguments_does_not_hide_the_call():
    """Code that prints '</think>' is the call's text: the call is run, not dropped, not left
    in the content."""
    code = "s = '</think>'\nprint(s)"
    content, calls = parse_hermes("Run it. " + hermes("python", {"code": code}))
    assert [(c.name, c.arguments, c.error) for c in calls] == [("python", {"code": code}, "")]
    assert content == "Run it."


def test_a_close_call_tag_inside_a_json_string_does_not_end_the_call():
    """verl's non-greedy regex cuts the call at the first </tool_call> and drops it as bad JSON;
    minirl reads the JSON string and runs the whole call."""
    code = "print('</tool_call>')"
    text = hermes("python", {"code": code})
    assert verl_hermes(text)[1] == []
    assert [(c.name, c.arguments) for c in parse_hermes(text)[1]] == [("python", {"code": code})]


def test_a_turn_that_starts_inside_a_thought_runs_only_the_calls_after_it():
    """R1-Distill's prompt opens <think>: a call drafted in the thought is reasoning, the one
    after </think> is the action (verl runs both: verl#6424)."""
    draft, action = hermes("calculator", {"expression": "1"}), hermes("calculator", {"expression": "2"})
    text = "maybe " + draft + " no.</think>\n\n" + action
    for thinking in (True, False):  # without the flag a stray </think> says the same
        assert [c.arguments for c in parse_hermes(text, thinking=thinking)[1]] == [{"expression": "2"}]
    assert [a for _, a in verl_hermes(text)[1]] == [{"expression": "1"}, {"expression": "2"}]


# --- a scripted model, its tools ---------------------------------------------------------------


class StreamEngine(ScriptedEngine):
    """A request-level engine whose model writes planned turns and, as a real engine, stops at the
    first stop token (SamplingParams.stop_token_ids). A submit that only continues the request
    (nothing appended) resumes the same planned turn; one with appended tokens starts the next."""

    def __init__(self, turns: list[list[int]]):
        super().__init__(script=None)
        self.planned, self.at, self.submits = turns, {}, []

    def submit(self, request_id, prompt_ids, params):
        turn, offset, context = self.at.get(request_id, (-1, 0, None))
        if list(prompt_ids) != context:
            turn, offset = turn + 1, 0
        self.at[request_id] = (turn, offset, None)
        self.queue.append((request_id, list(prompt_ids), params))
        self.submits.append(request_id)

    def step(self):
        out = []
        for request_id, prompt, params in self.queue:
            turn, offset, _ = self.at[request_id]
            rest, stops = self.planned[turn][offset:], set(params.stop_token_ids)
            cut = min(next((i + 1 for i, t in enumerate(rest) if t in stops), len(rest)), params.max_new_tokens)
            piece = rest[:cut]
            self.at[request_id] = (turn, offset + cut, prompt + piece)
            reason = "stop" if piece and piece[-1] in stops else "length"
            out.append(TurnOutput(request_id, piece, [-0.5] * len(piece), reason))
        self.queue = []
        return out


TOOLS_MODULE = '''
import asyncio
import uuid

EVENTS = []


class Wait:
    """Async: waits until `parties` calls are running at once, then sleeps `s`, returns `tag`."""

    schema = {"type": "function", "function": {"name": "wait", "description": "wait",
              "parameters": {"type": "object", "properties": {"s": {"type": "number"}, "tag": {"type": "string"}}}}}
    timeout_s = 5.0

    def __init__(self, config):
        self.parties, self.barrier = config.get("parties", 1), None

    async def __call__(self, arguments, **sample):
        self.barrier = self.barrier or asyncio.Barrier(self.parties)
        await self.barrier.wait()
        await asyncio.sleep(arguments["s"])
        EVENTS.append(arguments["tag"])
        return arguments["tag"]


class BaseTool:
    """verl's BaseTool protocol, restated: built as cls(config, tool_schema)."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid.uuid4()), None

    async def execute(self, instance_id, parameters, **kwargs):
        return "done", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        EVENTS.append("calc_reward")
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass


class Response:
    def __init__(self, text):
        self.text, self.image, self.video = text, None, None


class AnswerChecker(BaseTool):
    """Like verl's Gsm8kTool: the row's ground truth comes in create_kwargs, each call is a fresh
    instance, and state across calls lives in agent_data.extra_fields."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.truth = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or str(uuid.uuid4())
        self.truth[instance_id] = kwargs.get("create_kwargs", {}).get("ground_truth")
        EVENTS.append(("create", kwargs))
        return instance_id, Response("")

    async def execute(self, instance_id, parameters, **kwargs):
        state = kwargs["agent_data"].extra_fields
        state["tries"] = state.get("tries", 0) + 1
        if parameters["answer"] == "boom":
            raise RuntimeError("checker crashed")
        right = parameters["answer"] == self.truth[instance_id]
        return Response(f"try {state['tries']}: {'right' if right else 'wrong'}"), 1.0 if right else -0.05, {}

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", self.truth.pop(instance_id, "gone")))


class OwnSchema(BaseTool):
    class _Schema(dict):
        def __getattr__(self, key):
            value = self[key]
            return OwnSchema._Schema(value) if isinstance(value, dict) else value

        def model_dump(self, **kwargs):
            return dict(self)

    def get_openai_tool_schema(self):
        return self._Schema({"type": "function", "function": {"name": "own", "description": "d",
                             "parameters": {"type": "object", "properties": {}}}})


class SyncExecute(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        return "x", 0.0, {}


class TwoArgs:
    def __init__(self, config, extra):
        pass
'''


@pytest.fixture
def tools_module(tmp_path, monkeypatch):
    """The module above as `verl_like_tools`, importable by a dotted class_name."""
    (tmp_path / "verl_like_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "verl_like_tools", raising=False)
    yield tmp_path
    sys.modules.pop("verl_like_tools", None)


def tool_config(tmp_path, text: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def agent_run(config: str, turns: list[list[int]], budget: int = 600, **multi_turn):
    mt = MultiTurnConfig(enable=True, tool_config_path=config, **multi_turn)
    pm = PluginManager()
    agents = AgentRollout(RolloutConfig(multi_turn=mt), pm["agent_loops"], pm["tools"], TOK)
    messages = [{"role": "user", "content": "go"}]
    prompt = ids(TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    record = PromptRecord(prompt, "t", "72", {}, "rows.parquet:0", 0, "", "tool_agent", messages)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=budget, stop_token_ids=(IM_END,))
    engine = StreamEngine(turns)
    try:
        [t] = agents.run(engine, to_samples([record], [0], params), ["tool_agent"])
    finally:
        agents.close()
    return t, engine


WAIT_CONFIG = """
    tools:
      - class_name: verl_like_tools.Wait
        config: {type: native, parties: 2}
"""


def test_a_turn_carries_parallel_calls_run_concurrently_and_answered_in_call_order(tools_module):
    """With max_parallel_calls = 2 the turn does not end at the first </tool_call>: it goes on to
    the second call. Both run at once (each waits for the other), and though the first finishes
    last, the tool messages come in call order."""
    first, second = hermes("wait", {"s": 0.2, "tag": "a"}), hermes("wait", {"s": 0.0, "tag": "b"})
    turns = [ids(first + "\n" + second) + [IM_END], ids("ab") + [IM_END]]
    t, engine = agent_run(tool_config(tools_module, WAIT_CONFIG), turns, max_parallel_calls=2)
    assert sys.modules["verl_like_tools"].EVENTS == ["b", "a"]
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["a", "b"]
    assert t.messages[1]["tool_calls"][0]["arguments"]["tag"] == "a" and len(t.messages[1]["tool_calls"]) == 2
    text = TOK.decode(t.response_ids)
    assert text.startswith(first + "\n" + second + "<|im_end|>\n<|im_start|>tool\na<|im_end|>\n<|im_start|>tool\nb")
    assert len(engine.submits) == 3  # the call turn in two pieces (stopped at each close), then the answer
    assert (t.assistant_turns, t.user_turns, t.metrics["tool_ok"], t.metrics.get("tool_skipped", 0)) == (2, 1, 2, 0)


def test_one_call_per_turn_ends_the_turn_at_its_close(tools_module):
    """max_parallel_calls = 1 (verl's default): the turn ends at the first complete call, so the
    model never writes a call that would not run."""
    config = tool_config(tools_module, WAIT_CONFIG.replace("parties: 2", "parties: 1"))
    first, second = hermes("wait", {"s": 0.0, "tag": "a"}), hermes("wait", {"s": 0.0, "tag": "b"})
    t, engine = agent_run(config, [ids(first + "\n" + second) + [IM_END], ids("a") + [IM_END]])
    assert TOK.decode(t.response_ids).startswith(first + "<|im_end|>")
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["a"] and len(engine.submits) == 2


def test_a_close_tag_inside_a_thought_does_not_end_the_turn(tools_module):
    """The engine stops at every </tool_call> token; one inside <think> closes no call, so the
    turn goes on to the real call."""
    config = tool_config(tools_module, WAIT_CONFIG.replace("parties: 2", "parties: 1"))
    drafted = "<think>" + hermes("wait", {"s": 0.0, "tag": "draft"}) + "</think>"
    real = hermes("wait", {"s": 0.0, "tag": "real"})
    t, engine = agent_run(config, [ids(drafted + real) + [IM_END], ids("ok") + [IM_END]])
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["real"] and len(engine.submits) == 3


def test_num_turns_counts_as_verl_counts(tools_module):
    """verl's num_turns = user turns + assistant turns + 1: 4 for call, result, answer (minirl
    logged 2, the model turns, under that name before); 2 for a single turn. The step logs verl's
    num_turns/* and the model turns as agent/assistant_turns/*; a reward's extra_info gets
    num_turns as verl's reward managers put it there."""
    config = tool_config(tools_module, WAIT_CONFIG.replace("parties: 2", "parties: 1"))
    t, _ = agent_run(config, [ids(hermes("wait", {"s": 0.0, "tag": "a"})) + [IM_END], ids("a") + [IM_END]])
    assert (t.assistant_turns, t.user_turns, t.num_turns) == (2, 1, 4)
    assert Trajectory([1], [2], [1], [0.0]).num_turns == 2
    view = reward_view(t)
    assert view["num_turns"] == 4 and view["assistant_turns"] == 2
    assert _with_turns({"split": "train"}, view) == {"split": "train", "num_turns": 4}
    metrics = agent_metrics([t, Trajectory([1], [2], [1], [0.0])], DistContext(device=torch.device("cpu")))
    assert metrics["num_turns/mean"] == 3.0 and metrics["num_turns/max"] == 4.0
    assert metrics["agent/assistant_turns/mean"] == 1.5 and "agent/turns/mean" not in metrics


# --- verl's tool classes and tool configs ------------------------------------------------------

GSM8K_LIKE = """
    tools:
      - class_name: verl_like_tools.AnswerChecker
        config:
          type: native
        tool_schema:
          type: function
          function:
            name: check_answer
            description: Check the answer to the problem.
            parameters:
              type: object
              properties:
                answer: {type: string, description: the answer, digits only}
              required: [answer]
"""


def run_calls(tools: ToolSet, calls, tools_kwargs, agent_data):
    try:
        return asyncio.run(tools.call_all(calls, tools_kwargs, agent_data))
    finally:
        tools.close()


def test_a_verl_base_tool_runs_unchanged_with_verls_lifecycle(tools_module):
    """Per call, as verl's loop does: create(create_kwargs=the row's), execute(..., agent_data=),
    release (also after execute raised); calc_reward is never called; the step reward reaches the
    outcome, and state across calls lives in agent_data.extra_fields."""
    from minirl.agent.parser import ToolCall

    tools = ToolSet.from_config(MultiTurnConfig(tool_config_path=tool_config(tools_module, GSM8K_LIKE)), REGISTRY)
    tool = tools._entries["check_answer"].tool.tool
    assert tool.config == {"type": "native"} and tool.tool_schema.function.name == "check_answer"
    assert tool.tool_schema.model_dump()["function"]["parameters"]["required"] == ["answer"]
    kwargs = {"check_answer": {"create_kwargs": {"ground_truth": "72"}}}
    data = AgentData("0/0", kwargs)
    calls = [ToolCall("check_answer", {"answer": a}, "") for a in ("72", "7", "boom")]
    tools.max_parallel_calls = 3
    right, wrong, boom = run_calls(tools, calls, kwargs, data)
    assert (right.status, right.reward) == ("ok", 1.0) and wrong.reward == -0.05 and boom.reward is None
    assert right.text.endswith(": right") and wrong.text.endswith(": wrong") and data.extra_fields["tries"] == 3
    assert boom.status == "error" and "RuntimeError: checker crashed" in boom.text
    events = sys.modules["verl_like_tools"].EVENTS
    assert events.count(("create", {"create_kwargs": {"ground_truth": "72"}})) == 3
    assert events.count(("release", "72")) == 3 and "calc_reward" not in events


def test_a_verl_tool_without_a_schema_entry_uses_its_own(tools_module):
    entry = "tools:\n  - class_name: verl_like_tools.OwnSchema\n    config: {type: native}\n"
    config = tool_config(tools_module, entry)
    tools = ToolSet.from_config(MultiTurnConfig(tool_config_path=config), REGISTRY)
    assert tools.names == ["own"] and tools.schemas[0]["function"]["description"] == "d"


@pytest.mark.parametrize(
    "class_name, message",
    [
        ("SyncExecute", r"tools\[0\].*SyncExecute takes a tool_schema like verl's BaseTool but has no async execute"),
        ("TwoArgs", r"tools\[0\].*missing 1 required positional argument: 'extra'.*a verl tool is a class"),
    ],
)
def test_a_tool_class_of_another_shape_is_refused_with_the_shape_minirl_wants(tools_module, class_name, message):
    config = tool_config(tools_module, f"tools:\n  - class_name: verl_like_tools.{class_name}\n")
    with pytest.raises(UserError, match=message) as err:
        ToolSet.from_config(MultiTurnConfig(tool_config_path=config), REGISTRY)
    assert "a minirl tool is factory(config)" in str(err.value)


VERL_EXAMPLES = {  # verl's examples/sglang_multiturn/config/tool_config/*.yaml, restated
    "gsm8k": (
        """
        tools:
          - class_name: verl.tools.gsm8k_tool.Gsm8kTool
            config: {type: native}
            tool_schema:
              type: function
              function:
                name: calc_gsm8k_reward
                description: reward
                parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
        """,
        r"tools\[0\]\.class_name = 'verl\.tools\.gsm8k_tool\.Gsm8kTool': cannot import 'verl\.tools\..*install verl",
    ),
    "sandbox_fusion": (
        """
        tools:
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {sandbox_fusion_url: "http://localhost/run_code", num_workers: 10, enable_global_rate_limit: true,
                     rate_limit: 10, default_timeout: 30, default_language: python, memory_limit_mb: 1024, type: native}
            tool_schema:
              type: function
              function:
                name: code_interpreter
                description: run code
                parameters: {type: object, properties: {code: {type: string}}, required: [code]}
        """,
        r"tools\[0\]\.class_name = 'verl\.tools\.sandbox_fusion_tools\.SandboxFusionTool': cannot import .*verl",
    ),
    "mcp": (
        """
        tools:
          - class_name: verl.tools.mcp_search_tool.MCPSearchTool
            config: {rate_limit: 120, timeout: 120, type: mcp}
            mcp: {mcp_servers_config_path: ./mcp_server.json, tool_selected_list: [tavily_search_tool]}
        """,
        r"tools\[0\]\.mcp: MCP tools \(verl's config\.type: mcp\) are not supported",
    ),
}


@pytest.mark.parametrize("example", sorted(VERL_EXAMPLES))
def test_verls_example_tool_configs_are_refused_key_by_key_with_the_reason(tmp_path, example):
    """Without verl installed its classes cannot load: the one line names the entry, the key and
    the fix. With verl installed the same files load through the adapter (above)."""
    text, message = VERL_EXAMPLES[example]
    with pytest.raises(UserError, match=message):
        ToolSet.from_config(MultiTurnConfig(tool_config_path=tool_config(tmp_path, text)), REGISTRY)


def test_verls_example_config_loads_once_its_class_imports(tools_module):
    """The gsm8k example's entry with class_name pointed at an importable BaseTool subclass: the
    schema the model sees is the file's, the tool's config is passed as verl passes it."""
    text = VERL_EXAMPLES["gsm8k"][0].replace("verl.tools.gsm8k_tool.Gsm8kTool", "verl_like_tools.AnswerChecker")
    tools = ToolSet.from_config(MultiTurnConfig(tool_config_path=tool_config(tools_module, text)), REGISTRY)
    assert tools.names == ["calc_gsm8k_reward"] and tools.schemas[0]["function"]["parameters"]["required"] == ["answer"]
    tools.close()
