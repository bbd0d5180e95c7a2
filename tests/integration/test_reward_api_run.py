"""The reward API inside the real training loop (CPU): a custom reward file scored in a worker
pool, DAPO's overlong penalty in the step's scores, and the pool closed however the run ends."""

from __future__ import annotations

import os
import signal

import pytest

from minirl.errors import Stopped
from tests.integration.conftest import make_trainer

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "copy" and isinstance(extra_info, dict)
    return {"score": 0.5, "custom": 1.0}

def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0]
"""

SMALL = [
    "trainer.total_training_steps=2",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    'trainer.logger=["jsonl"]',
]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_custom_reward_in_workers_with_overlong_penalty(tmp_path, data_dir, reward_file):
    """Every score is the custom function's 0.5 plus the overlong penalty (L_max = 2, len = 1,
    factor 0.5: a 2-token response gets -0.5, a 1-token one 0), so score/mean = 0.5 + the logged
    mean penalty; the dict's extra key is logged; the workers are gone after fit()."""
    trainer = make_trainer(
        tmp_path,
        data_dir,
        SMALL
        + [
            f"custom_reward_function.path={reward_file}",
            "reward.num_workers=2",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=1",
            "reward.overlong_buffer.penalty_factor=0.5",
        ],
    )
    history = trainer.fit()
    assert len(history) == 2
    for m in history:
        assert m["reward/errors"] == m["reward/timeouts"] == m["reward/crashes"] == 0
        assert m["reward/extra/custom/mean"] == 1.0
        assert m["score/mean"] == pytest.approx(0.5 + m["reward/overlong_penalty/mean"], abs=1e-6)
        assert m["reward/overlong_penalty/mean"] == pytest.approx(-0.5 * m["reward/overlong_penalty/frac"])
    assert any(m["reward/overlong_penalty/frac"] > 0 for m in history)  # the copy task answers in 2 tokens
    assert trainer.source.rewards.pool.workers == []


def test_validation_scores_carry_no_overlong_penalty(tmp_path, data_dir, reward_file):
    """As in verl, greedy validation reports the rule score alone."""
    trainer = make_trainer(
        tmp_path,
        data_dir,
        SMALL
        + [
            "trainer.total_training_steps=1",
            "trainer.test_freq=1",
            f"custom_reward_function.path={reward_file}",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=1",
        ],
    )
    (metrics,) = trainer.fit()
    assert metrics["val/score/mean"] == 0.5
    assert metrics["reward/overlong_penalty/frac"] > 0


def test_pool_is_closed_when_the_run_fails(tmp_path, data_dir, reward_file, monkeypatch):
    """An exception after the rewards were scored (here in the advantage phase) still stops the
    reward workers on the way out of fit()."""
    overrides = SMALL + [f"custom_reward_function.path={reward_file}", "reward.num_workers=1"]
    trainer = make_trainer(tmp_path, data_dir, overrides)
    started = []

    def broken(batch):
        started.extend(w.process for w in trainer.source.rewards.pool.workers)
        raise RuntimeError("boom")

    monkeypatch.setattr(trainer, "advantages", broken)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert started and not any(p.is_alive() for p in started)
    assert trainer.source.rewards.pool.workers == []


def test_pool_is_closed_when_the_run_is_stopped(tmp_path, data_dir, reward_file, monkeypatch):
    """SIGTERM during a step: the step finishes, a checkpoint is written, Stopped is raised, and
    the reward workers are gone (they ignore Ctrl-C and die with the trainer, but fit() stops them)."""
    overrides = SMALL + [f"custom_reward_function.path={reward_file}", "reward.num_workers=1"]
    trainer = make_trainer(tmp_path, data_dir, overrides)
    started, advantages = [], trainer.advantages

    def signalled(batch):
        started.extend(w.process for w in trainer.source.rewards.pool.workers)
        os.kill(os.getpid(), signal.SIGTERM)
        return advantages(batch)

    monkeypatch.setattr(trainer, "advantages", signalled)
    with pytest.raises(Stopped, match="stopped by SIGTERM after step 1"):
        trainer.fit()
    assert started and not any(p.is_alive() for p in started)
