"""The on-policy shortcut: with one mini-batch and one epoch the update takes the old log-probs
from its own forward (detached) instead of a separate pass. Loss, metrics, gradient and the
updated weights must be exactly those of the full path, whose separate pass gives the same
log-probs bit for bit when it packs the sequences the same way."""

from __future__ import annotations

import copy

import pytest
import torch

from minirl import build
from minirl.batch import RolloutBatch
from minirl.config.load import load_config
from minirl.dist.context import DistContext
from minirl.forward.packed import logprob_head, per_token_pass
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.plugins import PluginManager
from minirl.update import actor as actor_lib
from tests.batches import three_groups

CPU = torch.device("cpu")
N = 2


def _batch() -> RolloutBatch:
    return three_groups(0, [7, 7, 12, 12, 5, 5], [9, 3, 14, 6, 1, 8])


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_shortcut_is_exactly_the_full_path(dynamic):
    overrides = [
        "data.train_batch_size=3",
        "actor.ppo_mini_batch_size=3",
        f"rollout.n={N}",
        "actor.entropy_coeff=0.01",
        f"actor.use_dynamic_bsz={str(dynamic).lower()}",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.ppo_max_token_len_per_gpu=40",
        "rollout.log_prob_micro_batch_size_per_gpu=2",
        f"rollout.log_prob_use_dynamic_bsz={str(dynamic).lower()}",
        "rollout.log_prob_max_token_len_per_gpu=40",
        "actor.optim.lr=0.01",
        "data.max_response_length=16",
    ]
    cfg = load_config(None, overrides)
    assert actor_lib.on_policy(cfg.actor, cfg.data.train_batch_size, False)
    pm, dist = PluginManager(), DistContext(device=CPU)
    losses = actor_lib.Losses(pm["policy_losses"].get(cfg.actor.policy_loss))
    model = random_model(preset_config("tiny"), "cpu", torch.float32, seed=3)
    results = []
    for full_path in (True, False):
        m, batch = copy.deepcopy(model), _batch()
        if full_path:
            micro = build.log_prob_micro(cfg.rollout)
            batch.old_log_probs_BT = per_token_pass(m, batch, micro, logprob_head(1.0), dist)
        optimizer = torch.optim.AdamW(m.parameters(), lr=cfg.actor.optim.lr)
        job = build.actor_update(cfg, m, optimizer, losses, dist, on_policy=not full_path)
        metrics = actor_lib.update_actor(job, batch, dist)
        results.append((metrics, m))
    (full, m_full), (short, m_short) = results
    assert full == short
    assert full["actor/pg_clipfrac"] == 0.0 and full["actor/ppo_kl"] == 0.0  # the ratio is exactly 1
    for (name, a), b in zip(m_full.named_parameters(), m_short.parameters()):
        assert torch.equal(a, b), name


def test_the_shortcut_applies_only_when_on_policy():
    """Two mini-batches, two epochs, KL in the reward, or the key off: the separate pass stays."""
    base = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    on = load_config(None, base)
    assert actor_lib.on_policy(on.actor, 4, False)
    assert not actor_lib.on_policy(on.actor, 4, True)  # KL in reward reads them before the update
    for extra in ("actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2", "actor.on_policy_shortcut=false"):
        cfg = load_config(None, [*base, extra])
        assert not actor_lib.on_policy(cfg.actor, 4, False), extra
