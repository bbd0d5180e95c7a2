"""Tool-call parsing: the model's turn text -> (its text without the calls, the calls in order),
and a call's arguments checked against the tool's JSON schema (check_arguments).

`rollout.multi_turn.format` names a parser in PARSERS; only `hermes` exists today
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as the Qwen and Hermes templates
teach). Where it departs from verl's parser on purpose (a malformed block comes back as an error
the model sees; calls inside <think>...</think> are not run, read tag by tag): docs/agents.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TAG = re.compile("|".join(re.escape(t) for t in (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE)))
_FORMAT_HINT = 'write <tool_call>{"name": "...", "arguments": {...}}</tool_call>'


@dataclass
class ToolCall:
    """One call the model wrote. `name` is "" and `arguments` None when it could not be parsed;
    `error` says why, as a phrase the model can read ("" when the call is fine)."""

    name: str
    arguments: dict | None
    raw: str  # the text between the tags
    error: str = ""
    closed: bool = True  # False: the text ended inside the call (no closing tag yet)


def parse_hermes(text: str, thinking: bool = False) -> tuple[str, list[ToolCall]]:
    """(the text with every <tool_call>...</tool_call> block removed, stripped; the calls in order).

    Malformed blocks are returned as calls with `error` set, not dropped; an unclosed <tool_call>
    at the end is one malformed call. Calls inside <think>...</think> are ignored; thinking: the
    text starts inside a thought (the prompt opened it)."""
    spans = _call_spans(text, thinking)
    calls = [_parse_call(text[start:end], closed) for (_, start, end, _, closed) in spans]
    kept, cursor = [], 0
    for block_start, _, _, block_end, _ in spans:
        kept.append(text[cursor:block_start])
        cursor = block_end
    kept.append(text[cursor:])
    return "".join(kept).strip(), calls


def _call_spans(text: str, thinking: bool) -> list[tuple[int, int, int, int, bool]]:
    """(block start, body start, body end, block end, closed) of each call outside thinking.

    A left-to-right scan over the four tags: inside a call only a </tool_call> outside its JSON
    strings counts, inside a thought only </think>. A stray </think> outside both closes a thought
    the prompt opened: the calls before it were reasoning. Other stray tags stay in the text."""
    spans, state, opened, seen_think = [], "think" if thinking else "text", 0, thinking
    for match in _TAG.finditer(text):
        tag = match.group()
        if state == "call":
            if tag == CALL_CLOSE and not _inside_json_string(text[opened + len(CALL_OPEN) : match.start()]):
                spans.append((opened, opened + len(CALL_OPEN), match.start(), match.end(), True))
                state = "text"
        elif state == "think":
            state = "text" if tag == THINK_CLOSE else state
        elif tag == CALL_OPEN:
            state, opened = "call", match.start()
        elif tag == THINK_OPEN:
            state, seen_think = "think", True
        elif tag == THINK_CLOSE and not seen_think:
            spans, seen_think = [], True
    if state == "call":
        spans.append((opened, opened + len(CALL_OPEN), len(text), len(text), False))
    return spans


def _inside_json_string(body: str) -> bool:
    """Whether the end of `body` (a call's JSON so far) is inside a string literal."""
    inside, escaped = False, False
    for char in body:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


def _parse_call(body: str, closed: bool) -> ToolCall:
    """One call's body -> ToolCall, with a readable `error` when it is malformed."""
    raw = body.strip()
    if not closed:
        return ToolCall("", None, raw, f"the call has no closing {CALL_CLOSE}; {_FORMAT_HINT}", closed=False)
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        return ToolCall("", None, raw, f"the call is not valid JSON ({exc.msg} at {where}); {_FORMAT_HINT}")
    except RecursionError:
        return ToolCall("", None, raw, f"the call's JSON is nested too deeply; {_FORMAT_HINT}")
    if not isinstance(payload, dict):
        got = json_type(payload)
        return ToolCall("", None, raw, f'the call must be a JSON object with "name" and "arguments", got {got}')
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, raw, f'the call has no "name" (a non-empty string); {_FORMAT_HINT}')
    arguments, problem = _arguments(payload.get("arguments", {}))
    return ToolCall(name, arguments, raw, problem)


def _arguments(value: object) -> tuple[dict | None, str]:
    """The call's arguments as a dict. A JSON string holding an object is accepted too (the
    OpenAI API sends arguments as a string, and models trained on it copy that)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return None, '"arguments" must be a JSON object, got a string that is not JSON'
    if not isinstance(value, dict):
        return None, f'"arguments" must be a JSON object, got {json_type(value)}'
    return value, ""


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------------------------
# arguments against the schema: the JSON-schema subset that function schemas use
# ---------------------------------------------------------------------------------------------

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "object": (dict,),
    "array": (list,),
    "boolean": (bool,),
    "null": (type(None),),
}


def check_arguments(arguments: dict, parameters: dict | None) -> str:
    """The first way the arguments break the function's `parameters` schema, naming the argument;
    "" when they fit. Checked: type, enum, required, properties, additionalProperties: false, items."""
    return _check(arguments, parameters or {}, "")


def _check(value: Any, schema: Any, where: str) -> str:
    if not isinstance(schema, dict):
        return ""
    problem = _check_type(value, schema.get("type"), where)
    if not problem and "enum" in schema and value not in schema["enum"]:
        problem = f"{_label(where)} must be one of {json.dumps(schema['enum'])}, got {_shown(value)}"
    if problem:
        return problem
    if isinstance(value, dict):
        return _check_object(value, schema, where)
    if isinstance(value, list):
        for i, item in enumerate(value):
            problem = _check(item, schema.get("items"), f"{where}[{i}]")
            if problem:
                return problem
    return ""


def _check_object(value: dict, schema: dict, where: str) -> str:
    properties = schema.get("properties") or {}
    missing = [key for key in schema.get("required") or [] if key not in value]
    if missing:
        return f"{_label(_join(where, missing[0]))} is required"
    extra = sorted(set(value) - set(properties)) if schema.get("additionalProperties") is False else []
    if extra:
        known = ", ".join(f'"{key}"' for key in properties) or "(none)"
        return f"{_label(_join(where, extra[0]))} is not a parameter; the parameters are {known}"
    for key, sub in properties.items():
        problem = _check(value[key], sub, _join(where, key)) if key in value else ""
        if problem:
            return problem
    return ""


def _check_type(value: Any, expected: Any, where: str) -> str:
    if expected is None:
        return ""
    allowed = expected if isinstance(expected, list) else [expected]
    if any(_is_type(value, name) for name in allowed):
        return ""
    return f"{_label(where)} must be {' or '.join(map(str, allowed))}, got {_shown(value)}"


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name != "boolean":
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float))
    return isinstance(value, _JSON_TYPES[name]) if name in _JSON_TYPES else True  # a type we do not check


def _label(where: str) -> str:
    return f'argument "{where}"' if where else "the arguments"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return f"{json_type(value)} {text if len(text) <= 40 else text[:37] + '...'}"


# format name -> parse(text, thinking=False) -> (text without the calls, the calls)
PARSERS: dict[str, Callable[..., tuple[str, list[ToolCall]]]] = {"hermes": parse_hermes}
