"""`rollout.name = "sglang"` runs minirl's real loop end to end, on the fake SGLang.

The short run checks, on every version profile, that after each step's weight sync the engine's
weights equal the actor's (exact checksum): the sync is complete, in the right names, every step.
The slow run is test_learning.py's copy-task recipe and threshold with the engine switched by one
key: the plugin's tokens, log-probs and finish reasons are good enough to learn from.
"""

from __future__ import annotations

import json

import pytest

from minirl.models import assembly
from minirl_plugins.engines.native.weights import weights_checksum
from tests.fakes import SGLANG_PROFILES, drop_fake_sglang, use_fake_sglang
from tests.integration.conftest import make_trainer
from tests.integration.test_learning import ENTROPY_COEFF, RECIPE


@pytest.fixture
def fake_sglang(monkeypatch):
    def use(version: str):
        return use_fake_sglang(monkeypatch, version)

    yield use
    drop_fake_sglang()


def _check_every_sync(trainer, checks: list) -> None:
    """Wrap the weight sync: after each update, compare the engine's weights with the actor's."""
    sync = trainer.sync.after_update

    def checked():
        metrics = sync()
        engine_model = trainer.source.engine.engine.scheduler.model
        dtype = next(engine_model.parameters()).dtype
        actor = weights_checksum(assembly.full_weights(trainer.actor), dtype)
        checks.append(actor == weights_checksum(engine_model.named_parameters(), dtype))
        return metrics

    trainer.sync.after_update = checked


@pytest.mark.parametrize("version", SGLANG_PROFILES)
def test_engine_weights_equal_the_actors_after_every_step(tmp_path, data_dir, fake_sglang, version):
    fake_sglang(version)
    overrides = ["rollout.name=sglang", "trainer.total_training_steps=3", "rollout.n=4", "data.train_batch_size=4"]
    overrides += ["actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    trainer = make_trainer(tmp_path, data_dir, overrides)
    checks: list = []
    _check_every_sync(trainer, checks)
    history = trainer.fit()
    assert len(history) == 3 and checks == [True] * 3
    assert all(m["rollout_corr/prob_diff_max"] < 1e-3 for m in history)  # SGLang's log-probs are kept
    assert type(trainer.source.engine).__name__ == "SGLangEngine"


@pytest.mark.slow
def test_sglang_engine_learns_copy_task(tmp_path, data_dir, fake_sglang):
    fake_sglang("0.5.23")
    overrides = ["rollout.name=sglang", "algorithm.adv_estimator=grpo", f"actor.entropy_coeff={ENTROPY_COEFF['grpo']}"]
    trainer = make_trainer(tmp_path, data_dir, RECIPE + overrides)
    checks: list = []
    _check_every_sync(trainer, checks)
    history = trainer.fit()
    logged = [json.loads(line) for line in (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()]
    before, after = logged[0]["val/score/mean"], history[-1]["val/score/mean"]
    scores = [m["score/mean"] for m in history]
    curve = " ".join(f"{s:.2f}" for s in scores[::30])
    print(f"sglang (fake 0.5.23): val {before:.3f} -> {after:.3f}; sampled score every 30 steps: {curve}")
    assert all(checks) and len(checks) == len(history)
    assert logged[0]["step"] == 0 and before < 0.05, "the random-init model should start near chance"
    assert sum(scores[:5]) / 5 < 0.05
    assert after >= 0.9, f"sglang did not learn: greedy val score {after:.3f}; sampled curve {curve}"
