"""Tool turns rendered exactly as the model's own published chat template renders them.

The references are the published templates themselves, rendered by transformers' own
apply_chat_template (tests/fixtures/chat_templates/, sources in its README):
- deepseek_r1_distill.jinja: DeepSeek-R1-Distill-Qwen's tokenizer_config.json `chat_template`,
  which the qwen2 presets' own template (minirl's R1_DISTILL_TEMPLATE) renders byte-identically;
- qwen2_5.jinja: Qwen2.5-Instruct's, the template most verl agent-loop users train with.
minirl appends each tool message's tokens once, as the suffix the template adds after an assistant
turn; these tests check that prompt + model turns + those suffixes are exactly the template's
render of the whole conversation, and that a template that would drop the tool's answer is refused.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.agent.chat import ChatTokens
from minirl.agent.loop import AgentRollout
from minirl.build import template_source
from minirl.config.schema import ModelConfig, MultiTurnConfig, RolloutConfig
from minirl.data.prompts import render_prompt
from minirl.errors import UserError
from minirl.models.tokenizers import R1_DISTILL_TEMPLATE, agent_byte_tokenizer, qwen2_tokenizer
from minirl.plugins import PluginManager

FIXTURES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
R1_PUBLISHED = (FIXTURES / "deepseek_r1_distill.jinja").read_text()
QWEN25_PUBLISHED = (FIXTURES / "qwen2_5.jinja").read_text()
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def qwen():
    return qwen2_tokenizer()  # the qwen2 presets' tokenizer, converted once per machine


@pytest.fixture(scope="module")
def r1_published(qwen):
    tok = qwen2_tokenizer()
    tok.chat_template = R1_PUBLISHED
    return tok


def qwen25_tokenizer():
    """Qwen2.5's published template on the agent byte tokenizer (ChatML specials, <tool_call>)."""
    tok = agent_byte_tokenizer()
    tok.chat_template = QWEN25_PUBLISHED
    return tok


def render(tok, messages, generation_prompt=False, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


R1_CONVERSATIONS = [
    [{"role": "user", "content": "6*7?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}],
    [
        {"role": "user", "content": "6*7?"},
        {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\nLet me check."},
        {"role": "tool", "content": "42"},
    ],
    [
        {"role": "user", "content": "6*7 and 1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}},
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}},
        ]},
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "42 and 2."},
        {"role": "user", "content": "thanks"},
    ],
]  # fmt: skip


def test_the_qwen2_presets_template_renders_as_r1_distills_published_one(qwen, r1_published):
    """The shipped template is minirl's own text, and renders these conversations byte-identically
    to the published one (tool calls, tool outputs, the generation prompt that opens <think>)."""
    assert qwen.chat_template == R1_DISTILL_TEMPLATE != R1_PUBLISHED
    for messages in R1_CONVERSATIONS:
        for generation_prompt in (False, True):
            assert render(qwen, messages, generation_prompt) == render(r1_published, messages, generation_prompt)


# Conversations of the shapes minirl produces, for the property test below. Text mixes plain
# characters with the fragments the templates treat specially (think tags, newlines, fences).
_TEXT = st.lists(
    st.text(max_size=6) | st.sampled_from(["<think>", "</think>", "\n", "```", " ", "<｜User｜>"]), max_size=6
).map("".join)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_CALL = st.builds(
    lambda name, args: {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}},
    st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True),
    st.dictionaries(st.text(max_size=6), _JSON, max_size=3),
)
_THOUGHT = st.builds(lambda a, b: f"<think>{a}</think>{b}", _TEXT, _TEXT)
_SEGMENT = st.one_of(
    _TEXT.map(lambda t: [{"role": "user", "content": t}]),
    (_TEXT | _THOUGHT).map(lambda t: [{"role": "assistant", "content": t}]),
    st.lists(_CALL, min_size=1, max_size=3).map(lambda c: [{"role": "assistant", "content": None, "tool_calls": c}]),
    st.lists(_TEXT.map(lambda t: {"role": "tool", "content": t}), min_size=1, max_size=3),
)
_CONVERSATION = st.builds(
    lambda system, first, rest: system + [{"role": "user", "content": first}] + [m for seg in rest for m in seg],
    st.just([]) | _TEXT.map(lambda t: [{"role": "system", "content": t}]),
    _TEXT,
    st.lists(_SEGMENT, max_size=8),
)


@settings(max_examples=200, deadline=None)
@given(messages=_CONVERSATION, generation_prompt=st.booleans(), tools=st.sampled_from([None, [CALC]]))
def test_r1_distill_template_renders_byte_identically_to_the_published_one(
    qwen, r1_published, messages, generation_prompt, tools
):
    """Any mix of system, user, assistant (with and without a thought), tool-call and tool turns,
    with and without the generation prompt and tools=: transformers renders minirl's template and
    the published one to the same text."""
    ours = render(qwen, messages, generation_prompt, tools=tools)
    assert ours == render(r1_published, messages, generation_prompt, tools=tools)


def test_r1_distill_renders_tool_outputs_and_no_new_header_after_them(qwen):
    """What the published template does with a tool result, written out: the outputs block after
    the assistant's end token, and no assistant header after it (the model writes on)."""
    text = render(qwen, R1_CONVERSATIONS[2], generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜><｜User｜>6*7?<｜Assistant｜>\n\nLet me check.<｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>42<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )
    assert render(qwen, R1_CONVERSATIONS[0], True).endswith("<｜Assistant｜><think>\n")


def test_r1_distill_appended_tool_ids_are_what_the_template_adds(qwen):
    """Two tool results after a turn that ended on the end token the model sampled: the appended
    ids decode to exactly what the published template adds to the conversation for them."""
    chat = ChatTokens(qwen)
    before = [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "Let me check."}]
    tools = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "a\nb"}]
    added = render(qwen, before + tools, True)[len(render(qwen, before)) :]
    ids = chat.append_ids(tools, last_token=qwen.eos_token_id)
    assert qwen.decode(ids) == added
    assert added == (
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>42<｜tool▁output▁end｜>"
        "\n<｜tool▁output▁begin｜>a\nb<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


def test_qwen25_multi_turn_conversation_is_byte_identical_built_incrementally():
    """Prompt (with tools=), the model's call turn, the appended tool results, the model's answer:
    token ids that decode to exactly Qwen2.5's render of the whole conversation, tool list, turn
    separators and the merged <tool_response> user block included (verl lost the separator:
    verl#6501)."""
    tok = qwen25_tokenizer()
    chat = ChatTokens(tok)
    messages = [{"role": "user", "content": "6*7 and 1+1?"}]
    calls = [
        {"name": "calculator", "arguments": {"expression": "6*7"}},
        {"name": "calculator", "arguments": {"expression": "1+1"}},
    ]
    call_turn = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"type": "function", "function": c} for c in calls],
    }
    results = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "2"}]
    answer = {"role": "assistant", "content": "42 and 2."}
    model_text = render(tok, [*messages, call_turn])[len(render(tok, messages)) :]  # what the model writes
    model_text = model_text.removeprefix("<|im_start|>assistant\n").removesuffix(
        "\n"
    )  # after the prompt, up to <|im_end|>
    ids = render_prompt(tok, messages, "row 0", tools=[CALC])
    ids += tok.encode(model_text, add_special_tokens=False)
    ids += chat.append_ids(results, last_token=ids[-1])
    ids += tok.encode("42 and 2.<|im_end|>", add_special_tokens=False)
    full = render(tok, [*messages, call_turn, *results, answer], tools=[CALC])
    assert tok.decode(ids) == full.removesuffix("\n")
    assert '"name": "calculator"' in full.split("<|im_end|>")[0]  # tools= is in the system prompt
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n2\n</tool_response>" in full


def test_a_template_that_drops_tool_messages_is_refused_naming_it(tmp_path):
    """The template minirl shipped before had no tool branch: a tool result rendered as nothing. With
    a tool config set, the run refuses it up front, naming where the template comes from."""
    old = qwen25_tokenizer()
    old.chat_template = (
        "{% for m in messages %}{% if m['role'] in ('user', 'assistant') %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - class_name: calculator\n")
    pm = PluginManager()
    cfg = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tool_config_path=str(config)))
    with pytest.raises(UserError, match=r"model\.path = '/ckpt': its chat template does not render tool messages"):
        AgentRollout(cfg, pm["agent_loops"], pm["tools"], old, "model.path = '/ckpt'")
    no_tools = RolloutConfig(multi_turn=MultiTurnConfig(enable=True))
    AgentRollout(no_tools, pm["agent_loops"], pm["tools"], old, "model.path = '/ckpt'")  # nothing to refuse


def test_a_template_that_ignores_tools_is_named_in_a_warning(tmp_path, qwen):
    """R1-Distill's published template never reads tools=: the run says so once, at start-up;
    Qwen2.5's shows them and says nothing."""
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - class_name: calculator\n")
    pm = PluginManager()
    cfg = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tool_config_path=str(config)))
    with pytest.warns(UserWarning, match=r"model\.preset = 'qwen2-1\.5b': .*does not show the tool list"):
        AgentRollout(cfg, pm["agent_loops"], pm["tools"], qwen, "model.preset = 'qwen2-1.5b'").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AgentRollout(cfg, pm["agent_loops"], pm["tools"], qwen25_tokenizer()).close()


def test_template_source_names_the_key_the_tokenizer_comes_from():
    assert template_source(ModelConfig(preset="qwen2-1.5b")) == "model.preset = 'qwen2-1.5b'"
    assert template_source(ModelConfig(path="/ckpt")) == "model.path = '/ckpt'"
    assert template_source(ModelConfig(path="/ckpt", tokenizer="/tok")) == "model.tokenizer = '/tok'"


def test_the_turn_after_r1s_generation_prompt_starts_inside_a_thought(qwen):
    """The first turn follows <｜Assistant｜><think>\\n (a thought the template opened); the turn
    after tool outputs follows no header, so no thought, whatever the output says; Qwen2.5 opens none."""
    chat = ChatTokens(qwen)
    prompt = qwen.encode(render(qwen, R1_CONVERSATIONS[0], True), add_special_tokens=False)
    assert chat.opens_thought(prompt)
    assert not chat.opens_thought(chat.append_ids([{"role": "tool", "content": "42"}], qwen.eos_token_id))
    shown = chat.append_ids([{"role": "tool", "content": "a page that says <think>"}], qwen.eos_token_id)
    assert not chat.opens_thought(shown)  # a tag inside a message is the message's text
    tok = qwen25_tokenizer()
    assert not ChatTokens(tok).opens_thought(render_prompt(tok, R1_CONVERSATIONS[0], "row 0", tools=[CALC]))
