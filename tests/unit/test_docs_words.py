"""The user docs speak to users: no private work numbers ("issue 31") and no in-house words for
our own machinery ("lease": a stretch of time on a rented GPU machine; "the regroup"), which a
newcomer reading README.md, docs/ or bench.toml cannot know."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", ROOT / "bench.toml", *sorted((ROOT / "docs").glob("*.md"))]
PRIVATE = re.compile(r"\bissues? #?\d+|\bleases?\b|\bleased\b|\bthe regroup\b|RLinf-vs-verl", re.IGNORECASE)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_numbers_or_in_house_words(path):
    hits = [
        f"{path.name}:{n}: {m.group(0)!r}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in PRIVATE.finditer(line)
    ]
    assert not hits, hits


def test_readme_and_agents_agree_on_when_tool_calls_are_learnt():
    """Once they said "within about 50" and "within about 60" steps for the same run."""
    said = [
        re.findall(r"within about (\d+) steps", (ROOT / f).read_text(), re.IGNORECASE)
        for f in ("README.md", "docs/agents.md")
    ]
    assert said[0] and said[0] == said[1], said
