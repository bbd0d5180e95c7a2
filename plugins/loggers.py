"""Metric loggers: console, jsonl (metrics.jsonl in the run directory), tensorboard, wandb.

tensorboard and wandb are optional extras, imported only when selected.
"""

from __future__ import annotations

import json
import os

from tqdm import tqdm

from minirl import hookimpl
from minirl.errors import UserError

CONSOLE_KEYS = (
    ("score/mean", "score"),
    ("response_length/mean", "resp_len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl_loss"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tok/s"),
    ("val/score/mean", "val_score"),
)


class ConsoleLogger:
    """One short line per step; the full set goes to the other loggers."""

    def __init__(self, trainer_cfg, run_dir: str):
        self.total = trainer_cfg.total_training_steps

    def log(self, metrics: dict, step: int) -> None:
        parts = [f"{short}={metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics]
        tqdm.write(f"step {step}: " + " ".join(parts))

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per step to <run_dir>/metrics.jsonl."""

    def __init__(self, trainer_cfg, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "w")

    def log(self, metrics: dict, step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorboardLogger:
    def __init__(self, trainer_cfg, run_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UserError(
                "trainer.logger has 'tensorboard': install the extra, pip install 'minirl[tensorboard]'"
            ) from exc
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, trainer_cfg, run_dir: str):
        try:
            import wandb
        except ImportError as exc:
            raise UserError("trainer.logger has 'wandb': install the extra, pip install 'minirl[wandb]'") from exc
        self.run = wandb.init(project=trainer_cfg.project_name, name=trainer_cfg.experiment_name, dir=run_dir)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


@hookimpl
def minirl_loggers():
    return {"console": ConsoleLogger, "jsonl": JsonlLogger, "tensorboard": TensorboardLogger, "wandb": WandbLogger}
