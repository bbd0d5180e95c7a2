"""Resume is exact: a run killed (SIGKILL, or SIGTERM) and restarted with trainer.resume_mode =
'auto' logs the same metrics and ends with the same weights as a run that was never interrupted,
at world 1 and at world 2 (gloo, FSDP2). Checkpoints are atomic, pruned, verified on load.

The jobs are real `python -m minirl` processes (a SIGKILL must hit a process, not a test); a
job to be killed runs through tests/integration/crash_run.py, which kills it at a named point.
The data has 24 prompts, 8 per step: an epoch is 3 steps, so the checkpoint at step 3 sits
exactly on the epoch boundary (verl's resume there trains 0 steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import ROOT, _make_data_module, cli_args

VOLATILE = ("timing_s/", "perf/", "memory_gib/")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume_data")
    _make_data_module().write_task("copy", out, 24, 4, 0)
    return out


def job(run_root: Path, data: Path, *overrides: str, world: int = 1, crash: str = "", wait: bool = True):
    """`python -m minirl --config bench.toml --profile cpu`, 6 small steps, metrics to jsonl;
    `crash` ("POINT:STEP[:RANK]"): killed there (tests/integration/crash_run.py)."""
    args = [
        sys.executable,
        "-m",
        "tests.integration.crash_run" if crash else "minirl",
        *cli_args(
            run_root,
            data / "copy" / "train.parquet",
            "trainer.total_training_steps=6",
            f"trainer.world_size={world}",
            "trainer.collective_timeout_s=120",
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=4",
            "trainer.save_hf_freq=6",
            *overrides,
        ),
    ]
    env = {**os.environ, "MINIRL_TEST_CRASH": crash}
    kwargs = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return subprocess.Popen(args, **kwargs)
    return subprocess.run(args, timeout=400, check=False, **kwargs)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable(rows: list[dict]) -> list[dict]:
    """Every key except wall-clock timings, throughputs and memory, which no two runs share."""
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def assert_same_run(resumed: Path, straight: Path) -> None:
    got, want = stable(metrics(resumed)), stable(metrics(straight))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got == want
    w_got = load_file(resumed / "hf_step_6" / "model.safetensors")
    w_want = load_file(straight / "hf_step_6" / "model.safetensors")
    assert w_got.keys() == w_want.keys()
    for name in w_want:
        assert torch.equal(w_got[name], w_want[name]), name


def assert_clean_exit(proc, code: int) -> None:
    # 12,000 characters hold every rank's report: a hang needs the peer's stack too
    assert proc.returncode == code, proc.stderr[-12000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-12000:]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, small_data) -> Path:
    """The uninterrupted 6-step run at world 1 that every resumed world-1 run must reproduce."""
    root = tmp_path_factory.mktemp("straight1")
    assert_clean_exit(job(root, small_data, "trainer.save_freq=3"), 0)
    return root / "bench"


@pytest.fixture(scope="module")
def straight2(tmp_path_factory, small_data) -> Path:
    root = tmp_path_factory.mktemp("straight2")
    assert_clean_exit(job(root, small_data, "trainer.save_freq=3", world=2), 0)
    return root / "bench"


def test_sigkill_then_auto_resume_is_bit_exact(tmp_path, small_data, straight):
    """Killed during step 4 (after its metrics line): the resume from ckpt_3 (an epoch boundary)
    drops that line, redoes steps 4-6 and matches the straight run in every metric and weight."""
    crashed = job(tmp_path, small_data, "trainer.save_freq=3", crash="after_step:4")
    assert crashed.returncode == -signal.SIGKILL
    assert [r["step"] for r in metrics(tmp_path / "bench")] == [1, 2, 3, 4]
    resumed = job(tmp_path, small_data, "trainer.save_freq=3")
    assert_clean_exit(resumed, 0)
    assert f"resuming from step 3: {tmp_path / 'bench' / 'ckpt_3'}" in resumed.stdout
    assert_same_run(tmp_path / "bench", straight)


@pytest.mark.distributed
def test_sigkill_then_auto_resume_is_bit_exact_at_world_2(tmp_path, small_data, straight2):
    """The same at world 2 with FSDP2 shards: rank 1 dies, the job stops, the resume is exact."""
    crashed = job(tmp_path, small_data, "trainer.save_freq=3", world=2, crash="after_step:4:1")
    assert crashed.returncode != 0
    resumed = job(tmp_path, small_data, "trainer.save_freq=3", world=2)
    assert_clean_exit(resumed, 0)
    assert "resuming from step 3" in resumed.stdout
    assert_same_run(tmp_path / "bench", straight2)


@pytest.mark.distributed
def test_kill_between_shards_keeps_the_previous_checkpoint(tmp_path, small_data, straight2):
    """Rank 0 dies inside the write of ckpt_6 after its shard: no ckpt_6 appears, `latest` still
    names ckpt_3, the next start resumes from ckpt_3, removes the half-written one and finishes
    exactly like the straight run."""
    crashed = job(tmp_path, small_data, "trainer.save_freq=3", world=2, crash="checkpoint:6:0")
    run = tmp_path / "bench"
    assert crashed.returncode != 0
    assert (run / ".tmp_ckpt_6").is_dir() and not (run / "ckpt_6").exists()
    assert (run / "latest").read_text().strip() == "ckpt_3"
    resumed = job(tmp_path, small_data, "trainer.save_freq=3", world=2)
    assert_clean_exit(resumed, 0)
    assert "resuming from step 3" in resumed.stdout
    assert not (run / ".tmp_ckpt_6").exists() and (run / "ckpt_6" / "manifest.json").exists()
    assert_same_run(run, straight2)


def _sigterm_after_first_step(proc, run_dir: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        if lines:
            proc.send_signal(signal.SIGTERM)
            return
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError("the job logged no step in 300 s")


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_sigterm_checkpoints_exits_and_resumes_exactly(tmp_path, small_data, world, request):
    """SIGTERM (to the job's first process, as Kubernetes sends it) mid-run: the step finishes, a
    checkpoint is written, one line says how to resume, the exit is 143 with no traceback; the
    resume then matches the straight run."""
    straight_run = request.getfixturevalue("straight" if world == 1 else "straight2")
    proc = job(tmp_path, small_data, world=world, wait=False)
    _sigterm_after_first_step(proc, tmp_path / "bench")
    out, err = proc.communicate(timeout=300)
    proc.stdout, proc.stderr = out, err
    assert_clean_exit(proc, 128 + signal.SIGTERM)
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1 and "to resume, run the same command again" in stopped[0]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 1 <= step < 6 and (tmp_path / "bench" / f"ckpt_{step}" / "manifest.json").exists()
    resumed = job(tmp_path, small_data, world=world)
    assert_clean_exit(resumed, 0)
    assert f"resuming from step {step}" in resumed.stdout
    assert_same_run(tmp_path / "bench", straight_run)


@pytest.mark.distributed
def test_world_1_checkpoint_resumes_at_world_2(tmp_path, small_data, straight):
    """DCP reshards: ckpt_3 of a one-process run continues on 2 ranks to step 6 (not bit-exact:
    each rank now samples its own half of the batch), saying that the world changed."""
    run = tmp_path / "bench"
    run.mkdir()
    (run / "ckpt_3").symlink_to(straight / "ckpt_3", target_is_directory=True)
    resumed = job(tmp_path, small_data, world=2)
    assert_clean_exit(resumed, 0)
    assert "resuming from step 3" in resumed.stdout and "resharded" in resumed.stdout
    assert [r["step"] for r in metrics(run)] == [4, 5, 6]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sigkill_then_resume_on_cuda_matches_the_straight_run(tmp_path, small_data):
    """On one GPU (one-rank NCCL group, FSDP2 bf16 compute over fp32 masters, CUDA RNG state):
    a killed-and-resumed run reproduces the uninterrupted one's metrics and weights."""
    cuda = ("trainer.device=cuda", "trainer.save_freq=3")
    assert_clean_exit(job(tmp_path / "a", small_data, *cuda), 0)
    crashed = job(tmp_path / "b", small_data, *cuda, crash="after_step:4")
    assert crashed.returncode == -signal.SIGKILL
    assert_clean_exit(job(tmp_path / "b", small_data, *cuda), 0)
    assert_same_run(tmp_path / "b" / "bench", tmp_path / "a" / "bench")
