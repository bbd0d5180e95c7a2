"""The numerical guard: a non-finite loss or gradient never reaches the weights.

Before it, an estimator plugin returning NaN advantages (or a NaN hyper-parameter) made every
update NaN and the run "succeeded". Now the update skips that optimizer step, counts it, names
the phase where the first non-finite value appeared, and NonFiniteGuard stops the run after
trainer.max_nonfinite_steps bad steps in a row.
"""

from __future__ import annotations

import pytest
import torch

from minirl import build
from minirl.algo.guard import (
    CRITIC_STEPS_METRIC,
    PHASE_METRIC,
    STEPS_METRIC,
    NonFiniteGuard,
    nonfinite_step,
    phase_code,
    phase_name,
)
from minirl.batch import RolloutBatch, response_mask
from minirl.config.load import load_config
from minirl.dist.context import DistContext
from minirl.errors import UserError
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.plugins import PluginManager
from minirl.update import actor as actor_lib

CPU = DistContext(device=torch.device("cpu"))


def _batch(n_seqs: int = 4) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (5,), generator=gen).tolist() for _ in range(n_seqs)]
    responses = [torch.randint(0, 256, (3,), generator=gen).tolist() for _ in range(n_seqs)]
    mask_BT = response_mask(responses, CPU.device)
    batch = RolloutBatch(prompts, responses, torch.arange(n_seqs) // 2, mask_BT)
    batch.old_log_probs_BT = torch.full(mask_BT.shape, -5.0) * mask_BT
    batch.advantages_BT = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask_BT
    return batch


def _update(batch: RolloutBatch, *overrides: str):
    base = ["actor.ppo_mini_batch_size=1", "actor.optim.lr=0.1", "rollout.n=2", "data.max_response_length=3"]
    cfg = load_config(None, [*base, *overrides])
    model = random_model(preset_config("tiny"), "cpu", torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.actor.optim.lr)
    losses = actor_lib.Losses(PluginManager(entry_points=False)["policy_losses"].get("vanilla"))
    job = build.actor_update(cfg, model, optimizer, losses, CPU, on_policy=False)
    metrics = actor_lib.update_actor(job, batch, CPU)
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return metrics, moved, finite


def test_finite_update_moves_the_weights_and_reports_zero():
    metrics, moved, finite = _update(_batch())
    assert moved and finite
    assert metrics[STEPS_METRIC] == 0.0 and phase_name(metrics[PHASE_METRIC]) == ""


def test_nan_advantages_skip_their_optimizer_step_and_name_the_phase():
    """NaN advantages (a broken estimator plugin) in the first of two mini-batches: that step is
    skipped, the second (finite) one updates, and the weights stay finite."""
    batch = _batch()
    batch.advantages_BT[1, 0] = float("nan")
    metrics, moved, finite = _update(batch)
    assert moved and finite
    assert metrics[STEPS_METRIC] == 1.0
    assert phase_name(metrics[PHASE_METRIC]) == "adv"


def test_all_nan_advantages_leave_the_weights_exactly_as_they_were():
    batch = _batch()
    batch.advantages_BT.fill_(float("nan"))
    metrics, moved, _ = _update(batch)
    assert not moved
    assert metrics[STEPS_METRIC] == 2.0 and phase_name(metrics[PHASE_METRIC]) == "adv"


def test_nan_hyper_parameter_is_caught_as_loss():
    """A NaN entropy coefficient (if it got past validation) poisons the loss, not the inputs."""
    metrics, moved, _ = _update(_batch(), "actor.entropy_coeff=nan")
    assert not moved
    assert metrics[STEPS_METRIC] == 2.0 and phase_name(metrics[PHASE_METRIC]) == "loss"


def _bad(phase: str = "adv") -> dict[str, float]:
    return {STEPS_METRIC: 1.0, PHASE_METRIC: phase_code(phase)}


def test_guard_stops_after_max_consecutive_bad_steps(capsys):
    guard = NonFiniteGuard(3)
    guard.observe(_bad(), step=4)
    guard.observe(_bad(), step=5)
    err = capsys.readouterr().err
    assert "step 5: non-finite values (first in phase 'adv')" in err and "2 of trainer.max_nonfinite_steps" in err
    with pytest.raises(UserError, match=r"step 6: 3 steps in a row \(from step 4\).*'adv'.*max_nonfinite_steps"):
        guard.observe(_bad(), step=6)


def test_critic_skipped_steps_count_as_bad_steps(capsys):
    """A critic whose optimizer steps are skipped (critic/nonfinite_steps) while the actor's are
    fine makes the step bad, in phase 'update_critic', and stops the run like the actor's."""
    guard = NonFiniteGuard(2)
    critic_bad = {STEPS_METRIC: 0.0, PHASE_METRIC: 0.0, CRITIC_STEPS_METRIC: 2.0}
    guard.observe(critic_bad, step=7)
    assert "step 7: non-finite values (first in phase 'update_critic'); skipped 2" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"step 8: 2 steps in a row \(from step 7\).*'update_critic'"):
        guard.observe(critic_bad, step=8)
    guard = NonFiniteGuard(2, verbose=False)
    guard.observe({**_bad("loss"), CRITIC_STEPS_METRIC: 1.0}, step=1)  # both: the actor's phase is named
    with pytest.raises(UserError, match="'loss'"):
        guard.observe({**_bad("loss"), CRITIC_STEPS_METRIC: 1.0}, step=2)
    guard = NonFiniteGuard(2, verbose=False)
    guard.observe(critic_bad, step=1)
    guard.observe({STEPS_METRIC: 0.0, CRITIC_STEPS_METRIC: 0.0}, step=2)  # finite again: reset
    guard.observe(critic_bad, step=3)
    assert guard.consecutive == 1


def test_a_finite_step_resets_the_count():
    guard = NonFiniteGuard(2, verbose=False)
    for step in range(1, 10):
        guard.observe(_bad() if step % 2 else {STEPS_METRIC: 0.0, PHASE_METRIC: 0.0}, step)
    assert guard.consecutive == 1 and guard.total == 5


def test_guard_state_round_trips_for_resume():
    """A resumed run continues the count: two bad steps before the checkpoint and one after stop it."""
    guard = NonFiniteGuard(3, verbose=False)
    guard.observe(_bad(), 1)
    guard.observe(_bad(), 2)
    resumed = NonFiniteGuard(3, verbose=False)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(UserError, match="from step 1"):
        resumed.observe(_bad("grad_norm"), 3)


@pytest.mark.parametrize(
    ("loss", "norm", "other_rank", "phase"),
    [
        (1.0, 2.5, (0.0, 0.0), ""),
        (float("nan"), 2.5, (0.0, 0.0), "loss"),
        (1.0, float("inf"), (0.0, 0.0), "grad_norm"),
        (1.0, 2.5, (0.0, 1.0), "grad_norm"),  # another rank's gradient was not finite
        (1.0, 2.5, (1.0, 1.0), "loss"),
        (1.0, 1e300, (0.0, 0.0), ""),  # a float64 norm past float32's range is finite, read exactly
    ],
)
def test_nonfinite_step_reads_the_flags_of_every_rank_and_the_norm_at_once(loss, norm, other_rank, phase):
    calls = []

    def reduce(flags):
        calls.append(flags.clone())
        return flags + torch.tensor(other_rank)

    got_phase, got_norm = nonfinite_step(torch.tensor(loss), torch.tensor(norm, dtype=torch.float64), reduce)
    assert got_phase == phase and len(calls) == 1
    assert got_norm == norm
