"""Asynchronous training as a user runs it: `python -m minirl ... async_training.enable=true` on
CPU with gloo, 1 (or 2) rollout processes and 2 trainer processes.

What each test pins down: the staleness bound and the weight versions per step, weights synced
every trigger_parameter_sync_step steps, two rollout ranks taking turns, partial rollouts (tokens
of one sample sampled by two versions) and their absence when turned off, resume at the next
untrained batch (none trained twice), a killed rollout or trainer rank stopping the whole job
with its rank named, SIGTERM checkpointing, the copy task learnt, and rollout overlapping training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_helpers as h
import pytest

pytestmark = pytest.mark.distributed

ASYNC = [
    "trainer.world_size=3",
    "rollout.n_gpus_per_node=1",
    "async_training.enable=true",
    "async_training.require_batches=2",
]


def _run(tmp_path: Path, data_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return h.run_cli(tmp_path, data_dir, *ASYNC, *overrides)


def _steps(tmp_path: Path, name: str = "bench") -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_async_job_trains_one_step_off_policy(tmp_path, data_dir):
    """1 rollout + 2 trainer ranks, 4 steps, one-step off-policy (the default staleness of 1):
    every step trains the next batch, at most one version behind, after a timed weight sync."""
    proc = _run(tmp_path, data_dir, "trainer.total_training_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 (dp 2, sp 1)" in proc.stdout and "staleness <= 1" in proc.stdout
    steps = _steps(tmp_path)
    assert [m["async/batch_index"] for m in steps] == [0, 1, 2, 3]
    assert [m["async/version"] for m in steps] == [0, 1, 2, 3]  # the weights of the step before
    for m in steps:
        assert m["async/staleness/max"] <= 1 and m["async/dropped_samples"] == 0
        assert m["timing_s/weight_transfer"] > 0 and m["async/weight_transfer_gb"] > 0
        assert m["perf/total_response_tokens"] > 0 and m["actor/grad_norm"] >= 0
    assert max(m["async/staleness/max"] for m in steps) == 1  # the rollout did run ahead
    # the old log-probs are the rollout's: no pass ran, so no time and no throughput (once a
    # near-zero time gave 2.4e8 tok/s), and the end table says skipped and why
    assert not any("timing_s/old_log_prob" in m or "perf/old_log_prob_throughput_per_gpu" in m for m in steps)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("prev logprob throughput"))
    assert "skipped" in row and "behaviour policy" in row


def test_staleness_zero_is_on_policy(tmp_path, data_dir):
    proc = _run(tmp_path, data_dir, "trainer.total_training_steps=3", "async_training.staleness_threshold=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for m in _steps(tmp_path):
        assert m["async/staleness/max"] == 0 and m["async/partial_share"] == 0


def test_weights_sync_every_trigger_steps(tmp_path, data_dir):
    proc = _run(tmp_path, data_dir, "trainer.total_training_steps=5", "async_training.trigger_parameter_sync_step=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(tmp_path)
    assert [m["async/version"] for m in steps] == [0, 0, 1, 1, 2]
    assert [m["timing_s/weight_transfer"] > 0 for m in steps] == [False, True, False, True, False]
    assert all(m["async/staleness/max"] <= 1 for m in steps)


def test_two_rollout_ranks_take_turns(tmp_path, data_dir):
    proc = _run(
        tmp_path, data_dir, "trainer.total_training_steps=4", "trainer.world_size=4", "rollout.n_gpus_per_node=2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["async/batch_index"] for m in _steps(tmp_path)] == [0, 1, 2, 3]


@pytest.mark.parametrize("partial", [True, False])
def test_partial_rollouts_continue_across_a_weight_sync(tmp_path, data_dir, partial):
    """Long responses (256 tokens, EOS ignored) are still decoding when the trainer publishes new
    weights: with partial rollouts they continue under the new version (their tokens span two
    versions), without them they finish on the old one first."""
    proc = _run(
        tmp_path,
        data_dir,
        "trainer.total_training_steps=4",
        "data.max_response_length=256",
        "rollout.ignore_eos=true",
        f"async_training.partial_rollout={str(partial).lower()}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(tmp_path)
    shares = [m["async/partial_share"] for m in steps]
    assert (max(shares) > 0) if partial else (max(shares) == 0), shares
    assert all(m["async/staleness/max"] <= 1 for m in steps)


def test_resume_continues_at_the_next_untrained_batch(tmp_path, data_dir):
    """A run checkpointed at step 2 and continued to 4 trains batches 0, 1, then 2, 3: the batches
    the rollout had in flight at the stop are generated again, none is trained twice."""
    first = _run(tmp_path, data_dir, "trainer.total_training_steps=2", "trainer.save_freq=2")
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "bench" / "ckpt_2" / "trainer_state.json").read_text())
    assert state["extra"]["async"]["next_index"] == 2 and state["data"]["batches_drawn"] == 2
    second = _run(tmp_path, data_dir, "trainer.total_training_steps=4", "trainer.save_freq=2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming" in second.stdout.lower()
    indices = [m["async/batch_index"] for m in _steps(tmp_path)]
    assert indices == [0, 1, 2, 3]


def _crash(tmp_path: Path, data_dir: Path, where: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "MINIRL_TEST_ASYNC": where}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(h.__file__).parent), env.get("PYTHONPATH", "")) if p)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "async_crash", *h.cli_args(tmp_path, data_dir, *ASYNC, *overrides)],
        cwd=h.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize("where, rank", [("rollout:2", 2), ("trainer:2:1", 1)])
def test_a_killed_rank_stops_the_whole_job(tmp_path, data_dir, where, rank):
    """A rollout rank (rank 2) or a trainer rank SIGKILLed mid-run: the job stops with one error
    naming the rank and its signal, and leaves no process behind."""
    proc, seconds = _crash(tmp_path, data_dir, where, "trainer.total_training_steps=20")
    assert proc.returncode != 0 and seconds < 120
    assert f"rank {rank}" in proc.stderr and "SIGKILL" in proc.stderr, proc.stderr[-2000:]
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftover


def test_sigterm_checkpoints_the_trainer_and_the_data_position(tmp_path, data_dir):
    args = h.cli_args(tmp_path, data_dir, *ASYNC, "trainer.total_training_steps=200")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minirl", *args], cwd=h.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    metrics = tmp_path / "bench" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    (ckpt,) = sorted((tmp_path / "bench").glob("ckpt_*"))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    step = int(ckpt.name.split("_")[1])
    assert state["extra"]["async"]["next_index"] == step  # every step trained one batch


@pytest.mark.slow
def test_tiny_model_learns_the_copy_task_asynchronously(tmp_path, data_dir):
    """The cpu profile's recipe, one-step off-policy on 1 rollout + 2 trainer processes: greedy
    validation from about chance to >= 0.9 (measured: 0.0 -> 0.8 at step 100 -> 1.0 at step 200)."""
    proc = h.run_cli(
        tmp_path,
        data_dir,
        *ASYNC,
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=8",
        "rollout.n=16",
        "trainer.total_training_steps=200",
        "trainer.val_before_train=true",
        "trainer.test_freq=200",
        f'data.val_files=["{data_dir}/copy/test.parquet"]',
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(tmp_path)
    first = json.loads((tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["val/score/mean"] <= 0.2
    assert steps[-1]["val/score/mean"] >= 0.9
    assert max(m["async/staleness/max"] for m in steps if "async/staleness/max" in m) == 1


def test_rollout_overlaps_training(tmp_path, data_dir):
    """The trainer's wait for rollouts (timing_s/gen) asynchronous vs synchronous, same work
    (48-token responses): one step off-policy, the next batch is generated while the trainer
    trains, so the wait is a fraction of a synchronous step's generation."""
    common = ["trainer.total_training_steps=6", "data.max_response_length=48", "rollout.ignore_eos=true"]
    sync = h.run_cli(tmp_path / "sync", data_dir, *common)
    assert sync.returncode == 0, sync.stderr[-3000:]
    proc = _run(tmp_path / "async", data_dir, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wait_sync = sum(m["timing_s/gen"] for m in _steps(tmp_path / "sync")[1:]) / 5
    wait_async = sum(m["timing_s/gen"] for m in _steps(tmp_path / "async")[1:]) / 5
    print(f"trainer wait for rollouts: synchronous {wait_sync:.3f} s, asynchronous {wait_async:.3f} s a step")
    assert wait_async < 0.5 * wait_sync


def test_decoupled_ppo_recomputes_the_proximal_log_probs(tmp_path, data_dir):
    """compute_prox_log_prob: the trainer's own pass gives the old log-probs (the proximal
    policy), and the behaviour weight exp(lp_prox - lp_rollout), truncated at the cap, is logged."""
    proc = _run(
        tmp_path,
        data_dir,
        "trainer.total_training_steps=3",
        "async_training.compute_prox_log_prob=true",
        "actor.tis_imp_ratio_cap=2.0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the trainer's proximal pass" in proc.stdout
    for m in _steps(tmp_path):
        assert m["timing_s/old_log_prob"] > 0 and 0 < m["actor/tis_weight_mean"] <= 2.0


def test_async_multi_turn_job_calls_tools_and_reports_their_time(tmp_path, data_dir):
    """Multi-turn rollouts trained asynchronously: the rollout rank's loops call a tool every
    sample (asks_lookup.py), and each step reports the tool seconds since the last one and those
    the rollout engine had nothing else to decode."""
    proc = _run(
        tmp_path,
        data_dir,
        "trainer.total_training_steps=2",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tool_config_path=examples/tools/lookup.yaml",
        'plugins.modules=["asks_lookup"]',
        "rollout.agent.default_agent_loop=asks_lookup",
        "data.max_response_length=256",  # two one-token turns and the tool's reply
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(tmp_path)
    assert [m["async/batch_index"] for m in steps] == [0, 1]
    assert [m["agent/tool_calls"] for m in steps] == [8.0, 8.0]  # 4 prompts x 2 samples, one call each
    for m in steps:
        assert 0 <= m["agent/engine_idle_on_tools_s"] <= m["agent/tool_wall_s"] + 1e-6
    assert sum(m["agent/tool_wall_s"] for m in steps) > 0
