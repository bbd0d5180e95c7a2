"""verl's tool classes in a minirl tool set, unchanged: the BaseTool protocol behind an adapter.

A verl tool is a class built as cls(config=<the entry's config>, tool_schema=<an
OpenAIFunctionToolSchema, or None for the tool's own>) with async create, execute, calc_reward
and release. VerlTool runs each call as verl's tool agent loop does: create(create_kwargs=<the
row's extra_info.tools_kwargs[name].create_kwargs>), execute(instance_id, arguments,
agent_data=...), then release(instance_id), also when execute raised. execute's step reward
goes to the trajectory (the reward function's trajectory["tool_rewards"], verl's
extra_fields["tool_rewards"]); calc_reward is not called, as in verl.

agent_data is the sample's state as verl hands it to a tool: request_id, messages (the
conversation so far), tools_kwargs, metrics, and extra_fields, a dict kept for the whole
trajectory (verl's place for state shared between calls, since each call is a fresh instance).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

from minirl.errors import UserError

LIFECYCLE = ("create", "execute", "release")  # async methods the agent loop calls
SHAPE = (
    "a verl tool is a class cls(config, tool_schema) with async create(instance_id=None, **kwargs) -> "
    "instance_id or (instance_id, response), async execute(instance_id, parameters, **kwargs) -> "
    "(ToolResponse or str, reward, metrics) and async release(instance_id, **kwargs); a minirl tool is "
    "factory(config) -> a callable tool(arguments, **create_kwargs) with .schema (docs/plugins.md)"
)


@dataclass
class AgentData:
    """The part of verl's AgentData a tool may read: one per sample, alive for its trajectory."""

    request_id: str
    tools_kwargs: dict
    messages: list[dict] = field(default_factory=list)
    extra_fields: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


@dataclass
class ToolReply:
    """A tool's answer with verl's step reward (None: the tool gave none)."""

    text: str
    reward: float | None = None


class SchemaView(dict):
    """A tool schema dict read as verl reads its OpenAIFunctionToolSchema: schema.function.name,
    and model_dump() for the plain dict. Given to tools when verl itself is not installed."""

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key not in self:
            raise AttributeError(f"the tool schema has no {key!r}")
        value = self[key]
        return SchemaView(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> dict:
        return copy.deepcopy(dict(self))


def is_verl_tool(factory: Any) -> bool:
    """A class whose constructor takes `tool_schema`: verl's BaseTool shape, built by the adapter."""
    if not inspect.isclass(factory):
        return False
    try:
        return "tool_schema" in inspect.signature(factory.__init__).parameters
    except (TypeError, ValueError):
        return False


def build_verl_tool(cls: type, config: dict, schema: dict | None, where: str) -> "VerlTool":
    """cls(config=config, tool_schema=...) wrapped for the ToolSet; UserError naming `where` when
    the class lacks the lifecycle or its schema."""
    missing = [m for m in LIFECYCLE if not inspect.iscoroutinefunction(getattr(cls, m, None))]
    if missing:
        raise UserError(
            f"{where}: {cls.__name__} takes a tool_schema like verl's BaseTool but has no async "
            f"{', '.join(missing)}; {SHAPE}"
        )
    tool = cls(config=config, tool_schema=None if schema is None else schema_object(schema))
    return VerlTool(tool, schema if schema is not None else _own_schema(tool, where), config)


def schema_object(schema: dict) -> Any:
    """verl's OpenAIFunctionToolSchema when verl is installed, else a SchemaView of the dict."""
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema
    except ImportError:
        return SchemaView(copy.deepcopy(schema))
    return OpenAIFunctionToolSchema.model_validate(schema)


def _own_schema(tool: Any, where: str) -> dict:
    """The schema a verl tool built for itself (tool_schema or get_openai_tool_schema()), as a dict."""
    schema = getattr(tool, "tool_schema", None)
    if schema is None and callable(getattr(tool, "get_openai_tool_schema", None)):
        schema = tool.get_openai_tool_schema()
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    if isinstance(schema, dict):
        return schema
    raise UserError(
        f"{where}: the entry has no tool_schema and the tool gives none of its own (tool_schema or "
        "get_openai_tool_schema()); add a tool_schema: {type: function, function: {name, description, parameters}}"
    )


class VerlTool:
    """One verl tool instance as the ToolSet calls it: async, with verl's per-call lifecycle."""

    takes_agent_data = True

    def __init__(self, tool: Any, schema: dict, config: dict):
        self.tool, self.schema = tool, schema
        if "timeout_s" in config:  # minirl's key; verl's own tools have none and ignore it
            self.timeout_s = config["timeout_s"]

    async def __call__(self, arguments: dict, agent_data: AgentData | None = None, **create_kwargs: Any) -> ToolReply:
        instance_id = None
        try:
            created = await self.tool.create(create_kwargs=create_kwargs)
            instance_id = created[0] if isinstance(created, tuple) else created
            result = await self.tool.execute(instance_id, arguments, agent_data=agent_data)
        finally:
            if instance_id is not None:
                await self.tool.release(instance_id)
        return reply_of(result)

    def close(self) -> None:
        closer = getattr(self.tool, "close", None)
        if callable(closer):
            closer()


def reply_of(result: Any) -> ToolReply:
    """execute's answer -> ToolReply: (ToolResponse or str, reward, metrics), or a bare response."""
    response, reward = (
        (result[0], result[1] if len(result) > 1 else None) if isinstance(result, tuple) else (result, None)
    )
    if getattr(response, "image", None) or getattr(response, "video", None):
        raise ValueError("the tool answered with an image or video; minirl's agent loop passes text only")
    text = response if isinstance(response, str) or response is None else getattr(response, "text", None)
    if text is not None and not isinstance(text, str):
        raise ValueError(f"the tool's response text is a {type(text).__name__}, not a string")
    return ToolReply(text or "", None if reward is None else float(reward))
