"""The numerical guard: a non-finite loss or gradient never reaches the weights.

Two halves:
- per optimizer step (minirl.update.loop): a mini-batch whose loss or gradient norm is NaN or inf
  on any rank skips `optimizer.step()`. The step's metrics count the skipped optimizer steps
  (`actor/nonfinite_steps`) and name the phase where the first non-finite value appeared
  (`actor/nonfinite_phase`, an index into NONFINITE_PHASES; 0 when all is finite), so a NaN
  advantage from a plugin is reported as "adv", not as the loss it poisoned;
- per training step (`NonFiniteGuard.observe`, called by the trainer with the step's metrics):
  each bad step is logged with its number and phase, and trainer.max_nonfinite_steps bad steps
  in a row stop the run with a UserError instead of "succeeding" on frozen weights. The critic's
  skipped optimizer steps (`critic/nonfinite_steps`, the same loop) make a step bad too,
  in phase "update_critic": a critic stuck on NaN would otherwise feed the actor frozen values.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from minirl.batch import RolloutBatch
from minirl.errors import UserError
from minirl.protocols import Reducer

# Where a non-finite value can first appear. "reward" (token scores), "old_log_prob", "ref",
# "values" (the critic's) and "adv" are the trainer's phases whose outputs the update reads;
# "loss" and "grad_norm" are inside the update itself. New phases go at the end: a logged
# actor/nonfinite_phase is an index into this tuple.
NONFINITE_PHASES = ("", "reward", "old_log_prob", "ref", "adv", "loss", "grad_norm", "update_critic", "values")
NONFINITE_STEPS = "nonfinite_steps"  # after the update's metric prefix
STEPS_METRIC = f"actor/{NONFINITE_STEPS}"
CRITIC_STEPS_METRIC = f"critic/{NONFINITE_STEPS}"
PHASE_METRIC = "actor/nonfinite_phase"


def phase_code(phase: str) -> float:
    return float(NONFINITE_PHASES.index(phase))


def phase_name(code: float) -> str:
    i = int(code)
    return NONFINITE_PHASES[i] if 0 <= i < len(NONFINITE_PHASES) else f"unknown ({code})"


def nonfinite_step(loss: torch.Tensor, grad_norm: torch.Tensor, reduce) -> tuple[str, float]:
    """("loss" or "grad_norm" when either is non-finite on any rank (`reduce` sums over the ranks,
    so all agree), else ""; the gradient norm as a float). Read back together: one wait for the
    device before the optimizer step, none after it."""
    norm_1 = grad_norm.detach().to(loss.device, torch.float64).reshape(1)
    flags = reduce((~torch.stack([torch.isfinite(loss), torch.isfinite(norm_1[0])])).float())
    loss_bad, grad_bad, norm = torch.cat([flags.to(torch.float64), norm_1]).tolist()
    return ("loss" if loss_bad else ("grad_norm" if grad_bad else "")), norm


def first_nonfinite_input(batch: RolloutBatch, reduce: Reducer) -> str:
    """The phase of the first of the update's inputs holding NaN or inf ("" when all are finite),
    agreed over ranks by `reduce` (a sum over data-parallel ranks) with one host sync."""
    inputs = (  # in the order the step produces them
        ("reward", batch.token_scores_BT),
        ("old_log_prob", batch.old_log_probs_BT),
        ("ref", batch.ref_log_probs_BT),
        ("values", batch.values_BT),
        ("adv", batch.rewards_BT),
        ("adv", batch.advantages_BT),
    )
    present = [(phase, x) for phase, x in inputs if x is not None]
    if not present:
        return ""
    flags = reduce(torch.stack([(~torch.isfinite(x)).any().float() for _, x in present]))
    bad = [phase for (phase, _), flag in zip(present, flags.tolist()) if flag > 0]
    return bad[0] if bad else ""


class NonFiniteGuard:
    """Counts training steps in a row whose update skipped an optimizer step for non-finite
    numbers; raises a UserError at `max_consecutive` (>= 1, validated). A finite step resets the count.

    observe() must see the same metrics on every rank (they are reduced), so every rank stops
    at the same step. `verbose` (rank 0) prints one warning line per bad step on stderr.
    """

    def __init__(self, max_consecutive: int, verbose: bool = True):
        self.max_consecutive = max_consecutive
        self.verbose = verbose
        self.consecutive = 0
        self.total = 0
        self.first_bad_step: int | None = None

    def observe(self, metrics: dict[str, Any], step: int) -> None:
        actor_skipped = float(metrics.get(STEPS_METRIC, 0.0))
        skipped = actor_skipped + float(metrics.get(CRITIC_STEPS_METRIC, 0.0))
        if skipped <= 0:
            self.consecutive, self.first_bad_step = 0, None
            return
        phase = phase_name(metrics.get(PHASE_METRIC, 0.0)) if actor_skipped > 0 else "update_critic"
        self.consecutive += 1
        self.total += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        if self.verbose:
            print(
                f"minirl: warning: step {step}: non-finite values (first in phase {phase!r}); skipped "
                f"{int(skipped)} optimizer step(s); {self.consecutive} of trainer.max_nonfinite_steps = "
                f"{self.max_consecutive} bad steps in a row",
                file=sys.stderr,
                flush=True,
            )
        if self.consecutive >= self.max_consecutive:
            raise UserError(self._stop_message(step, phase))

    def _stop_message(self, step: int, phase: str) -> str:
        return (
            f"step {step}: {self.consecutive} steps in a row (from step {self.first_bad_step}) had a "
            f"non-finite loss or gradient, first in phase {phase!r}; their updates were skipped, so the "
            f"run stops (trainer.max_nonfinite_steps = {self.max_consecutive}). Look at that phase: a "
            f"plugin returning NaN or inf, a learning rate that diverges, a broken reward; raise "
            f"trainer.max_nonfinite_steps to tolerate more"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "total": self.total, "first_bad_step": self.first_bad_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
        self.first_bad_step = state.get("first_bad_step")
