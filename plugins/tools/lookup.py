"""lookup: the synthetic tool task's key-value table of one row (scripts/make_data.py, task lookup).

Each row of the task names a key in its prompt and holds the key's value, a random digit, where
only this tool can see it: extra_info.tools_kwargs.lookup.create_kwargs = {"key": "k37",
"value": "7"} (verl's per-row tool arguments). The model cannot know the digit without calling
the tool, so a policy that answers right has learnt to call it. `key` is optional in the call:
the tiny-agent tokenizer has one token for the argument-free call (LOOKUP_CALL), which is how a
random-init policy finds it.

config.repeat (default 1) states the value that many times in the reply ("7 7 7" for 3).
Why: a random-init model's attention is near uniform over its context, so one digit among ~120
tokens barely reaches the answer position, and reinforcement learning alone did not teach the
tiny model to copy it (the greedy score stayed at guessing); the more copies, the faster it
learns to read the reply (examples/tools/lookup.yaml states 64; docs/agents.md has the curves).
"""

from __future__ import annotations

from minirl.agent.tools import ToolError, tool_options

SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the value of the key the prompt names; returns the value (a digit).",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the key, for example k37 (optional)"}},
            "required": [],
        },
    },
}


class Lookup:
    """The lookup tool (config: timeout_s, default 5; repeat, default 1)."""

    name = "lookup"

    def __init__(self, config: dict):
        options = tool_options(config, {"timeout_s": 5.0, "repeat": 1}, self.name)
        self.timeout_s, self.repeat = options["timeout_s"], options["repeat"]
        self.schema = config.get("tool_schema") or SCHEMA

    def __call__(self, arguments: dict, key: str | None = None, value: str | None = None, **sample) -> str:
        """The row's value (`repeat` times) when the call gives no key or the row's key; else a
        ToolError the model reads."""
        if value is None:
            raise ToolError(
                "this prompt has no table to look up (its row lacks extra_info.tools_kwargs.lookup.create_kwargs.value)"
            )
        asked = arguments.get("key")
        if asked is not None and asked != key:
            raise ToolError(f'no key "{asked}"; the prompt names the key')
        return " ".join([str(value)] * self.repeat)
