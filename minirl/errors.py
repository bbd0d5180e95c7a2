"""The base class of every error a user can cause (config, data, model files, plugins).

The CLI prints these as one line and exits with status 2; anything else is a bug in minirl
and keeps its traceback. Errors raised by a plugin's code or while reading a model file are
wrapped (`wrapped`) so the line names the plugin or file and the original message; with
MINIRL_DEBUG=1 the original exception propagates instead, traceback and all.
"""

from __future__ import annotations

import os


class UserError(ValueError):
    """A mistake in the user's config, data or plugins; the message names where and how to fix it."""


def describe(exc: BaseException) -> str:
    """`TypeName: first line of the message`, short enough for one error line."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def wrapped(what: str, exc: BaseException, fix: str = "") -> UserError:
    """A UserError for `exc` raised by `what` (a plugin, a file); raise it `from exc` (under
    MINIRL_DEBUG=1, callers re-raise the original instead: `reraise_if_debug`)."""
    fix = f"; {fix}" if fix else ""
    return UserError(f"{what} failed: {describe(exc)}{fix} (MINIRL_DEBUG=1 shows the full traceback)")


def reraise_if_debug() -> None:
    """Inside an `except` block: let the original exception through when MINIRL_DEBUG is set."""
    if os.environ.get("MINIRL_DEBUG", "") not in ("", "0"):
        raise  # noqa: PLE0704 - re-raises the exception being handled


class Stopped(Exception):
    """The run stopped on request (SIGTERM or SIGINT) after checkpointing; not a failure of
    minirl, but not a finished run either: the process exits with `exit_code` (128 + signal)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
