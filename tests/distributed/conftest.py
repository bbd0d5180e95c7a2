"""Fixtures of the distributed tests: synthetic `copy` data written once per session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "scripts" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_data", make_data)  # dataclasses look their module up there
    spec.loader.exec_module(make_data)
    out = tmp_path_factory.mktemp("data")
    make_data.write_task("copy", out, 100, 10, 0)
    return out
