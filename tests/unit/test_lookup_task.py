"""The synthetic multi-turn lookup task, piece by piece: the agent tokenizer and its tiny-agent
preset, the lookup tool, the lookup reward and the rows make_data writes.

The task (scripts/make_data.py, bench.toml's cpu-agent profile) is only learnable by a random-init
model because the whole tool call is one token that the agent loop decodes, parses and stops on;
these tests pin each link of that chain, so that the learning test's failure points somewhere.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.agent.chat import ChatTokens
from minirl.agent.loop import AgentRollout, to_samples
from minirl.agent.parser import parse_hermes
from minirl.agent.tools import ToolError, ToolSet
from minirl.config.schema import DataConfig, ModelConfig, MultiTurnConfig, RolloutConfig
from minirl.data.prompts import PromptRecord, load_prompts
from minirl.errors import UserError
from minirl.models.loading import load_model
from minirl.models.presets import preset_config, preset_tokenizer
from minirl.models.tokenizers import (
    AGENT_ADDED_TOKENS,
    AGENT_VOCAB_SIZE,
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    LOOKUP_CALL,
    LOOKUP_CALL_ID,
    agent_byte_tokenizer,
    byte_tokenizer,
)
from minirl.plugins import PluginManager
from minirl.protocols import SamplingParams, TurnOutput
from minirl.reward.scorers import Row, Scorers
from minirl.reward.trajectory import reward_view
from minirl_plugins.rewards import lookup_reward
from minirl_plugins.tools.lookup import Lookup
from tests.scripts import import_script

make_data = import_script("make_data")
TOK = agent_byte_tokenizer()
TOOL_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "tools" / "lookup.yaml")


# ---------------------------------------------------------------------------------------------
# the tokenizer and the preset
# ---------------------------------------------------------------------------------------------


def test_added_tokens_take_ids_259_to_263_in_order():
    """The model's vocabulary (264 rows) and LOOKUP_CALL_ID rely on these exact ids."""
    assert [TOK.convert_tokens_to_ids(t) for t in AGENT_ADDED_TOKENS] == [259, 260, 261, 262, 263]
    assert AGENT_VOCAB_SIZE == len(TOK) == 264 and LOOKUP_CALL_ID == 263
    assert (TOK.eos_token_id, TOK.pad_token_id) == (BYTE_EOS_ID, BYTE_EOS_ID)


def test_lookup_call_is_one_token_and_decodes_to_a_parsable_call():
    """One token for the whole call (what a random policy can sample), whose text the hermes
    parser reads as a lookup call without arguments, with or without special tokens skipped."""
    assert TOK.encode(LOOKUP_CALL, add_special_tokens=False) == [LOOKUP_CALL_ID]
    for skip in (False, True):
        assert TOK.decode([LOOKUP_CALL_ID], skip_special_tokens=skip) == LOOKUP_CALL
    content, [call] = parse_hermes(TOK.decode([ord("x"), LOOKUP_CALL_ID]))
    assert (content, call.name, call.arguments, call.error) == ("x", "lookup", {}, "")


def test_a_turn_stops_on_the_call_token():
    """ChatTokens.stop_ids: the added tokens whose text ends with </tool_call>."""
    assert ChatTokens(TOK).stop_ids == (TOK.convert_tokens_to_ids("</tool_call>"), LOOKUP_CALL_ID)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_ordinary_text_tokenizes_as_the_byte_tokenizer_does(text):
    """Without the added tags the ids are the byte tokenizer's (bytes and ChatML), and every
    text decodes back to itself."""
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == text
    if not any(t in text for t in AGENT_ADDED_TOKENS):
        assert ids == byte_tokenizer().encode(text, add_special_tokens=False)


def test_tiny_agent_preset_is_tiny_with_the_agent_vocabulary():
    """Only the vocabulary differs from `tiny` (whose results must stay bit-exact: still 259)."""
    agent, tiny = preset_config("tiny-agent").to_dict(), preset_config("tiny").to_dict()
    assert (agent.pop("vocab_size"), tiny.pop("vocab_size")) == (AGENT_VOCAB_SIZE, BYTE_VOCAB_SIZE)
    assert agent == tiny
    assert len(preset_tokenizer("tiny-agent")) == AGENT_VOCAB_SIZE


def test_tiny_agent_model_builds_and_covers_the_tokenizer():
    model, tok = load_model(ModelConfig(preset="tiny-agent", seed=0), "cpu", "float32")
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == AGENT_VOCAB_SIZE
    assert model.get_output_embeddings().weight.shape[0] == AGENT_VOCAB_SIZE
    assert tok.encode(LOOKUP_CALL, add_special_tokens=False) == [LOOKUP_CALL_ID]


# ---------------------------------------------------------------------------------------------
# the tool
# ---------------------------------------------------------------------------------------------

ROW_KWARGS = {"lookup": {"create_kwargs": {"key": "k37", "value": "7"}}}
REPLY = " ".join(["7"] * 64)  # examples/tools/lookup.yaml states the value 64 times
# what the model reads after its call: ChatML's tool turn (21 tokens around the reply, one byte a
# token) and the next prompt
TOOL_REPLY_TOKENS = 21 + len(REPLY)


def test_lookup_returns_the_value_without_a_key_or_with_the_right_one():
    tool = Lookup({"type": "native", "timeout_s": 5})
    assert tool.timeout_s == 5.0 and tool.schema["function"]["name"] == "lookup"
    assert tool({}, key="k37", value="7") == "7"
    assert tool({"key": "k37"}, key="k37", value="7") == "7"
    with pytest.raises(ToolError, match='no key "k12"; the prompt names the key'):
        tool({"key": "k12"}, key="k37", value="7")
    with pytest.raises(ToolError, match="create_kwargs.value"):
        tool({})
    assert Lookup({"repeat": 3})({}, key="k37", value="7") == "7 7 7"


@pytest.mark.parametrize("config", [{"repeat": 0}, {"repeat": 1.5}, {"timeout_s": -1}, {"repeats": 8}])
def test_lookup_settings_are_checked(config):
    """A bad setting in the tool config names the key (minirl.agent.tools.tool_options)."""
    with pytest.raises(UserError, match=f"config.{next(iter(config))}"):
        Lookup(config)


def _outcomes(arguments_list: list[str]):
    tools = ToolSet.from_config(MultiTurnConfig(enable=True, tool_config_path=TOOL_CONFIG), PluginManager()["tools"])
    try:
        calls = [
            parse_hermes(f'<tool_call>{{"name": "lookup", "arguments": {a}}}</tool_call>')[1][0] for a in arguments_list
        ]
        return [asyncio.run(tools.call_all([c], ROW_KWARGS))[0] for c in calls]
    finally:
        tools.close()


def test_the_example_tool_config_runs_lookup_with_the_rows_table():
    """examples/tools/lookup.yaml builds the registered tool; the row's create_kwargs reach it;
    a wrong key and a key of the wrong type are messages the model reads, not crashes."""
    ok, keyed, wrong, bad = _outcomes(["{}", '{"key": "k37"}', '{"key": "k99"}', '{"key": 5}'])
    assert [(o.status, o.text) for o in (ok, keyed)] == [("ok", REPLY), ("ok", REPLY)]
    assert wrong.status == "error" and 'no key "k99"' in wrong.text
    assert bad.status == "bad_call" and 'argument "key" must be string' in bad.text


# ---------------------------------------------------------------------------------------------
# the reward
# ---------------------------------------------------------------------------------------------


def _view(tool_text: str | None, answered: bool = True) -> dict:
    """What reward_view gives for: the call, the tool's reply (if any), the answer turn (if any)."""
    messages = [{"role": "user", "content": "Look up key kqx with the lookup tool and answer with its digit."}]
    messages.append({"role": "assistant", "content": "", "tool_calls": [{"name": "lookup", "arguments": {}}]})
    if tool_text is not None:
        messages.append({"role": "tool", "name": "lookup", "content": tool_text})
    if answered:
        messages.append({"role": "assistant", "content": "3", "tool_calls": []})
    return {"messages": messages, "num_turns": 1 + answered, "finish_reason": "stop" if answered else "length"}


@pytest.mark.parametrize(
    "response, trajectory, expected",
    [
        (" 7 is the digit", _view("7"), 1.0),  # the right digit first
        ("3", _view(REPLY), 0.2),  # a successful call, its reply stated 64 times, a wrong digit
        ("7", None, 1.0),  # right without the tool (a lucky guess) still counts
        ("3", _view("7"), 0.2),  # a successful call, a wrong digit
        (" x3", _view("7"), 0.1),  # a successful call, an answer that is no digit
        (LOOKUP_CALL, _view("7"), 0.1),  # called again instead of answering
        ("3", _view('Error: tool "lookup" failed: no key "k9"; the prompt names the key'), 0.0),
        ("3", _view(None), 0.0),  # a call that got no reply
        ("3", _view("7", answered=False), 0.0),  # the reply did not fit the budget: never shown
        ("3", None, 0.0),
        ("", None, 0.0),
    ],
)
def test_lookup_reward(response, trajectory, expected):
    assert lookup_reward(response, "7", {}, trajectory) == expected


def test_lookup_reward_gets_the_trajectory_through_the_scorers():
    """The registry path passes `trajectory` because lookup_reward declares it."""
    scorers = Scorers(registry={"lookup": lookup_reward})
    rows = [Row("lookup", "3", "7", {}, _view("7")), Row("lookup", "3", "7", {}, None)]
    assert [o.score for o in scorers.run(rows)] == [0.2, 0.0]


ANSWER = [ord("7"), BYTE_EOS_ID]


def _scripted_rollout(budget: int):
    """One lookup row through tool_agent, its model scripted: the call token, then "7" and eos."""
    engine = _ScriptedEngine({0: [LOOKUP_CALL_ID], 1: ANSWER})
    mt = MultiTurnConfig(enable=True, tool_config_path=TOOL_CONFIG, max_assistant_turns=2)
    pm = PluginManager()
    agents = AgentRollout(RolloutConfig(multi_turn=mt), pm["agent_loops"], pm["tools"], TOK)
    messages = [{"role": "user", "content": "Look up key k37 with the lookup tool and answer with its digit."}]
    prompt = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = TOK.encode(prompt, add_special_tokens=False)
    extra = {"tools_kwargs": ROW_KWARGS}
    record = PromptRecord(prompt_ids, "lookup", "7", extra, "lookup.parquet:0", 0, "tool", "tool_agent", messages)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=budget, stop_token_ids=(BYTE_EOS_ID,))
    try:
        [t] = agents.run(engine, to_samples([record], [0], params), [record.agent_name])
    finally:
        agents.close()
    return t


def test_a_tool_agent_rollout_that_calls_and_copies_scores_one():
    """The chain the learning test relies on, with a scripted model: the call token stops turn
    one, the tool's reply comes back masked (148 tokens of ChatML), turn two answers the digit."""
    t = _scripted_rollout(budget=1 + TOOL_REPLY_TOKENS + len(ANSWER))
    assert t.assistant_turns == 2 and t.response_ids[0] == LOOKUP_CALL_ID and t.response_ids[-2:] == ANSWER
    assert t.response_mask == [1] + [0] * TOOL_REPLY_TOKENS + [1, 1]
    reply = f"<|im_end|>\n<|im_start|>tool\n{REPLY}<|im_end|>\n<|im_start|>assistant\n"
    assert TOK.decode(t.response_ids[1:-2]) == reply
    assert lookup_reward("7", "7", {}, reward_view(t)) == 1.0
    assert lookup_reward("3", "7", {}, reward_view(t)) == 0.2


def test_a_reply_that_does_not_fit_the_budget_earns_nothing():
    """With no room for the reply and an answer, tool_agent stops ("length") without showing the
    reply, though it keeps it in the messages: the call must not earn the 0.1."""
    t = _scripted_rollout(budget=1 + TOOL_REPLY_TOKENS)
    assert t.assistant_turns == 1 and t.finish_reason == "length" and t.response_ids == [LOOKUP_CALL_ID]
    assert reward_view(t)["messages"][-1] == {"role": "tool", "name": "lookup", "content": REPLY}
    assert lookup_reward(LOOKUP_CALL, "7", {}, reward_view(t)) == 0.0


class _ScriptedEngine:
    """The request-level engine protocol with turns fixed in advance; a turn "stops" when it
    ends on one of the request's stop tokens."""

    def __init__(self, turns: dict[int, list[int]]):
        self.turns, self.queue, self.count = turns, [], {}

    def submit(self, request_id, prompt_ids, params):
        self.queue.append((request_id, params))

    def step(self):
        out = []
        for request_id, params in self.queue:
            turn = self.count[request_id] = self.count.get(request_id, -1) + 1
            tokens = self.turns[turn]
            stopped = tokens[-1] in params.stop_token_ids
            out.append(TurnOutput(request_id, tokens, [-1.0] * len(tokens), "stop" if stopped else "length"))
        self.queue = []
        return out

    def has_work(self):
        return bool(self.queue)

    def abort(self, request_id):
        pass

    def release(self, request_id):
        pass


# ---------------------------------------------------------------------------------------------
# the rows make_data writes
# ---------------------------------------------------------------------------------------------


def _written(task: str, n_train: int, n_test: int, seed: int = 0, out: Path | None = None) -> dict[str, Path]:
    return make_data.write_task(task, out, n_train, n_test, seed)


def test_lookup_rows_are_tool_agent_rows_with_the_table_in_extra_info(tmp_path):
    paths = _written("lookup", 200, 50, out=tmp_path)
    for split, path in paths.items():
        rows = pq.read_table(path).to_pylist()
        for row in rows:
            table = row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]
            assert (row["data_source"], row["ability"], row["agent_name"]) == ("lookup", "tool", "tool_agent")
            assert row["reward_model"]["ground_truth"] == table["value"] and table["value"] in "0123456789"
            assert table["key"] in row["prompt"][0]["content"] and "lookup tool" in row["prompt"][0]["content"]
            assert row["extra_info"]["split"] == split
        digits = {row["reward_model"]["ground_truth"] for row in rows}
        assert digits == set("0123456789"), "every digit appears: the answer is not guessable"


def test_lookup_schema_is_uniform(tmp_path):
    """Every row has the same nested field set (a row without one would make pyarrow fill nulls
    or refuse to concatenate the files)."""
    table = pq.read_table(_written("lookup", 100, 20, out=tmp_path)["train"])
    create = table.schema.field("extra_info").type.field("tools_kwargs").type.field("lookup").type
    assert [f.name for f in create.field("create_kwargs").type] == ["key", "value"]
    shapes = {_shape(row) for row in table.to_pylist()}
    assert len(shapes) == 1 and None not in _values(table.to_pylist()[0])


def _shape(value) -> object:
    if isinstance(value, dict):
        return tuple((k, _shape(v)) for k, v in sorted(value.items()))
    if isinstance(value, list):
        return tuple(_shape(v) for v in value)
    return type(value).__name__


def _values(value) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _values(v)]
    if isinstance(value, list):
        return [x for v in value for x in _values(v)]
    return [value]


def test_lookup_keys_are_disjoint_between_train_and_test_and_fixed_by_seed(tmp_path):
    keys = lambda path: {
        r["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["key"] for r in pq.read_table(path).to_pylist()
    }
    paths = _written("lookup", 300, 60, out=tmp_path / "a")
    assert keys(paths["train"]) and keys(paths["test"]) and not keys(paths["train"]) & keys(paths["test"])
    again = _written("lookup", 300, 60, out=tmp_path / "b")
    other = _written("lookup", 300, 60, seed=1, out=tmp_path / "c")
    rows = lambda p: pq.read_table(p).to_pylist()
    assert rows(paths["train"]) == rows(again["train"]) and rows(paths["train"]) != rows(other["train"])


def test_lookup_is_a_default_task_and_loads_with_its_agent_name(tmp_path):
    """`make data` (make_data.py without --tasks) writes it; load_prompts keeps agent_name."""
    assert "lookup" in make_data.TASKS
    records = load_prompts(
        [str(_written("lookup", 10, 5, out=tmp_path)["test"])], TOK, DataConfig(max_prompt_length=128)
    )
    assert len(records) == 5 and {r.agent_name for r in records} == {"tool_agent"}
    assert max(len(r.prompt_ids) for r in records) <= 128
