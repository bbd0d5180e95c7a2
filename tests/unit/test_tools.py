"""Running tools (minirl/agent/tools.py) and the calculator (plugins/tools/calculator.py).

A tool's failure, timeout, unknown name or bad arguments must come back as a message the model
reads, never an exception; a slow sync tool must not block the event loop the other samples
decode on; the tool config file's mistakes must name the file, the entry and the fix."""

from __future__ import annotations

import asyncio
import json
import time
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.agent.parser import ToolCall, check_arguments
from minirl.agent.tools import ToolError, ToolSet, truncate
from minirl.config.schema import MultiTurnConfig
from minirl.errors import UserError
from minirl.plugins import Registry
from minirl_plugins.tools import minirl_tools
from minirl_plugins.tools.calculator import MAX_DIGITS, evaluate, format_number

FAST = settings(max_examples=60, deadline=None)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tools" / "tool_config.yaml"


def schema(name: str, properties: dict | None = None, required: tuple = ()) -> dict:
    parameters = {"type": "object", "properties": properties or {}, "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


class Echo:
    """Sync: returns its arguments and the row's keyword arguments as JSON."""

    schema = schema("echo", {"text": {"type": "string"}, "times": {"type": "integer"}}, ("text",))
    timeout_s = 2.0

    def __init__(self, config):
        self.closed = False

    def __call__(self, arguments, **sample):
        return {"arguments": arguments, "sample": sample}

    def close(self):
        self.closed = True


class Sleeper:
    """Sync: sleeps `seconds` (blocking its thread), timeout from the config."""

    schema = schema("sleep", {"seconds": {"type": "number"}})

    def __init__(self, config):
        self.timeout_s = config.get("timeout_s", 2.0)

    def __call__(self, arguments, **sample):
        time.sleep(arguments.get("seconds", 0))
        return "slept"


class Meet:
    """Async: returns only once `parties` calls wait at once, so it proves calls run concurrently."""

    schema = schema("meet")
    timeout_s = 2.0

    def __init__(self, config):
        self.barrier = None
        self.parties = config.get("parties", 2)

    async def __call__(self, arguments, **sample):
        self.barrier = self.barrier or asyncio.Barrier(self.parties)
        await self.barrier.wait()
        return "met"


class Fail:
    schema = schema("fail", {"how": {"type": "string", "enum": ["tool", "bug"]}}, ("how",))

    def __init__(self, config):
        pass

    def __call__(self, arguments, **sample):
        if arguments["how"] == "tool":
            raise ToolError("the lookup table has no such key")
        return 1 / 0


def registry() -> Registry:
    reg = Registry("tools")
    for name, factory in {**minirl_tools(), "echo": Echo, "sleep": Sleeper, "meet": Meet, "fail": Fail}.items():
        reg.add(name, factory, "test")
    return reg


def toolset(tmp_path, entries: list, **limits) -> ToolSet:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": entries}))
    return ToolSet.from_config(MultiTurnConfig(tool_config_path=str(path), **limits), registry())


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, json.dumps({"name": name, "arguments": arguments}))


def run(tools: ToolSet, calls: list, tools_kwargs=None):
    try:
        return asyncio.run(tools.call_all(calls, tools_kwargs))
    finally:
        tools.close()


# --- truncate ----------------------------------------------------------------------------------


@FAST
@given(st.text(max_size=300), st.integers(1, 200), st.sampled_from(["left", "right", "middle"]))
def test_truncate_keeps_at_most_limit_chars_and_the_right_end(text, limit, side):
    out = truncate(text, limit, side)
    if len(text) <= limit:
        assert out == text
        return
    head, marker_and_tail = out.split("...(truncated ", 1)
    count, tail = marker_and_tail.split(" chars)...", 1)
    assert len(head) + len(tail) <= limit
    assert int(count) == len(text) - len(head) - len(tail)
    assert text.startswith(head) and text.endswith(tail)
    expected = {"left": (0, limit), "right": (limit, 0), "middle": (limit // 2, limit // 2)}[side]
    assert (len(head), len(tail)) == expected


def test_truncate_with_no_limit_leaves_the_text():
    assert truncate("x" * 1000, 0, "middle") == "x" * 1000


# --- the tool config file ----------------------------------------------------------------------


def test_the_example_config_builds_both_built_ins_in_order():
    cfg = MultiTurnConfig(tool_config_path=str(EXAMPLE))
    tools = ToolSet.from_config(cfg, registry())
    assert tools.names == ["calculator", "python"]
    assert [s["function"]["name"] for s in tools.schemas] == ["calculator", "python"]
    assert tools.schemas[1]["function"]["parameters"]["required"] == ["code"]


def test_a_json_config_and_a_dotted_class_name_work(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [{"class_name": f"{__name__}.Echo", "config": {"type": "native"}}]}))
    tools = ToolSet.from_config(MultiTurnConfig(tool_config_path=str(path)), registry())
    assert tools.names == ["echo"]


def test_an_empty_path_means_no_tools():
    tools = ToolSet.from_config(MultiTurnConfig(), registry())
    assert tools.names == [] and tools.schemas == []


def test_tool_schema_in_the_config_overrides_the_tools_own(tmp_path):
    renamed = schema("shout", {"text": {"type": "string"}}, ("text",))
    tools = toolset(tmp_path, [{"class_name": "echo", "tool_schema": renamed}])
    assert tools.names == ["shout"] and tools.schemas == [renamed]
    [outcome] = run(tools, [call("shout", text="hi")])
    assert outcome.status == "ok"


@pytest.mark.parametrize(
    "content, expected",
    [
        ("[1, 2]", "must be a mapping with a `tools` list, got array"),
        ("tools: {a: 1}", "must be a mapping with a `tools` list"),
        ("tools: [calculator]", "tools[0]: an entry must be a mapping"),
        (
            "tools: [{class_name: calculater}]",
            "tools[0].class_name = 'calculater': no such tool (did you mean 'calculator'?)",
        ),
        ("tools: [{config: {}}]", "tools[0].class_name is missing"),
        ("tools: [{class_name: echo, tool_shema: {}}]", "tools[0].tool_shema: not a key of a tool entry"),
        ("tools: [{class_name: echo}, {class_name: echo}]", "tools[1]: the tool name 'echo' is taken by tools[0]"),
        (
            "tools: [{class_name: echo, tool_schema: {type: function, function: {description: x}}}]",
            "tools[0].tool_schema has no function.name",
        ),
        ("tools: [{class_name: echo, config: {type: mcp}}]", "MCP tools are not supported yet"),
        (
            "tools: [{class_name: python, config: {timeout_s: -1}}]",
            "tools[0]: config.timeout_s = -1: tool 'python' expects a number > 0",
        ),
        ("tools: [{class_name: python, config: {memory: 9}}]", "config.memory: tool 'python' has no such setting"),
        ("tools: [{class_name: no_such_pkg.Tool}]", "cannot import 'no_such_pkg'"),
        ("tools: [: bad", "not valid YAML at line 1, column 9"),
    ],
)
def test_config_mistakes_name_the_file_the_entry_and_the_fix(tmp_path, content, expected):
    path = tmp_path / "tools.yaml"
    path.write_text(content)
    with pytest.raises(UserError) as info:
        ToolSet.from_config(MultiTurnConfig(tool_config_path=str(path)), registry())
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_a_missing_file_names_the_key():
    with pytest.raises(UserError, match="rollout.multi_turn.tool_config_path = 'nope.yaml': no such file"):
        ToolSet.from_config(MultiTurnConfig(tool_config_path="nope.yaml"), registry())


def test_limits_are_checked(tmp_path):
    with pytest.raises(UserError, match="tool_response_truncate_side = 'top'"):
        ToolSet.from_config(MultiTurnConfig(tool_response_truncate_side="top"), registry())
    with pytest.raises(UserError, match="max_parallel_calls = 0"):
        ToolSet.from_config(MultiTurnConfig(max_parallel_calls=0), registry())


# --- calls -------------------------------------------------------------------------------------


def test_unknown_tools_and_malformed_calls_become_messages(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "echo"}, {"class_name": "calculator"}], max_parallel_calls=4)
    bad = ToolCall("", None, "{oops", "the call is not valid JSON (Expecting value at line 1 column 2)")
    unknown, malformed = run(tools, [call("search", q="x"), bad])
    assert (unknown.status, unknown.text) == (
        "unknown_tool",
        'Error: unknown tool "search"; available tools: echo, calculator',
    )
    assert (malformed.status, malformed.text) == ("bad_call", f"Error: {bad.error}")


def test_arguments_are_checked_against_the_schema_before_the_call(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "echo"}], max_parallel_calls=3)
    missing, wrong, fine = run(tools, [call("echo", times=2), call("echo", text=3), call("echo", text="a", times=2.0)])
    assert (missing.status, missing.text) == (
        "bad_call",
        'Error: bad arguments for tool "echo": argument "text" is required',
    )
    assert wrong.text == 'Error: bad arguments for tool "echo": argument "text" must be string, got integer 3'
    assert fine.status == "ok"


def test_the_schema_checker_covers_nested_values_enums_and_booleans():
    params = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "mode": {"enum": ["a", "b"]},
            "xs": {"type": "array", "items": {"type": "number"}},
            "opt": {"type": "object", "properties": {"deep": {"type": "boolean"}}, "additionalProperties": False},
        },
    }
    assert check_arguments({"n": 3, "mode": "a", "xs": [1, 2.5], "opt": {"deep": True}}, params) == ""
    assert check_arguments({"n": True}, params) == 'argument "n" must be integer, got boolean true'
    assert check_arguments({"mode": "c"}, params) == 'argument "mode" must be one of ["a", "b"], got string "c"'
    assert check_arguments({"xs": [1, "2"]}, params) == 'argument "xs[1]" must be number, got string "2"'
    assert check_arguments({"opt": {"deep": 1}}, params) == 'argument "opt.deep" must be boolean, got integer 1'
    assert check_arguments({"opt": {"wide": 1}}, params).startswith('argument "opt.wide" is not a parameter')
    assert check_arguments({"anything": 1}, None) == ""


def test_a_tool_raising_becomes_an_error_message(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "fail"}], max_parallel_calls=2)
    mine, bug = run(tools, [call("fail", how="tool"), call("fail", how="bug")])
    assert (mine.status, mine.text) == ("error", 'Error: tool "fail" failed: the lookup table has no such key')
    assert (bug.status, bug.text) == ("error", 'Error: tool "fail" failed: ZeroDivisionError: division by zero')


def test_a_slow_sync_tool_times_out_without_blocking_the_event_loop(tmp_path):
    """The tool sleeps in its thread; a counter on the loop keeps ticking meanwhile. Run inline,
    the sleep would block the loop: no ticks, and wait_for could not time it out."""
    tools = toolset(tmp_path, [{"class_name": "sleep", "config": {"timeout_s": 0.3}}])
    ticks = 0

    async def main():
        nonlocal ticks
        calls = asyncio.ensure_future(tools.call_all([call("sleep", seconds=1.5)]))
        while not calls.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return calls.result()

    try:
        [outcome] = asyncio.run(main())
    finally:
        tools.close()
    assert (outcome.status, outcome.text) == ("timeout", 'Error: tool "sleep" timed out after 0.3 s')
    assert ticks >= 3


def test_async_tools_run_concurrently_and_extra_calls_are_skipped(tmp_path):
    """Two Meet calls each wait for the other: they only finish if they run at the same time."""
    tools = toolset(tmp_path, [{"class_name": "meet"}], max_parallel_calls=2)
    outcomes = run(tools, [call("meet"), call("meet"), call("meet")])
    assert [o.status for o in outcomes] == ["ok", "ok", "skipped"]
    assert [o.text for o in outcomes[:2]] == ["met", "met"]
    assert "at most 2 tool call(s) run per turn" in outcomes[2].text


def test_an_async_tool_times_out(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "meet", "config": {"parties": 3}}], max_parallel_calls=2)
    outcomes = run(tools, [call("meet"), call("meet")])
    assert [o.status for o in outcomes] == ["timeout", "timeout"]


def test_tools_kwargs_reach_the_tool_create_kwargs_first(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "echo"}], max_parallel_calls=2)
    verl_layout = {"echo": {"create_kwargs": {"ground_truth": "4"}, "execute_kwargs": {"x": 1}}}
    [out] = run(tools, [call("echo", text="a")], verl_layout)
    assert json.loads(out.text) == {"arguments": {"text": "a"}, "sample": {"ground_truth": "4"}}
    tools = toolset(tmp_path, [{"class_name": "echo"}])
    [out] = run(tools, [call("echo", text="a")], {"echo": {"key": "k7"}, "other": {"z": 1}})
    assert json.loads(out.text)["sample"] == {"key": "k7"}


def test_long_results_are_truncated_on_the_configured_side(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "echo"}], max_tool_response_length=20, tool_response_truncate_side="left")
    [out] = run(tools, [call("echo", text="x" * 100)])
    assert out.text.startswith("(truncated)...") and out.text.endswith('"sample": {}}')


def test_close_reaches_the_tools(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "echo"}])
    echo = tools._entries["echo"].tool
    tools.close()
    assert echo.closed


# --- calculator --------------------------------------------------------------------------------


def test_the_calculator_is_exact_through_the_toolset(tmp_path):
    tools = toolset(tmp_path, [{"class_name": "calculator"}], max_parallel_calls=4)
    expressions = ["1/3*3", "2**100", "7/2", "(1 - 3) // 2"]
    outcomes = run(tools, [call("calculator", expression=e) for e in expressions])
    assert [o.text for o in outcomes] == ["1", str(2**100), "3.5", "-1"]


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1/0", "division by zero"),
        ("2^3", "use ** for powers"),
        ("__import__('os')", "unsupported character"),
        ("2 ** 5000", "exponent 5000 is beyond"),
        ("99 ** 999 * 99 ** 999 * 99 ** 999", f"more than {MAX_DIGITS} digits"),
        ("(-8) ** 0.5", "no real value"),
        ("1 +", "cannot parse"),
        ("1" * 1001, "longer than 1000"),
        ("-" * 900 + "1", ""),
    ],
)
def test_the_calculator_refuses_with_a_clear_message(expression, message):
    if expression.startswith("-" * 900):
        assert evaluate(expression) == 1  # 900 minus signs: deep, but within the bounds
        return
    with pytest.raises(ToolError, match=message.replace("*", r"\*")):
        evaluate(expression)


@pytest.mark.parametrize(
    "value, text",
    [
        (Fraction(1, 3), "0.333333333333"),
        (Fraction(-7, 8), "-0.875"),
        (Fraction(10**20), str(10**20)),
        (Fraction(1, 10**10), "1e-10"),
    ],
)
def test_numbers_print_as_integers_or_twelve_significant_digits(value, text):
    assert format_number(value) == text


def test_a_fractional_power_is_computed_in_floating_point():
    assert format_number(evaluate("2 ** 0.5")) == "1.41421356237"


EXACT = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: Fraction(a // b),
    "%": lambda a, b: a % b,
}


@st.composite
def expressions(draw, depth=3):
    """(source text, exact value or None for a division by zero) of a random expression tree."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        whole, millis = draw(st.integers(0, 10**6)), draw(st.integers(0, 999))
        if draw(st.booleans()):
            return str(whole), Fraction(whole)
        return f"{whole}.{millis:03d}", whole + Fraction(millis, 1000)
    op = draw(st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "neg"]))
    left_text, left = draw(expressions(depth - 1))
    if op == "neg":
        return f"-({left_text})", None if left is None else -left
    if op == "**":
        exponent = draw(st.integers(-3, 4))
        value = None if left is None or (left == 0 and exponent < 0) else left**exponent
        return f"({left_text}) ** {exponent}", value
    right_text, right = draw(expressions(depth - 1))
    value = None
    if left is not None and right is not None and not (op in ("/", "//", "%") and right == 0):
        value = EXACT[op](left, right)
    return f"({left_text}) {op} ({right_text})", value


@FAST
@given(expressions())
def test_random_expressions_equal_fraction_arithmetic(case):
    text, expected = case
    if expected is None:
        with pytest.raises(ToolError, match="division by zero"):
            evaluate(text)
    else:
        assert evaluate(text) == expected


@FAST
@given(st.one_of(st.text(max_size=80), st.text(alphabet="0123456789+-*/%().eE_ ", max_size=80)))
def test_junk_never_crashes_the_calculator(text):
    try:
        value = evaluate(text)
    except ToolError:
        return
    assert isinstance(value, Fraction)
    assert isinstance(format_number(value), str)
