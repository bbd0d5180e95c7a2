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
    assert type(trainer.engine).__name__ == "LoopEngine"
    assert metrics["reward/errors"] == 0
    assert metrics["rollout_corr/log_ratio_mean"] == pytest.approx(0.0, abs=1e-5)
