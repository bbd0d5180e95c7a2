"""Token ids for the messages an agent loop appends (tool results, user turns), each tokenized once.

The trajectory is never rebuilt by re-tokenizing text: the model's tokens stay exactly as sampled,
and only the new messages are rendered, as the suffix the chat template adds after an assistant
turn. The suffix is found by rendering a fixed conversation with and without them; it starts
right after the assistant's content, so the template's turn separator (Qwen's "\n" after
<|im_end|>, which verl's agent loop lost: verl#6501) is part of it. The piece of it the model
already sampled (the end-of-turn token it stopped on) is not repeated.
"""

from __future__ import annotations

from typing import Any

from minirl.agent.parser import THINK_CLOSE, THINK_OPEN
from minirl.errors import UserError

_USER, _ASSISTANT = "minirl-user-0", "minirl-assistant-0"  # placeholder contents of the fixed conversation
_TOOL = "minirl-tool-0"


class ChatTokens:
    """The tokenizer's view an agent loop needs: decode turns, encode appended messages."""

    def __init__(self, tokenizer: Any, call_close: str = "</tool_call>", template: str = "the tokenizer"):
        self.tokenizer = tokenizer
        self.template = template  # where the chat template comes from, for messages (a config key = value)
        self.stop_ids = tuple(_single_tokens_ending_with(tokenizer, call_close))
        self._suffixes: dict[tuple[tuple[str, str], ...], str] = {}  # rendered once per distinct message list
        self._thinking_prompt: str | None = None  # the generation prompt if it opens a thought, else ""

    def check_tool_turns(self) -> None:
        """Refuse a chat template that drops tool messages (it renders no branch for role "tool"):
        the model would never see a tool's answer, and nothing would say so."""
        suffix = self._suffix((("tool", _TOOL),))
        if _TOOL not in suffix:
            raise UserError(
                f"{self.template}: its chat template does not render tool messages (a {{'role': 'tool'}} "
                f"message after an assistant turn renders as {suffix!r}), so the model would never read a "
                "tool's answer; use a tokenizer whose chat template has a tool branch (model.tokenizer), "
                "or leave rollout.multi_turn.tool_config_path empty"
            )

    def shows_tools(self, schemas: list[dict]) -> bool:
        """Whether the template renders `tools=` into the prompt (Qwen2.5's does, R1-Distill's not)."""
        messages = [{"role": "user", "content": _USER}]
        return self._render(messages, False, tools=schemas) != self._render(messages, generation_prompt=False)

    def opens_thought(self, ids: list[int]) -> bool:
        """Whether these ids (a prompt, or appended messages) end with a generation prompt that
        opens a reasoning block (R1-Distill's <｜Assistant｜><think>\\n): the next turn then starts
        inside a thought. Text inside messages (a tool's output that shows a <think>) does not count."""
        if self._thinking_prompt is None:
            messages = [{"role": "user", "content": _USER}]
            prompt = self._render(messages, True)[len(self._render(messages, False)) :]
            opens = prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
            self._thinking_prompt = prompt if opens else ""
        if not self._thinking_prompt:
            return False
        tail = len(self.tokenizer.encode(self._thinking_prompt, add_special_tokens=False)) + 1
        return self.decode(list(ids[-tail:])).endswith(self._thinking_prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_text(self, ids: list[int]) -> str:
        """Without special tokens: what a reward function reads."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        """Token ids of `messages` (tool or user messages) after an assistant turn that ended on
        last_token, up to and including the next assistant turn's generation prompt."""
        suffix = self._suffix(tuple((m["role"], m["content"]) for m in messages))
        if last_token is not None:
            ended = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if ended and suffix.startswith(ended):  # the model already sampled the end of its turn
                suffix = suffix[len(ended) :]
        return list(self.tokenizer.encode(suffix, add_special_tokens=False))

    def _suffix(self, messages: tuple[tuple[str, str], ...]) -> str:
        if messages not in self._suffixes:
            if len(self._suffixes) > 4096:
                self._suffixes.clear()
            self._suffixes[messages] = self._render_suffix(messages)
        return self._suffixes[messages]

    def _render_suffix(self, messages: tuple[tuple[str, str], ...]) -> str:
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        added = [{"role": role, "content": content} for role, content in messages]
        before = self._render(base, generation_prompt=False)
        after = self._render(base + added, generation_prompt=True)
        cut = before.rfind(_ASSISTANT)
        if cut < 0 or after[: cut + len(_ASSISTANT)] != before[: cut + len(_ASSISTANT)]:
            raise UserError(
                f"{self.template}: its chat template renders earlier turns differently once tool or user "
                "messages follow them, so appended messages cannot be tokenized on their own (token in, "
                "token out); use a chat template that keeps the conversation's prefix (model.tokenizer)"
            )
        return after[cut + len(_ASSISTANT) :]

    def _render(self, messages: list[dict], generation_prompt: bool, **kwargs: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as exc:
            raise UserError(
                f"{self.template}: its chat template cannot render {[m['role'] for m in messages]} "
                f"({type(exc).__name__}: {exc}); multi-turn rollouts need a template with tool messages"
            ) from exc


def _single_tokens_ending_with(tokenizer: Any, text: str) -> list[int]:
    """Ids of the added tokens whose text ends with `text` (Qwen's </tool_call> is one): a turn
    stops there, since the model has nothing to add after a complete call but its end token."""
    added = getattr(tokenizer, "get_added_vocab", lambda: {})()
    return sorted(i for tok, i in added.items() if tok.endswith(text))
