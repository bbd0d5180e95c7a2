"""Start a job: the chosen launcher (minirl.dist.launchers: local, torchrun, ray) runs `fit` on
every rank."""

from __future__ import annotations

from minirl.dist.context import DistContext


def launch(cfg, pm) -> int:
    """Run the job; returns the exit status (0, 1 for a crash, 2 for a user error)."""
    from minirl.dist import launchers

    return launchers.launch(cfg, pm, fit)


def fit(cfg, pm, dist: DistContext) -> None:
    """The job every rank runs (module level, so spawned workers can unpickle it): the training
    loop, or in an asynchronous job a rollout rank's loop or the asynchronous trainer's."""
    if dist.role == "rollout":
        from minirl.async_training.worker import RolloutWorker

        RolloutWorker(cfg, pm, dist).run()
    elif dist.role == "trainer":
        from minirl.async_training.trainer import AsyncTrainer

        AsyncTrainer(cfg, pm, dist).fit()
    else:
        from minirl.trainer import Trainer

        Trainer(cfg, pm, dist).fit()
