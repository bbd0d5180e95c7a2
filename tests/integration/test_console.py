"""What a run says on the console, as a newcomer reads it: the CPU threads it chose on its
start-up line, tool calls and turns on a multi-turn run's step lines, what a LoRA run trains and
where its adapters go, and a last line naming the run directory; and what `compare` then says
of a run stopped by Ctrl-C (resumable from its checkpoint, not "still running, or crashed").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from minirl.cli import main
from tests.integration.conftest import ROOT, _make_data_module, cli_args

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_training_steps=1"]


def small_job(tmp_path, data_dir, *overrides: str) -> list[str]:
    return cli_args(
        tmp_path, data_dir / "copy" / "train.parquet", *SMALL, "trainer.logger=['console','jsonl']", *overrides
    )


@pytest.mark.parametrize(
    "omp, says",
    [
        (None, "1 intra-op thread per process (the default on CPU"),
        ("2", "2 intra-op threads per process (OMP_NUM_THREADS)"),
    ],
)
def test_the_run_chooses_its_cpu_threads_and_says_so(tmp_path, data_dir, omp, says):
    """On CPU the run takes one intra-op thread per process (torch's default, one per core, ran
    5 times slower once other work shared the cores: minirl.dist.spmd.set_cpu_threads);
    OMP_NUM_THREADS, set by the user, wins. The choice is on the start-up line; the last line names the run
    directory and its newest checkpoint."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | ({"OMP_NUM_THREADS": omp} if omp else {})
    argv = [sys.executable, "-m", "minirl", *small_job(tmp_path, data_dir, "trainer.save_freq=1")]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = next(line for line in proc.stdout.splitlines() if line.startswith("batch:"))
    assert says in start
    last = proc.stdout.strip().splitlines()[-1]
    run_dir = tmp_path / "bench"
    assert last.startswith(f"run directory: {run_dir} (metrics.jsonl, config.toml, newest checkpoint ckpt_1:")
    assert f"python -m minirl export --checkpoint {run_dir / 'ckpt_1'} --out DIR" in last


def test_multi_turn_step_lines_show_turns_and_tool_calls(tmp_path, capsys):
    """The cpu-agent profile's tools and turns were only in metrics.jsonl: the step line shows
    model turns per sample and the step's tool calls (0 when the policy made none)."""
    make_data = _make_data_module()
    make_data.write_task("lookup", tmp_path / "data", 16, 4, 0)
    data = tmp_path / "data" / "lookup"
    argv = ["--config", str(ROOT / "bench.toml"), "--profile", "cpu-agent", f"trainer.default_local_dir={tmp_path}"]
    argv += [f'data.train_files=["{data}/train.parquet"]', f'data.val_files=["{data}/test.parquet"]']
    argv += ["trainer.progress_bar=false", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    assert (
        main(argv + ["trainer.total_training_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]) == 0
    )
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ") and ":" in line.split()[1]]
    assert len(steps) == 2 and all(" turns=" in line and " tool_calls=" in line for line in steps), steps


def test_a_lora_run_says_what_trains_and_where_the_adapters_go(tmp_path, data_dir, capsys):
    pytest.importorskip("peft")
    assert (
        main(small_job(tmp_path, data_dir, "model.lora_rank=8", "model.lora_alpha=16", "trainer.save_hf_freq=1")) == 0
    )
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("LoRA:"))
    assert (
        "rank 8, alpha 16, on 14 linear layers (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)" in line
    )
    assert "16,384 trainable parameters of 123,840" in line
    assert f"peft adapter directory {tmp_path / 'bench' / 'hf_step_<N>'}" in line
    assert (tmp_path / "bench" / "hf_step_1" / "adapter_config.json").is_file()


def test_compare_says_a_ctrl_c_run_is_resumable(tmp_path, data_dir, monkeypatch, capsys):
    """Ctrl-C after step 2 of 4: the run checkpoints and stops; compare names the signal and the
    checkpoint to resume from. A run that raises is "crashed", with the error."""
    from minirl.trainer import Trainer

    log = Trainer._log

    def log_then_interrupt(self, metrics, step):
        log(self, metrics, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Trainer, "_log", log_then_interrupt)
    argv = small_job(tmp_path, data_dir, "trainer.total_training_steps=4", "trainer.experiment_name=stopped")
    assert main(argv) == 128 + signal.SIGINT
    capsys.readouterr()

    def log_then_raise(self, metrics, step):
        log(self, metrics, step)
        raise RuntimeError("a plugin's bug")

    monkeypatch.setattr(Trainer, "_log", log_then_raise)
    argv = small_job(tmp_path, data_dir, "trainer.total_training_steps=4", "trainer.experiment_name=crashed")
    with pytest.raises(RuntimeError):
        main(argv)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "stopped"), str(tmp_path / "crashed")]) == 0
    out = capsys.readouterr().out
    assert f"stopped at step 2 of 4 (stopped by SIGINT; resumable from {tmp_path / 'stopped' / 'ckpt_2'})" in out
    assert "crashed stopped at step 1 of 4 (crashed: RuntimeError: a plugin's bug)" in out
