"""Which SGLang version the fake plays: MINIRL_FAKE_SGLANG (0.4.10, 0.5.14 or 0.5.23).

Read at import; tests switch profiles by setting the variable and dropping `sglang*` from
sys.modules (tests/fakes/__init__.py). Modules that a version lacks raise ModuleNotFoundError on
import, exactly as the missing module would.
"""

import os

PROFILES = ("0.4.10", "0.5.14", "0.5.23")
VERSION = os.environ.get("MINIRL_FAKE_SGLANG", "0.5.23")
if VERSION not in PROFILES:
    raise ValueError(f"MINIRL_FAKE_SGLANG={VERSION!r}: the fake plays {PROFILES}")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def at_least(version: str) -> bool:
    return _key(VERSION) >= _key(version)


def require(module: str, since: str | None = None, until: str | None = None) -> None:
    """Raise ModuleNotFoundError unless `module` exists in the played version."""
    too_old = since is not None and not at_least(since)
    too_new = until is not None and at_least(until)
    if too_old or too_new:
        raise ModuleNotFoundError(f"No module named {module!r} (fake sglang {VERSION})", name=module)
