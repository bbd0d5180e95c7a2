"""`python -m minirl --config bench.toml --profile cpu` with trainer.world_size = 2: the CLI
starts the workers itself and the whole loop runs over 2 data-parallel ranks (and over an
sp = 2 group); rank 0 alone logs. test_worker_failure_cli.py runs the same job with a failing rank."""

from __future__ import annotations

import json
from pathlib import Path

import dist_helpers as h
import pytest

pytestmark = pytest.mark.distributed

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")


def _steps(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()]


def test_cpu_profile_runs_with_world_size_2(tmp_path, data_dir):
    """Two steps over dp = 2: every phase timed, metrics logged once per step (rank 0)."""
    proc = h.run_cli(tmp_path, data_dir, "trainer.total_training_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 (dp 2, sp 1)" in proc.stdout
    assert proc.stdout.count("step throughput") == 1  # the summary table, printed by rank 0 only
    steps = _steps(tmp_path)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert all(m[f"timing_s/{phase}"] > 0 for phase in PHASES)
        assert m["perf/total_response_tokens"] > 0 and m["actor/grad_norm"] >= 0
        assert 0 <= m["rollout_corr/prob_diff_mean"] <= m["rollout_corr/prob_diff_max"] < 1e-3  # reduced over ranks


def test_cpu_profile_runs_with_ulysses_sp_2(tmp_path, data_dir):
    """One step with both ranks in one sp group (dp = 1): sliced forwards, all-to-all attention."""
    proc = h.run_cli(tmp_path, data_dir, "trainer.total_training_steps=1", "actor.ulysses_sequence_parallel_size=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 (dp 1, sp 2)" in proc.stdout
    assert [m["step"] for m in _steps(tmp_path)] == [1]


def test_cpu_profile_runs_ppo_with_a_critic_at_world_size_2(tmp_path, data_dir):
    """algorithm.adv_estimator = gae over dp = 2: the FSDP2-sharded critic's values and update
    phases run on both ranks, the critic metrics are logged, and the checkpoint holds its state."""
    proc = h.run_cli(
        tmp_path, data_dir, "trainer.total_training_steps=2", "algorithm.adv_estimator=gae", "trainer.save_freq=2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "critic: preset 'tiny' + a scalar value head" in proc.stdout and "critic training time" in proc.stdout
    for m in _steps(tmp_path):
        assert m["timing_s/values"] > 0 and m["timing_s/update_critic"] > 0
        assert m["critic/grad_norm"] > 0 and "critic/vf_explained_var" in m
    saved = json.loads((tmp_path / "bench" / "ckpt_2" / "trainer_state.json").read_text())
    assert set(saved["schedulers"]) == {"actor", "critic"}
