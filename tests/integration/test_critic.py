"""PPO with a critic in the real loop on CPU: the `cpu` profile with algorithm.adv_estimator =
"gae" runs the values and update_critic phases, reports the critic's metrics and table rows,
honours trainer.critic_warmup, and a critic-free estimator ignores [critic] keys with a notice.
"""

from __future__ import annotations

import torch

from tests.integration.conftest import make_trainer

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4"]  # the cpu profile, made small
CRITIC_METRICS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/values/mean",
    "critic/values/max",
    "critic/values/min",
    "critic/returns/mean",
    "critic/vf_explained_var",
)


def test_cpu_profile_with_gae_trains_a_critic_and_prints_its_rows(tmp_path, data_dir, capsys):
    """Three steps with trainer.critic_warmup = 1: every step times values and update_critic and
    logs every critic metric; step 1 skips the actor update (no update_actor timing, no actor
    metrics, the actor's weights unchanged by it), steps 2-3 run it. The table shows the critic's
    phases and the console its loss."""
    trainer = make_trainer(
        tmp_path,
        data_dir,
        SMALL + ["algorithm.adv_estimator=gae", "trainer.total_training_steps=3", "trainer.critic_warmup=1"],
    )
    actor_before = {k: v.detach().clone() for k, v in trainer.actor.named_parameters()}
    critic_before = {k: v.detach().clone() for k, v in trainer.critic.model.named_parameters()}
    history = trainer.fit()
    assert len(history) == 3
    for metrics in history:
        assert metrics["timing_s/values"] > 0 and metrics["timing_s/update_critic"] > 0
        assert set(CRITIC_METRICS) <= set(metrics), set(CRITIC_METRICS) - set(metrics)
    assert "timing_s/update_actor" not in history[0] and "actor/pg_loss" not in history[0]
    assert all("timing_s/update_actor" in m and "actor/pg_loss" in m for m in history[1:])
    assert history[0]["critic/lr"] == trainer.cfg.critic.optim.lr
    moved = max(float((v.detach() - critic_before[k]).abs().max()) for k, v in trainer.critic.model.named_parameters())
    assert moved > 0, "the critic did not train"
    assert any(not torch.equal(v, actor_before[k]) for k, v in trainer.actor.named_parameters())
    out = capsys.readouterr().out
    assert "critic: preset 'tiny' + a scalar value head" in out and "steps 1..1 update only the critic" in out
    assert "values time" in out and "critic training time" in out and "values throughput" in out
    assert "vf_loss=" in out


def test_critic_warmup_leaves_the_actor_untouched(tmp_path, data_dir):
    """All steps inside the warm-up: the critic trains, the actor's weights stay exactly as built."""
    trainer = make_trainer(
        tmp_path,
        data_dir,
        SMALL + ["algorithm.adv_estimator=gae", "trainer.total_training_steps=1", "trainer.critic_warmup=1"],
    )
    before = {k: v.detach().clone() for k, v in trainer.actor.named_parameters()}
    trainer.fit()
    assert all(torch.equal(v, before[k]) for k, v in trainer.actor.named_parameters())


def test_critic_keys_with_a_critic_free_estimator_are_ignored_with_a_notice(tmp_path, data_dir, capsys):
    """grpo needs no values: no critic is built, and the set [critic] keys are named as ignored
    (even one that the critic's validation would refuse, since it is never used)."""
    trainer = make_trainer(
        tmp_path, data_dir, SMALL + ["critic.optim.lr=1e-3", "critic.ppo_epochs=0", "trainer.critic_warmup=2"]
    )
    assert trainer.critic is None and "critic" not in trainer.state.schedulers
    out = capsys.readouterr().out
    assert "notice: critic.optim.lr, critic.ppo_epochs, trainer.critic_warmup ignored" in out
    assert "algorithm.adv_estimator = 'grpo' needs no critic" in out
