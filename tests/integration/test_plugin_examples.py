"""The rollout engine and reward plugin examples of docs/plugins.md, as written there, run a real
training step: the code is read out of the document, so the example cannot drift from what works."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from tests.integration.conftest import ROOT, make_trainer


def doc_example(docstring_start: str) -> str:
    """The ```python block of docs/plugins.md whose first line starts with docstring_start."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "plugins.md").read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith(docstring_start)]
    return block


def test_engine_and_reward_examples_train_a_step(tmp_path, data_dir, monkeypatch):
    """The `loop` engine generates every response of a step and its log-probs equal the trainer's
    (it runs the same model); the `exact_answer` reward scores every row (no errors)."""
    (tmp_path / "my_engine.py").write_text(doc_example('"""Rollout engine `loop`'))
    (tmp_path / "my_rewards.py").write_text(doc_example('"""Reward `exact_answer`'))
    monkeypatch.syspath_prepend(str(tmp_path))
    table = pq.read_table(data_dir / "copy" / "train.parquet")
    column = table.column_names.index("data_source")
    table = table.set_column(column, "data_source", [["exact_answer"] * table.num_rows])
    pq.write_table(table, tmp_path / "train.parquet")
    trainer = make_trainer(
        tmp_path / "runs",
        data_dir,
        [
            f'data.train_files=["{tmp_path}/train.parquet"]',
            'plugins.modules=["my_engine", "my_rewards"]',
            "rollout.name=loop",
            "trainer.total_training_steps=1",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=2",
            'trainer.logger=["jsonl"]',
        ],
    )
    (metrics,) = trainer.fit()
    assert type(trainer.source.engine).__name__ == "LoopEngine"
    assert metrics["reward/errors"] == 0
    assert metrics["rollout_corr/log_ratio_mean"] == pytest.approx(0.0, abs=1e-5)


ASKS_WEATHER = '''
from minirl import hookimpl
from minirl.agent.parser import ToolCall
from minirl.protocols import Trajectory


class AsksWeather:
    """Turn, then the weather of Paris and of Mars (no data: an error message), then a turn."""

    def __init__(self, cfg):
        pass

    async def run(self, ctx, sample):
        t = Trajectory(list(sample.prompt_ids), assistant_turns=2, user_turns=1)
        out = await ctx.generate(sample, sample.prompt_ids, 2)
        calls = [ToolCall("weather", {"city": "Paris"}, ""), ToolCall("weather", {"city": "Mars"}, "")]
        outcomes = await ctx.call_tools(sample, calls)
        tool_ids = ctx.chat.append_ids([{"role": "tool", "content": o.text} for o in outcomes], out.token_ids[-1])
        again = await ctx.generate(sample, sample.prompt_ids + out.token_ids + tool_ids, 2)
        t.response_ids = out.token_ids + tool_ids + again.token_ids
        t.response_mask = [1] * len(out.token_ids) + [0] * len(tool_ids) + [1] * len(again.token_ids)
        t.logprobs = out.logprobs + [0.0] * len(tool_ids) + again.logprobs
        t.messages = [{"role": "tool", "content": o.text} for o in outcomes]
        t.metrics = {"tool_calls": 2, **{f"tool_{o.status}": 1 for o in outcomes}}
        assert again.cached_tokens > 0  # the engine kept the first turn's KV
        return t


@hookimpl
def minirl_agent_loops():
    return {"asks_weather": AsksWeather}
'''


def test_tool_example_runs_in_a_training_step(tmp_path, data_dir, monkeypatch):
    """The `weather` tool of docs/plugins.md, called by a loop that always asks it, through a real
    training step on the native engine: the tool's answer and its ToolError both reach the
    trajectory, and the step trains on a mask with holes."""
    (tmp_path / "my_tools.py").write_text(doc_example('"""Tool `weather`'))
    (tmp_path / "my_loops.py").write_text(ASKS_WEATHER)
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: weather\n    config: {type: native}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = make_trainer(
        tmp_path / "runs",
        data_dir,
        [
            'plugins.modules=["my_tools", "my_loops"]',
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.tool_config_path={tmp_path}/tools.yaml",
            "rollout.multi_turn.max_parallel_calls=2",
            "rollout.agent.default_agent_loop=asks_weather",
            "data.max_response_length=160",
            "trainer.total_training_steps=1",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=2",
            'trainer.logger=["jsonl"]',
        ],
    )
    (metrics,) = trainer.fit()
    assert metrics["agent/tool_calls"] == 16 and metrics["agent/tool_ok"] == 8 and metrics["agent/tool_error"] == 8
    # the engine's account of the tools' time: every loop asks at once, so it mostly waits
    assert 0 <= metrics["agent/engine_idle_on_tools_s"] <= metrics["agent/tool_wall_s"]
    assert metrics["agent/tool_wall_s"] > 0 and 0 <= metrics["agent/tool_overlap"] <= 1
    assert 0 < metrics["response/model_token_share"] < 1
    assert metrics["response_length/mean"] <= 4  # model tokens only: two turns of at most two
