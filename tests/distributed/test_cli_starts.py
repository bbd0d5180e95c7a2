"""The two other ways a world-2 CLI job starts or ends: under torchrun (the CLI must join
torchrun's group, not spawn workers of its own), and with a rank that raises (a plugin from
plugins.modules): the job must stop at once with that rank's traceback, not hang in the
survivors' collectives."""

from __future__ import annotations

import json
import sys
import time

import dist_helpers as h
import pytest

from minirl.dist import spmd

pytestmark = pytest.mark.distributed


def test_a_rank_that_raises_stops_the_job_with_its_traceback(tmp_path, data_dir):
    """Rank 1 raises after step 1 while rank 0 goes on into step 2's collectives: the job ends
    at once (not after the collective timeout) with rank 1's traceback and status 1."""
    start = time.monotonic()
    proc = h.run_cli(
        tmp_path,
        data_dir,
        "trainer.total_training_steps=3",
        "trainer.collective_timeout_s=600",
        'plugins.modules=["raise_on_rank1"]',
    )
    assert time.monotonic() - start < 300, "the survivors waited for the collective timeout"
    assert proc.returncode == 1
    assert "worker rank 1 failed" in proc.stderr
    assert "RuntimeError: injected failure on rank 1 after step 1" in proc.stderr


def test_under_torchrun_the_cli_joins_torchrun_s_group(tmp_path, data_dir):
    """`torchrun --nproc_per_node 2 -m minirl ...`: RANK/WORLD_SIZE are set, so each process is
    one rank of torchrun's world (trainer.world_size = 1 here, so a CLI that spawned workers of
    its own, or ran alone, would report world 1)."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(spmd.free_port()),
        "-m",
    ]
    proc = h.run_cli(tmp_path, data_dir, "trainer.total_training_steps=1", "trainer.world_size=1", launcher=torchrun)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 (dp 2, sp 1)" in proc.stdout
    lines = (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
