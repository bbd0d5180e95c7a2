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
    loop, with its rollouts on its own ranks or, in an asynchronous job, on the rollout ranks,
    which run their own loop."""
    if dist.role == "rollout":
        from minirl.async_training.worker import RolloutWorker

        RolloutWorker(cfg, pm, dist).run()
        return
    from minirl.trainer import Trainer

    if dist.role == "trainer":
        from minirl.async_training import remote as rollouts
    else:
        from minirl.rollout.collocated import collocated as rollouts
    Trainer(cfg, pm, dist, rollouts).fit()
