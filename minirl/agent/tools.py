"""Running the tools the model calls: the tool config file -> a ToolSet; one turn's calls -> outcomes.

ToolSet.from_config reads rollout.multi_turn.tool_config_path (verl's shape: `tools:` entries with
class_name, config, tool_schema) once per run and builds each tool from the `tools` registry (the
minirl_tools hook) or a dotted import path. ToolSet.call_all runs one turn's calls concurrently.
Every failure (a malformed call, an unknown tool, arguments that do not fit the schema, the tool
raising, a timeout) becomes a ToolOutcome whose text the model reads: a bad call is something the
policy can learn from, never a crash of the run.

Sync tools run on the ToolSet's worker threads and async tools on the event loop, both under the
tool's timeout_s, so a slow tool never blocks the loop and other samples keep decoding meanwhile.
A sync tool that times out keeps its thread until it returns (Python cannot stop a thread, and
the process waits for it at exit); its answer is dropped. A tool that may hang for good should be
async, or run its work in a process it can kill, as the python tool does.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from minirl.agent.parser import ToolCall, check_arguments, json_type
from minirl.agent.verl_tools import SHAPE, AgentData, ToolReply, build_verl_tool, is_verl_tool
from minirl.errors import UserError, describe, reraise_if_debug, wrapped

__all__ = [
    "ToolCall",
    "ToolEntry",
    "ToolError",
    "ToolOutcome",
    "ToolSet",
    "tool_options",
    "truncate",
    "truncate_response",
]

STATUSES = ("ok", "error", "timeout", "bad_call", "unknown_tool", "skipped")
TRUNCATE_SIDES = ("left", "right", "middle")
DEFAULT_TIMEOUT_S = 30.0  # for a tool that does not say its own timeout_s
TOOL_THREADS = 32  # sync tools running at once, over all samples
CONFIG_KEY = "rollout.multi_turn.tool_config_path"
ENTRY_KEYS = ("class_name", "config", "tool_schema")


class ToolError(Exception):
    """Raised by a tool for a failure the model should read as is (no exception type shown)."""


@dataclass
class ToolOutcome:
    """What one call gave: the text the model sees (already truncated) and how it went."""

    name: str
    text: str
    status: str  # one of STATUSES
    latency_s: float
    reward: float | None = None  # a verl tool's step reward


def truncate(text: str, limit: int, side: str) -> str:
    """At most `limit` characters of text plus a marker "...(truncated N chars)..." where it cut.
    side "left": cut the head, keep the tail; "right": keep the head, cut the tail; "middle": keep
    limit // 2 characters of each end. limit <= 0: unchanged."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {TRUNCATE_SIDES}, got {side!r}")
    head = {"left": 0, "right": limit, "middle": limit // 2}[side]
    tail = {"left": limit, "right": 0, "middle": limit // 2}[side]
    marker = f"...(truncated {len(text) - head - tail} chars)..."
    return text[:head] + marker + text[len(text) - tail :]


def truncate_response(text: str, limit: int, side: str) -> str:
    """A tool result cut to rollout.multi_turn.max_tool_response_length characters as verl 0.8 and
    later cut it, markers included: "left" drops the head, "(truncated)..." + the last `limit`
    characters; "right" drops the tail, the first `limit` + "...(truncated)"; "middle" keeps
    limit // 2 of each end around "...(truncated)...". limit <= 0: unchanged."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - limit :]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2  # verl's text[-half:] keeps all of the text at half = 0; this keeps none
    return text[:half] + "...(truncated)..." + text[len(text) - half :]


def tool_options(config: Mapping, defaults: Mapping[str, Any], tool: str) -> dict:
    """A tool's settings from its config entry: `defaults`' keys, each of its default's type (an
    int where a float is expected is fine) and > 0 when a number. The file's own keys `type` and
    `tool_schema` pass through unchecked; any other key is an error naming the known ones."""
    unknown = sorted(set(config) - set(defaults) - {"type", "tool_schema"})
    if unknown:
        known = ", ".join(sorted(defaults)) or "(none)"
        raise UserError(f"config.{unknown[0]}: tool {tool!r} has no such setting; its settings: {known}")
    return {key: _option(config.get(key, default), default, key, tool) for key, default in defaults.items()}


def _option(value: Any, default: Any, key: str, tool: str) -> Any:
    """One checked setting: a number > 0 where the default is a number (an int where a float is
    expected is fine), else a value of the default's type."""
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        if type(value) is not type(default):
            raise UserError(f"config.{key} = {value!r}: tool {tool!r} expects a {type(default).__name__}")
        return value
    expected = (int,) if isinstance(default, int) else (int, float)
    if isinstance(value, bool) or not isinstance(value, expected) or value <= 0:
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise UserError(f"config.{key} = {value!r}: tool {tool!r} expects {kind} > 0")
    return type(default)(value)


@dataclass
class ToolEntry:
    """One tool as the ToolSet runs it: the object, the name and schema the model sees (the
    config's tool_schema when it gives one, else the tool's own), its timeout, and how to call it."""

    tool: Any
    name: str
    schema: dict
    timeout_s: float
    is_async: bool
    takes_agent_data: bool = False  # a verl tool: called with agent_data=, the sample's state

    @classmethod
    def of(cls, tool: Any, schema: dict | None = None, where: str = "tool") -> "ToolEntry":
        """An entry for `tool`, checking its schema and timeout (UserError naming `where`)."""
        schema = schema if schema is not None else getattr(tool, "schema", None)
        _check_schema(schema, f"{where}: the schema")
        timeout = getattr(tool, "timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise UserError(f"{where}: timeout_s = {timeout!r}; a tool's timeout_s must be a number of seconds > 0")
        is_async = inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(type(tool).__call__)
        takes_agent_data = bool(getattr(tool, "takes_agent_data", False))
        return cls(tool, schema["function"]["name"], schema, float(timeout), is_async, takes_agent_data)


class ToolSet:
    """The tools of one run: built once from the tool config file and the `tools` registry."""

    def __init__(
        self,
        entries: Sequence[ToolEntry] = (),
        max_parallel_calls: int = 1,
        max_tool_response_length: int = 256,
        tool_response_truncate_side: str = "middle",
    ):
        self._entries = {entry.name: entry for entry in entries}
        self.names: list[str] = [entry.name for entry in entries]
        self.schemas: list[dict] = [entry.schema for entry in entries]  # for the chat template, in config order
        self.max_parallel_calls = max_parallel_calls
        self.max_chars = max_tool_response_length
        self.side = tool_response_truncate_side
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, multi_turn_cfg: Any, registry: Any) -> "ToolSet":
        """multi_turn_cfg: rollout.multi_turn; registry: name -> ToolFactory (pm["tools"]).
        An empty tool_config_path gives no tools."""
        _check_limits(multi_turn_cfg)
        path = multi_turn_cfg.tool_config_path
        entries = _load_entries(path, registry) if path else []
        return cls(
            entries,
            multi_turn_cfg.max_parallel_calls,
            multi_turn_cfg.max_tool_response_length,
            multi_turn_cfg.tool_response_truncate_side,
        )

    async def call_all(
        self, calls: list[ToolCall], tools_kwargs: Mapping | None = None, agent_data: AgentData | None = None
    ) -> list[ToolOutcome]:
        """The outcome of each call, in call order. The first max_parallel_calls run concurrently,
        the rest are skipped with a message. Never raises. tools_kwargs: the row's
        extra_info.tools_kwargs ({tool name: {"create_kwargs": {...}} or {...}}, verl's layout);
        agent_data: the sample's state, for verl tools."""
        limit, kwargs = self.max_parallel_calls, tools_kwargs or {}
        ran = await asyncio.gather(*(self._call_one(call, kwargs, agent_data) for call in calls[:limit]))
        return list(ran) + [self._skipped(call) for call in calls[limit:]]

    def close(self) -> None:
        """Let go of the worker threads and of whatever the tools hold (their optional close())."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for entry in self._entries.values():
            closer = getattr(entry.tool, "close", None)
            if callable(closer):
                closer()

    async def _call_one(self, call: ToolCall, tools_kwargs: Mapping, agent_data: AgentData | None) -> ToolOutcome:
        start = time.perf_counter()
        status, result = await self._run(call, tools_kwargs, agent_data)
        text = truncate_response(_as_text(result), self.max_chars, self.side)
        reward = result.reward if isinstance(result, ToolReply) else None
        return ToolOutcome(call.name, text, status, time.perf_counter() - start, reward)

    async def _run(self, call: ToolCall, tools_kwargs: Mapping, agent_data: AgentData | None) -> tuple[str, Any]:
        """(status, text) of one call; every failure is a status and a message, never an exception."""
        if call.error:
            return "bad_call", f"Error: {call.error}"
        entry = self._entries.get(call.name)
        if entry is None:
            available = ", ".join(self.names) or "(none)"
            return "unknown_tool", f'Error: unknown tool "{call.name}"; available tools: {available}'
        problem = check_arguments(call.arguments or {}, entry.schema["function"].get("parameters"))
        if problem:
            return "bad_call", f'Error: bad arguments for tool "{entry.name}": {problem}'
        kwargs = _sample_kwargs(tools_kwargs, entry.name)
        if entry.takes_agent_data:
            kwargs["agent_data"] = agent_data
        try:
            result = await asyncio.wait_for(self._invoke(entry, call.arguments or {}, kwargs), entry.timeout_s)
        except TimeoutError:
            return "timeout", f'Error: tool "{entry.name}" timed out after {entry.timeout_s:g} s'
        except ToolError as exc:
            return "error", f'Error: tool "{entry.name}" failed: {exc}'
        except Exception as exc:
            return "error", f'Error: tool "{entry.name}" failed: {describe(exc)}'
        return "ok", result

    async def _invoke(self, entry: ToolEntry, arguments: dict, kwargs: dict) -> Any:
        """Call the tool: an async one on the loop, a sync one on a worker thread."""
        if entry.is_async:
            result = entry.tool(arguments, **kwargs)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="minirl-tool")
            call = functools.partial(entry.tool, arguments, **kwargs)
            result = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        if inspect.isawaitable(result):
            result = await result
        return result

    def _skipped(self, call: ToolCall) -> ToolOutcome:
        n = self.max_parallel_calls
        text = f"Error: not run; at most {n} tool call(s) run per turn, so make at most {n} at once"
        return ToolOutcome(call.name, truncate_response(text, self.max_chars, self.side), "skipped", 0.0)


def _sample_kwargs(tools_kwargs: Mapping, name: str) -> dict:
    """The row's keyword arguments for tool `name`: its create_kwargs if given, else the mapping."""
    given = tools_kwargs.get(name) if isinstance(tools_kwargs, Mapping) else None
    if not isinstance(given, Mapping):
        return {}
    inner = given.get("create_kwargs", given)
    return dict(inner) if isinstance(inner, Mapping) else {}


def _as_text(result: Any) -> str:
    """A tool's return value as the tool message: strings as they are, JSON for dicts and lists."""
    if result is None:
        return ""
    if isinstance(result, ToolReply):
        return result.text
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)


# ---------------------------------------------------------------------------------------------
# the tool config file
# ---------------------------------------------------------------------------------------------


def _check_limits(cfg: Any) -> None:
    if cfg.tool_response_truncate_side not in TRUNCATE_SIDES:
        raise UserError(
            f"rollout.multi_turn.tool_response_truncate_side = {cfg.tool_response_truncate_side!r}: "
            f"must be one of {', '.join(TRUNCATE_SIDES)}"
        )
    if cfg.max_parallel_calls < 1:
        raise UserError(
            f"rollout.multi_turn.max_parallel_calls = {cfg.max_parallel_calls}: must be >= 1 (the tool "
            "calls run per turn)"
        )


def _load_entries(path: str, registry: Any) -> list[ToolEntry]:
    entries, index_of = [], {}
    for index, raw in enumerate(_read_tool_file(path)):
        where = f"{path}: tools[{index}]"
        entry = _build_entry(raw, registry, where)
        if entry.name in index_of:
            raise UserError(
                f"{where}: the tool name {entry.name!r} is taken by tools[{index_of[entry.name]}]; give one "
                "of them another tool_schema.function.name, or drop one entry"
            )
        index_of[entry.name] = index
        entries.append(entry)
    return entries


class ToolFileError(UserError):
    """The tool file itself is missing or unreadable: rule and fix become one line of the
    validation report, which names the key and the value itself."""

    def __init__(self, path: str, rule: str, fix: str):
        super().__init__(f"{CONFIG_KEY} = {path!r}: {rule}; {fix}")
        self.rule, self.fix = rule, fix


def _read_tool_file(path: str) -> list:
    """The `tools` list of the file (JSON for a .json file, else YAML)."""
    file = Path(path).expanduser()
    if not file.is_file():
        rule = "is a directory, not a file" if file.is_dir() else f"no such file (looked for {file.resolve()})"
        fix = (
            "write one in verl's shape, `tools: [{class_name, config, tool_schema}]` (examples/tools/tool_config.yaml "
            "is one), point the key at it, or leave the key empty for no tools"
        )
        raise ToolFileError(path, rule, fix)
    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ToolFileError(path, _unreadable(exc), "fix the file there") from exc
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list):
        got = "a mapping without a `tools` list" if isinstance(data, dict) else json_type(data)
        raise UserError(
            f"{path}: the file must be a mapping with a `tools` list, got {got}; write `tools:` and "
            "one `- class_name: ...` entry per tool"
        )
    return tools


def _unreadable(exc: Exception) -> str:
    """Why the file does not parse, with the line and column where the parser stopped."""
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.YAMLError) and mark is not None:
        problem = getattr(exc, "problem", None) or describe(exc)
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return f"cannot read it ({describe(exc)})"


def _build_entry(raw: Any, registry: Any, where: str) -> ToolEntry:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: an entry must be a mapping with {', '.join(ENTRY_KEYS)}, got {json_type(raw)}")
    if "mcp" in raw:
        raise UserError(
            f"{where}.mcp: MCP tools (verl's config.type: mcp) are not supported; wrap the server's tool in "
            "a native tool class, or drop the entry"
        )
    unknown = sorted(set(raw) - set(ENTRY_KEYS))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}: not a key of a tool entry; the keys are {', '.join(ENTRY_KEYS)}")
    class_name = raw.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise UserError(f"{where}.class_name is missing; name a registered tool or a dotted path pkg.module.Class")
    config = _entry_config(raw.get("config"), where)
    schema = raw.get("tool_schema")
    if schema is not None:
        _check_schema(schema, f"{where}.tool_schema")
    factory = _factory(class_name, registry, where)
    if is_verl_tool(factory):
        tool = _make(lambda cfg: build_verl_tool(factory, cfg, schema, where), config, where)
    else:
        tool = _make(factory, {**config, "tool_schema": schema} if schema is not None else config, where)
    return ToolEntry.of(tool, schema, f"{where} ({class_name})")


def _entry_config(config: Any, where: str) -> dict:
    if config is None:
        return {"type": "native"}
    if not isinstance(config, dict):
        raise UserError(
            f"{where}.config must be a mapping (e.g. {{type: native, timeout_s: 5}}), got {json_type(config)}"
        )
    kind = config.get("type", "native")
    if kind == "mcp":
        raise UserError(
            f"{where}.config.type = 'mcp': MCP tools are not supported yet; use a native tool (type: native)"
        )
    if kind != "native":
        raise UserError(f"{where}.config.type = {kind!r}: must be 'native'")
    return dict(config)


def _factory(class_name: str, registry: Any, where: str) -> Any:
    """A registered tool's factory, or the class or function a dotted path names."""
    if class_name in registry:
        return registry.get(class_name)
    if "." not in class_name:
        rule, fix = registry.unknown_rule_fix(class_name)
        raise UserError(f"{where}.class_name = {class_name!r}: {rule}; {fix}, or give a dotted path pkg.module.Class")
    module_name, _, attr = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        reraise_if_debug()
        fix = "check the path and that its directory is on PYTHONPATH"
        if module_name.partition(".")[0] == "verl":
            fix = "install verl (pip install verl): its tool classes run here unchanged, through an adapter"
        raise UserError(
            f"{where}.class_name = {class_name!r}: cannot import {module_name!r} ({describe(exc)}); {fix}"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(
            f"{where}.class_name = {class_name!r}: module {module_name!r} has no class or function {attr!r}"
        )
    return factory


def _make(factory: Any, config: dict, where: str) -> Any:
    try:
        return factory(config)
    except UserError as exc:
        raise UserError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from exc
    except Exception as exc:
        reraise_if_debug()
        if isinstance(exc, TypeError) and "argument" in str(exc):  # called in a shape it does not take
            raise UserError(f"{where}: building the tool failed ({describe(exc)}); {SHAPE}") from exc
        raise wrapped(f"{where}: building the tool", exc, "check the entry's config") from exc


def _check_schema(schema: Any, where: str) -> None:
    """An OpenAI function schema: {type: function, function: {name, description, parameters}}."""
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise UserError(
            f"{where} has no function.name; write {{type: function, function: {{name: ..., description: ..., "
            "parameters: {type: object, properties: {...}, required: [...]}}}"
        )
    if not isinstance(function.get("parameters", {}), dict):
        raise UserError(f"{where}: function.parameters must be a mapping (a JSON schema of type object)")
