"""Fakes of heavy optional dependencies, importable only inside tests.

`use_fake_sglang(monkeypatch, version)` puts tests/fakes on sys.path, selects the version the
fake plays and drops any previously imported `sglang` modules, so the next `import sglang`
loads the fake of that version. monkeypatch undoes the path and the variable after the test;
call `drop_fake_sglang()` then too, so no later test imports the fake by accident.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAKES = Path(__file__).resolve().parent
SGLANG_PROFILES = ("0.4.10", "0.5.14", "0.5.23")


def _drop_sglang_modules() -> None:
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            del sys.modules[name]


def use_fake_sglang(monkeypatch, version: str = "0.5.23"):
    """Make `import sglang` load the fake playing `version`; returns the fake package."""
    if version not in SGLANG_PROFILES:
        raise ValueError(f"the fake sglang plays {SGLANG_PROFILES}, not {version!r}")
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.setenv("MINIRL_FAKE_SGLANG", version)
    _drop_sglang_modules()
    import sglang

    assert sglang.__file__.startswith(str(FAKES)), f"a real sglang shadows the fake: {sglang.__file__}"
    return sglang


def drop_fake_sglang() -> None:
    """Forget the fake's modules (call after a test that used it)."""
    _drop_sglang_modules()
