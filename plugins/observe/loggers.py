"""Metric loggers: console, jsonl (metrics.jsonl in the run directory), and tensorboard and wandb
(optional extras, imported only when selected)."""

from __future__ import annotations

import json
import math
import os

from tqdm import tqdm

from minirl import hookimpl
from minirl.errors import UserError
from minirl.observe.runs.read import parse_line

CONSOLE_KEYS = (
    ("score/mean", "score"),
    ("response_length/mean", "resp_len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl_loss"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    # multi-turn rollouts only: model turns per sample, tool calls of the step and those that worked
    ("agent/assistant_turns/mean", "turns"),
    ("agent/tool_calls", "tool_calls"),
    ("agent/tool_ok", "tool_ok"),
    ("critic/vf_loss", "vf_loss"),
    ("critic/vf_explained_var", "vf_ev"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tok/s"),
    ("val/score/mean", "val_score"),
)


class ConsoleLogger:
    """One short line per step; the full set goes to the other loggers."""

    def __init__(self, trainer_cfg, run_dir: str):
        pass  # nothing to open

    def log(self, metrics: dict, step: int) -> None:
        parts = [f"{short}={metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics]
        tqdm.write(f"step {step}: " + " ".join(parts))

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one strict-JSON object per step to <run_dir>/metrics.jsonl (a non-finite number is
    written as null, since NaN is not JSON). A resumed run first drops the lines past its
    checkpoint's step that the interrupted run wrote, so every step appears exactly once."""

    def __init__(self, trainer_cfg, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a")

    def resume(self, step: int) -> None:
        self.file.close()
        with open(self.path) as f:
            kept = [line for line in f if (record := parse_line(line)) and record["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(line.rstrip("\n") + "\n" for line in kept)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a")

    def log(self, metrics: dict, step: int) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class TensorboardLogger:
    def __init__(self, trainer_cfg, run_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UserError(
                "trainer.logger has 'tensorboard': install the extra, pip install 'minirl[tensorboard]'"
            ) from exc
        self.log_dir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(self.log_dir)

    def resume(self, step: int) -> None:
        """Continue the same event files; events past `step` from the interrupted run are purged."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(self.log_dir, purge_step=step + 1)

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
        # the run id is kept in the run directory, so a resumed run continues the same wandb run
        id_file = os.path.join(run_dir, "wandb_run_id")
        run_id = open(id_file).read().strip() if os.path.exists(id_file) else wandb.util.generate_id()
        with open(id_file, "w") as f:
            f.write(run_id)
        self.run = wandb.init(
            project=trainer_cfg.project_name, name=trainer_cfg.experiment_name, dir=run_dir, id=run_id, resume="allow"
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


@hookimpl
def minirl_loggers():
    return {"console": ConsoleLogger, "jsonl": JsonlLogger, "tensorboard": TensorboardLogger, "wandb": WandbLogger}
