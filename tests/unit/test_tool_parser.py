"""Hermes tool-call parsing (minirl/agent/parser.py): calls come out in order, malformed ones are
kept with a reason (the model gets an error message instead of a silently ended turn), and
calls inside <think> are reasoning, not actions."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.agent.parser import PARSERS, ToolCall, parse_hermes

FAST = settings(max_examples=60, deadline=None)


def block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_one_call_is_parsed_and_removed_from_the_text():
    text, calls = parse_hermes("Let me add. " + block("calculator", {"expression": "2+3"}))
    assert text == "Let me add."
    assert calls == [ToolCall("calculator", {"expression": "2+3"}, calls[0].raw)]
    assert json.loads(calls[0].raw)["name"] == "calculator"


def test_two_calls_come_in_order_and_the_text_between_stays():
    raw = "a " + block("f", {"x": 1}) + " b " + block("g", {}) + " c"
    text, calls = parse_hermes(raw)
    assert [c.name for c in calls] == ["f", "g"]
    assert [c.arguments for c in calls] == [{"x": 1}, {}]
    assert text == "a  b  c"
    assert all(c.error == "" for c in calls)


def test_text_without_calls_comes_back_stripped():
    assert parse_hermes("  The answer is 4.\n") == ("The answer is 4.", [])


def test_malformed_json_is_a_call_with_an_error_not_dropped():
    text, calls = parse_hermes('x <tool_call>{"name": "f", "arguments": {</tool_call> y')
    assert text == "x  y"
    assert len(calls) == 1
    assert calls[0].name == "" and calls[0].arguments is None
    assert "not valid JSON" in calls[0].error and "<tool_call>" in calls[0].error  # says the format


def test_a_call_without_a_name_is_malformed():
    _, calls = parse_hermes('<tool_call>{"arguments": {"a": 1}}</tool_call>')
    assert calls[0].arguments is None and '"name"' in calls[0].error
    _, calls = parse_hermes('<tool_call>{"name": 7, "arguments": {}}</tool_call>')
    assert '"name"' in calls[0].error


def test_arguments_that_are_not_an_object_are_malformed_but_keep_the_name():
    _, calls = parse_hermes('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>')
    assert calls[0].name == "f" and calls[0].arguments is None
    assert calls[0].error == '"arguments" must be a JSON object, got array'


def test_a_json_array_call_is_malformed():
    _, calls = parse_hermes("<tool_call>[1]</tool_call>")
    assert "got array" in calls[0].error


def test_arguments_given_as_a_json_string_are_accepted():
    """The OpenAI API sends arguments as a string; models trained on it copy that."""
    _, calls = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0].arguments == {"a": 1} and calls[0].error == ""


def test_missing_arguments_mean_no_arguments():
    _, calls = parse_hermes('<tool_call>{"name": "now"}</tool_call>')
    assert calls[0] == ToolCall("now", {}, '{"name": "now"}')


def test_an_unclosed_call_at_the_end_is_one_malformed_call():
    text, calls = parse_hermes('Working. <tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert text == "Working."
    assert len(calls) == 1 and calls[0].arguments is None
    assert "no closing </tool_call>" in calls[0].error
    assert calls[0].raw.startswith('{"name": "f"')


def test_calls_inside_think_are_ignored():
    inside = "<think>maybe " + block("f", {"a": 1}) + "? no.</think>"
    text, calls = parse_hermes(inside + " answer " + block("g", {"b": 2}))
    assert [c.name for c in calls] == ["g"]
    assert text.startswith("<think>maybe <tool_call>")  # the thought is left as it was


def test_a_call_after_an_unclosed_think_is_ignored():
    assert parse_hermes("<think>" + block("f", {}))[1] == []


def test_a_leading_close_think_ends_a_thought_the_prompt_opened():
    """Templates that open <think> in the generation prompt leave only </think> in the response."""
    text = "plan: " + block("f", {}) + " </think> now " + block("g", {})
    assert [c.name for c in parse_hermes(text)[1]] == ["g"]


def test_stray_closing_tags_stay_in_the_text():
    assert parse_hermes("a </tool_call> b") == ("a </tool_call> b", [])


def test_the_registry_names_hermes():
    assert PARSERS["hermes"] is parse_hermes


prose = st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=20)
json_value = st.one_of(st.integers(), st.text(max_size=8), st.booleans(), st.none(), st.floats(allow_nan=False))
calls_st = st.lists(
    st.tuples(
        st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8),
        st.dictionaries(st.text(max_size=6), json_value, max_size=3),
    ),
    max_size=4,
)


@FAST
@given(calls_st, st.lists(prose, min_size=5, max_size=5))
def test_rendered_calls_parse_back_exactly(calls, gaps):
    """Any calls rendered between any prose parse back to the same names and arguments, and the
    text is the prose alone."""
    pieces = [gaps[0]]
    for i, (name, arguments) in enumerate(calls):
        pieces += [block(name, arguments), gaps[(i + 1) % len(gaps)]]
    text, parsed = parse_hermes("".join(pieces))
    assert [(c.name, c.arguments) for c in parsed] == calls
    assert text == "".join(pieces[::2]).strip()


@FAST
@given(st.lists(st.sampled_from(list('<>/{}[]":, ab') + ["<tool_call>", "</tool_call>", "<think>", "</think>"])))
def test_any_text_parses_without_raising_and_every_call_is_fine_or_explained(pieces):
    content, calls = parse_hermes("".join(pieces))
    assert content == content.strip()
    for call in calls:
        assert (call.error == "") == (call.arguments is not None)
        assert call.error or call.name
