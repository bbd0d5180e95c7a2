"""The plugin manager: built-ins, entry points, config modules, duplicates, typos, docs example."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minirl.plugins import PluginError, PluginManager
from minirl.protocols import AdvantageInputs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A directory on sys.path for throw-away plugin modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("tmp_plugin_") or m == "my_estimators"]:
        del sys.modules[name]


def write_module(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(body))


def test_builtins_register_every_core_component():
    """`python -m minirl plugins` must list all the components the issues promise."""
    pm = PluginManager(entry_points=False)
    for name in ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gae"]:
        assert name in pm["advantage_estimators"]
    for name in ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+", "low_var_kl+", "full"]:
        assert name in pm["kl_estimators"]
    assert "vanilla" in pm["policy_losses"]
    for name in ["gsm8k", "math", "countdown"]:
        assert name in pm["reward_functions"]
    assert {"hf", "native"} <= set(pm["rollout_engines"].items)
    assert "console" in pm.describe()


def test_listing_has_no_empty_heading():
    """`python -m minirl plugins` lists kinds that have components; the built-ins add no config
    section, so no bare `config_sections:` line with nothing under it."""
    lines = PluginManager().describe().splitlines()
    headings = [i for i, line in enumerate(lines) if not line.startswith(" ")]
    assert all(i + 1 < len(lines) and lines[i + 1].startswith("  ") for i in headings), lines
    assert "config_sections:" not in lines


def test_duplicate_name_names_both_providers(module_dir):
    """Two plugins claiming one name must fail loudly, naming both, instead of one silently winning."""
    write_module(
        module_dir,
        "tmp_plugin_dup",
        """
        from minirl import hookimpl
        @hookimpl
        def minirl_advantage_estimators():
            return {"grpo": lambda inputs, cfg: None}
    """,
    )
    with pytest.raises(PluginError, match=r"'grpo' is registered twice.*advantage.*tmp_plugin_dup"):
        PluginManager(["tmp_plugin_dup"], entry_points=False)


def test_unknown_name_lists_registered_and_suggests():
    """A misspelled component name in the config gets the closest name and the full list."""
    pm = PluginManager(entry_points=False)
    with pytest.raises(PluginError, match=r"algorithm.adv_estimator = 'grpoo'.*did you mean 'grpo'.*rloo"):
        pm["advantage_estimators"].get("grpoo")


def test_misspelled_hook_is_caught_by_check_pending(module_dir):
    """A hook implementation with a typo in its name would otherwise be silently ignored."""
    write_module(
        module_dir,
        "tmp_plugin_typo",
        """
        from minirl import hookimpl
        @hookimpl
        def minirl_advantage_estimator():
            return {}
    """,
    )
    with pytest.raises(Exception, match="minirl_advantage_estimator"):
        PluginManager(["tmp_plugin_typo"], entry_points=False)


def test_missing_config_module_is_a_clear_error():
    """[plugins] modules naming a module that does not exist says which and from where."""
    with pytest.raises(PluginError, match=r"tmp_plugin_absent.*config \[plugins\] modules"):
        PluginManager(["tmp_plugin_absent"], entry_points=False)


def test_non_dict_answer_is_rejected(module_dir):
    write_module(
        module_dir,
        "tmp_plugin_list",
        """
        from minirl import hookimpl
        @hookimpl
        def minirl_loggers():
            return ["console"]
    """,
    )
    with pytest.raises(PluginError, match="must return a dict"):
        PluginManager(["tmp_plugin_list"], entry_points=False)


def docs_example() -> str:
    """The exact code block of docs/plugins.md (the example users copy)."""
    return re.search(r"`my_estimators.py`:\n\n```python\n(.*?)```", DOCS.read_text(), re.S).group(1)


def test_docs_example_is_short_and_works_from_config(module_dir):
    """The documented custom estimator must load through [plugins] modules and compute."""
    code = docs_example()
    assert len(code.strip().splitlines()) < 30
    (module_dir / "my_estimators.py").write_text(code)
    pm = PluginManager(["my_estimators"], entry_points=False)
    est = pm["advantage_estimators"].get("max_baseline")
    mask = torch.ones(4, 2)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 2.0]])
    adv, _ = est(AdvantageInputs(rewards, mask, torch.tensor([7, 7, 9, 9])), None)
    assert torch.equal(adv[:, 0], torch.tensor([0.0, -1.0, 0.0, -1.0]))


def test_docs_example_loads_as_entry_point(module_dir):
    """An installed distribution declaring group `minirl` is loaded without any config line."""
    (module_dir / "my_estimators.py").write_text(docs_example())
    dist_info = module_dir / "my_estimators-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-estimators\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[minirl]\nmy_estimators = my_estimators\n")
    pm = PluginManager()
    assert "max_baseline" in pm["advantage_estimators"]
    assert "my_estimators" in pm.describe()
