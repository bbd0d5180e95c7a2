"""The fault catalogue: what goes wrong under a running job, and what the user finds after.

Each case injects one fault into a real run (`python -m minirl`, in this process through
`minirl.cli.main` where the fault cannot kill the test, else as a subprocess) and asserts the
exit status, the one line that names the culprit, and what is on disk afterwards: which
checkpoints are complete and intact (their CRC-32Cs match), that no temporary directory is
left, what metrics.jsonl holds, that no process of the job is left running, and, after a
restart, that the run resumes exactly (the same metrics and final weights as a run that was
never interrupted). Faults are injected deterministically with MINIRL_FAULT
(minirl.dist.fault: a phase of a step, a rank, an action), never by timing.

Sections: kill -9 in each phase of a step, then an exact resume; damaged checkpoints (bit flips
the sizes cannot see); failed checkpoint writes (full disk, I/O error, no permission); a kill or
a full disk during a background write (trainer.async_save) while the next step trains; dead and
hung ranks at world 2; misbehaving reward functions; a critic gone non-finite; data files that
changed under a checkpoint. The runs are tiny (2 prompts x 2 samples, 2 response tokens, 2
steps) so that the whole catalogue stays within a few minutes of CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from minirl.checkpoint.check import check_one
from minirl.cli import main
from tests.integration.conftest import ROOT, _make_data_module, cli_args

pytestmark = pytest.mark.slow

VOLATILE = ("timing_s/", "perf/", "memory_gib/")
SMALL = (
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",  # two mini-batches: off-policy, so old_log_prob is a pass of its own
    "rollout.n=2",
    "data.max_response_length=2",
    "actor.use_kl_loss=true",  # a reference model: the ref phase runs
    "trainer.total_training_steps=2",
    "trainer.save_freq=1",
    "trainer.save_hf_freq=2",
    "trainer.collective_timeout_s=60",
)
WORLD2 = ("data.train_batch_size=4", "actor.ppo_mini_batch_size=2")  # whole prompts per rank and mini-batch
# a kill in step 2 of a run with trainer.async_save may find ckpt_1 still being written (then the
# newest complete checkpoint is none): the cases that kill or hang a step save synchronously, so
# that ckpt_1 is complete before step 2 begins; the background write has cases of its own
SYNC = "trainer.async_save=false"
THREE = ("trainer.total_training_steps=3", "trainer.save_hf_freq=3")  # ckpt_2 written while step 3 trains
PHASES = ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights", "checkpoint")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fault_data")
    _make_data_module().write_task("copy", out, 24, 4, 0)
    return out / "copy" / "train.parquet"


def argv(root: Path, train: Path, *overrides: str) -> list[str]:
    return cli_args(root, train, *SMALL, *overrides)


def job(root: Path, train: Path, *overrides: str, fault: str = "", world: int = 1, timeout: float = 300):
    """`python -m minirl` as a process of its own, MINIRL_FAULT set; (result, seconds, tag): the
    tag is in the environment of every process of the job (leftovers() finds them)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "MINIRL_FAULT": fault, "MINIRL_FAULT_TEST_TAG": tag}
    sizes = WORLD2 if world == 2 else ()
    args = [sys.executable, "-m", "minirl", *argv(root, train, f"trainer.world_size={world}", *sizes, *overrides)]
    start = time.monotonic()
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return result, time.monotonic() - start, tag


def leftovers(tag: str, wait_s: float = 5.0) -> list[int]:
    """Processes still running with the job's tag in their environment, after up to wait_s."""
    needle = f"MINIRL_FAULT_TEST_TAG={tag}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def run_dir(root: Path) -> Path:
    return root / "bench"


def checkpoints(root: Path) -> dict[str, str]:
    """Every checkpoint-like entry of the run directory -> 'ok' / 'DAMAGED' / 'incomplete'."""
    out = {}
    for path in sorted(run_dir(root).glob("*ckpt_*")):
        if not (path / "manifest.json").exists():
            out[path.name] = "incomplete"
        else:
            out[path.name] = check_one(str(path)).split()[0]
    return out


def steps(root: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir(root) / "metrics.jsonl").read_text().splitlines()]


def stable(root: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir(root) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def same_weights(a: Path, b: Path, step: int = 2) -> bool:
    wa, wb = (load_file(run_dir(r) / f"hf_step_{step}" / "model.safetensors") for r in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("minirl: ")]


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("minirl: error:")]
    assert len(lines) == 1, err
    return lines[0]


def flip_byte(file: Path, offset: int | None = None) -> None:
    """One bit flipped in the middle of the file: same size, so only a checksum can tell."""
    data = bytearray(file.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data) -> Path:
    """The uninterrupted 2-step run (ckpt_1, ckpt_2) every resumed run must reproduce; the
    damaged-checkpoint cases start from copies of it."""
    root = tmp_path_factory.mktemp("straight")
    result, _, _ = job(root, data)
    assert result.returncode == 0, result.stderr[-5000:]
    return root


@pytest.fixture
def copied(straight, tmp_path) -> Path:
    shutil.copytree(run_dir(straight), run_dir(tmp_path))
    return tmp_path


# ---------------------------------------------------------------------------------------------
# kill -9 in each phase of a step, then the same command again: an exact resume
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_kill_9_in_a_phase_then_the_same_command_resumes_exactly(tmp_path, data, straight, phase):
    """SIGKILL in `phase` of step 2 (as the OOM killer would): ckpt_1 stays complete and intact,
    no ckpt_2 appears (a checkpoint write cut short leaves only its temporary directory); the
    same command resumes from ckpt_1, removes the temporary directory and ends with the straight
    run's metrics and weights. The phases of the step save synchronously (SYNC); the kill in the
    checkpoint phase is in the background write of ckpt_2 (the default), at the end of the run."""
    sync = () if phase == "checkpoint" else (SYNC,)
    crashed, _, tag = job(tmp_path, data, *sync, fault=f"point={phase},step=2,action=kill")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert not leftovers(tag)
    ckpts = checkpoints(tmp_path)
    assert ckpts.pop("ckpt_1") == "ok" and "ckpt_2" not in ckpts
    assert ckpts == ({".tmp_ckpt_2": "incomplete"} if phase == "checkpoint" else {})
    assert steps(tmp_path) == ([1, 2] if phase == "checkpoint" else [1])  # a step's line precedes its save
    resumed, _, _ = job(tmp_path, data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step 1: {run_dir(tmp_path) / 'ckpt_1'}" in resumed.stdout
    assert checkpoints(tmp_path) == {"ckpt_1": "ok", "ckpt_2": "ok"}
    assert stable(tmp_path) == stable(straight) and same_weights(tmp_path, straight)


# ---------------------------------------------------------------------------------------------
# damaged checkpoints: same-size bit flips, found by the checksums
# ---------------------------------------------------------------------------------------------


def largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("__*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("target", ["shard", "rng/rank0.pt", ".metadata", "config.toml"])
def test_a_bit_flip_falls_back_to_the_previous_checkpoint(copied, data, capsys, target):
    """A flipped bit in ckpt_2 (sizes unchanged): the resume names the file, moves ckpt_2 aside
    to ckpt_2.damaged and resumes from ckpt_1, redoing step 2 into a new, intact ckpt_2."""
    ckpt2 = run_dir(copied) / "ckpt_2"
    file = largest_shard(ckpt2) if target == "shard" else ckpt2 / target
    flip_byte(file)
    capsys.readouterr()
    assert main(argv(copied, data, "trainer.total_training_steps=3")) == 0
    out = capsys.readouterr().out
    assert f"warning: checkpoint {ckpt2} is damaged ({file}: CRC-32C" in out
    assert f"resuming from step 1: {run_dir(copied) / 'ckpt_1'}" in out
    assert checkpoints(copied) == {"ckpt_1": "ok", "ckpt_2": "ok", "ckpt_2.damaged": "DAMAGED", "ckpt_3": "ok"}
    assert steps(copied) == [1, 2, 3]


def test_no_intact_checkpoint_left_is_one_line(copied, data, capsys):
    """Both checkpoints damaged: one error line naming a damaged file of each; both moved aside."""
    for name in ("ckpt_1", "ckpt_2"):
        flip_byte(largest_shard(run_dir(copied) / name))
    capsys.readouterr()
    assert main(argv(copied, data, "trainer.total_training_steps=3")) == 2
    line = one_error(capsys)
    assert f"no intact checkpoint left in {run_dir(copied)}" in line and line.count(".distcp: CRC-32C") == 2
    assert checkpoints(copied) == {"ckpt_1.damaged": "DAMAGED", "ckpt_2.damaged": "DAMAGED"}


def test_resume_path_at_a_damaged_checkpoint_is_refused_naming_an_older_one(copied, data, capsys):
    """An explicit trainer.resume_from_path is not swapped silently: refused, naming the file and
    the older complete checkpoint to use instead; nothing on disk changes."""
    ckpt1, ckpt2 = run_dir(copied) / "ckpt_1", run_dir(copied) / "ckpt_2"
    flip_byte(ckpt2 / "trainer_state.json", offset=5)
    capsys.readouterr()
    explicit = ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt2}")
    assert main(argv(copied, data, "trainer.total_training_steps=3", *explicit)) == 2
    line = one_error(capsys)
    assert f"checkpoint {ckpt2} is damaged: {ckpt2 / 'trainer_state.json'}" in line and f"({ckpt1})" in line
    assert checkpoints(copied) == {"ckpt_1": "ok", "ckpt_2": "DAMAGED"}


def test_check_checkpoint_command(copied, capsys):
    """`python -m minirl check-checkpoint`: a run directory lists each checkpoint (exit 0 when all
    are intact); a flipped bit makes it exit 2 naming the file; a directory without checkpoints
    is one error line."""
    assert main(["check-checkpoint", str(run_dir(copied))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [["ok", str(run_dir(copied) / f"ckpt_{s}") + ":"] for s in (1, 2)]
    shard = largest_shard(run_dir(copied) / "ckpt_2")
    flip_byte(shard)
    assert main(["check-checkpoint", str(run_dir(copied) / "ckpt_2")]) == 2
    assert capsys.readouterr().out.startswith(f"DAMAGED {run_dir(copied) / 'ckpt_2'}: {shard}: CRC-32C")
    assert main(["check-checkpoint", str(copied)]) == 2
    assert "holds no complete checkpoint" in one_error(capsys)


# ---------------------------------------------------------------------------------------------
# failed checkpoint writes: full disk, I/O error, no permission
# ---------------------------------------------------------------------------------------------


def assert_ckpt_2_failed_and_ckpt_1_kept(root: Path, capsys, reason: str, logged: list[int]) -> None:
    """One line naming ckpt_2's temporary directory, the reason and the bytes needed; that
    directory is gone, ckpt_1 is intact and still `latest`, every logged step's metrics kept."""
    line = one_error(capsys)
    tmp = run_dir(root) / ".tmp_ckpt_2"
    assert f"writing checkpoint {tmp} failed: {reason}" in line and "it needs about" in line
    assert f"the previous checkpoint {run_dir(root) / 'ckpt_1'} is intact" in line
    assert checkpoints(root) == {"ckpt_1": "ok"}
    assert (run_dir(root) / "latest").read_text().strip() == "ckpt_1"
    assert steps(root) == logged


@pytest.mark.parametrize(
    "point, action, reason",
    [
        ("checkpoint", "enospc", "No space left on device"),  # after the shards, before the manifest
        ("checkpoint_write", "eio", "Input/output error"),  # inside DCP's writer thread
        ("checkpoint_write", "eperm", "Permission denied"),
    ],
)
def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp_path, data, capsys, monkeypatch, point, action, reason):
    """The write of ckpt_2 fails: one line naming the temporary directory, the reason and the
    bytes needed; the temporary directory is gone, ckpt_1 is intact and still `latest`, every
    step's metrics are on disk; the same command (disk fixed) resumes from ckpt_1."""
    monkeypatch.setenv("MINIRL_FAULT", f"point={point},step=2,action={action}")
    assert main(argv(tmp_path, data)) == 2
    assert_ckpt_2_failed_and_ckpt_1_kept(tmp_path, capsys, reason, logged=[1, 2])
    monkeypatch.delenv("MINIRL_FAULT")
    assert main(argv(tmp_path, data)) == 0
    assert checkpoints(tmp_path) == {"ckpt_1": "ok", "ckpt_2": "ok"} and steps(tmp_path) == [1, 2]


@pytest.mark.distributed
def test_a_full_disk_on_one_rank_stops_every_rank_with_one_line(tmp_path, data):
    """World 2, rank 1's write fails: both ranks agree and stop (no rank waits in a barrier for
    the collective timeout), one line names rank 1, ckpt_1 stays intact, nothing is left."""
    result, seconds, tag = job(tmp_path, data, fault="point=checkpoint,step=2,rank=1,action=enospc", world=2)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "writing checkpoint" in lines[0]
    assert "failed: rank 1: No space left on device" in lines[0]
    assert checkpoints(tmp_path) == {"ckpt_1": "ok"} and not leftovers(tag)


# ---------------------------------------------------------------------------------------------
# the background write (trainer.async_save): ckpt_2 is written while step 3 trains
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight3(tmp_path_factory, data) -> Path:
    """The uninterrupted 3-step run the background-write cases must reproduce."""
    root = tmp_path_factory.mktemp("straight3")
    result, _, _ = job(root, data, *THREE)
    assert result.returncode == 0, result.stderr[-5000:]
    return root


@pytest.mark.parametrize("point", ["checkpoint_write", "checkpoint"])
def test_kill_9_during_the_background_write_resumes_from_the_previous_checkpoint(tmp_path, data, straight3, point):
    """SIGKILL inside the background write of ckpt_2 (in one of DCP's writer threads, or after
    the shards, before the manifest) while step 3 trains: ckpt_1 stays complete and intact,
    ckpt_2 is only its temporary directory, and the same command resumes from ckpt_1 and ends
    with the straight run's metrics and weights."""
    crashed, _, tag = job(tmp_path, data, *THREE, fault=f"point={point},step=2,action=kill")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert not leftovers(tag)
    assert checkpoints(tmp_path) == {"ckpt_1": "ok", ".tmp_ckpt_2": "incomplete"}
    assert steps(tmp_path)[:2] == [1, 2]  # and step 3's line, if it was logged before the kill
    resumed, _, _ = job(tmp_path, data, *THREE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step 1: {run_dir(tmp_path) / 'ckpt_1'}" in resumed.stdout
    assert checkpoints(tmp_path) == {"ckpt_1": "ok", "ckpt_2": "ok", "ckpt_3": "ok"}
    assert stable(tmp_path) == stable(straight3) and same_weights(tmp_path, straight3, step=3)


def test_a_full_disk_during_the_background_write_stops_with_one_line(tmp_path, data, capsys, monkeypatch, straight3):
    """The background write of ckpt_2 fails (no space) while step 3 trains: after step 3 the run
    stops with the same one line as a blocking save, ckpt_1 is intact and still `latest`, no
    temporary directory is left, step 3's metrics are on disk; the same command (disk fixed)
    resumes from ckpt_1 and ends with the straight run's metrics and weights."""
    monkeypatch.setenv("MINIRL_FAULT", "point=checkpoint_write,step=2,action=enospc")
    assert main(argv(tmp_path, data, *THREE)) == 2
    assert_ckpt_2_failed_and_ckpt_1_kept(tmp_path, capsys, "No space left on device", logged=[1, 2, 3])
    monkeypatch.delenv("MINIRL_FAULT")
    assert main(argv(tmp_path, data, *THREE)) == 0
    assert checkpoints(tmp_path) == {"ckpt_1": "ok", "ckpt_2": "ok", "ckpt_3": "ok"}
    assert stable(tmp_path) == stable(straight3) and same_weights(tmp_path, straight3, step=3)


@pytest.mark.distributed
def test_a_full_disk_on_one_rank_during_the_background_write_stops_every_rank(tmp_path, data):
    """World 2, rank 1's background write of ckpt_2 fails while step 3 trains: the ranks agree
    on it after the same step (no rank trains on alone), one line names rank 1, ckpt_1 stays
    intact, no process is left."""
    fault = "point=checkpoint,step=2,rank=1,action=enospc"
    result, _, tag = job(tmp_path, data, *THREE, fault=fault, world=2)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "failed: rank 1: No space left on device" in lines[0]
    assert checkpoints(tmp_path) == {"ckpt_1": "ok"} and not leftovers(tag)


# ---------------------------------------------------------------------------------------------
# dead and hung ranks (world 2, gloo, the local launcher)
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["gen", "update_actor"])
def test_a_rank_killed_mid_step_stops_the_job_naming_it(tmp_path, data, phase):
    """kill -9 of rank 1 in generation or in the update (rank 0 waits in a collective with it):
    the job stops at once, not after trainer.collective_timeout_s, with one line naming rank 1
    and SIGKILL; no process is left and ckpt_1 is intact."""
    result, seconds, tag = job(tmp_path, data, SYNC, fault=f"point={phase},step=2,rank=1,action=kill", world=2)
    assert result.returncode == 1, result.stderr[-3000:]
    assert error_lines(result.stderr) == ["minirl: worker rank 1 died: killed by SIGKILL; all workers stopped"]
    assert not leftovers(tag) and checkpoints(tmp_path) == {"ckpt_1": "ok"}


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["gen", "update_actor"])
def test_a_hung_rank_stops_the_job_after_the_collective_timeout(tmp_path, data, phase):
    """SIGSTOP of rank 1 in generation or in the update: rank 0's next collective times out after
    trainer.collective_timeout_s (5 s here) and the job stops a few seconds later (counted from
    ckpt_1's manifest, written just before step 2 began), naming rank 1 as the hung rank; the
    stopped process is killed, none is left."""
    fault = f"point={phase},step=2,rank=1,action=stop"
    result, _, tag = job(tmp_path, data, SYNC, "trainer.collective_timeout_s=5", fault=fault, world=2)
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("minirl: worker rank 1 died: stopped by a signal (SIGSTOP")
    since_ckpt_1 = ended - (run_dir(tmp_path) / "ckpt_1" / "manifest.json").stat().st_mtime
    assert since_ckpt_1 < 5 + 20, since_ckpt_1  # the timeout, part of a step, the stop
    assert not leftovers(tag) and checkpoints(tmp_path) == {"ckpt_1": "ok"}


# ---------------------------------------------------------------------------------------------
# reward functions that misbehave
# ---------------------------------------------------------------------------------------------

REWARDS = """
import time

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(600)
    return 1.0

def _square(x, out):
    out.put(x * x)

def starts_a_process(data_source, solution_str, ground_truth, extra_info=None):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_square, args=(3, out))
    child.start()
    value = out.get(timeout=30)
    child.join()
    return value / 9.0
"""


@pytest.fixture
def reward_file(tmp_path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def test_a_hanging_reward_in_the_training_process_times_out(tmp_path, data, reward_file):
    """reward.num_workers = 0 and a grader that never returns: every call is abandoned after
    reward.timeout_s and scores 0 (reward/timeouts), and the run finishes."""
    over = (f"custom_reward_function.path={reward_file}", "custom_reward_function.name=hangs", "reward.timeout_s=0.2")
    start = time.monotonic()
    assert main(argv(tmp_path, data, *over, "trainer.total_training_steps=1")) == 0
    assert time.monotonic() - start < 120
    row = json.loads((run_dir(tmp_path) / "metrics.jsonl").read_text())
    assert row["reward/timeouts"] == 4 and row["score/mean"] == 0.0


def test_a_reward_function_may_start_processes(tmp_path, data, reward_file):
    """A grader that runs a process of its own inside a reward worker (not daemonic) scores."""
    over = (
        f"custom_reward_function.path={reward_file}",
        "custom_reward_function.name=starts_a_process",
        "reward.num_workers=1",
    )
    assert main(argv(tmp_path, data, *over, "trainer.total_training_steps=1")) == 0
    row = json.loads((run_dir(tmp_path) / "metrics.jsonl").read_text())
    assert row["score/mean"] == 1.0 and row["reward/errors"] == 0


# ---------------------------------------------------------------------------------------------
# a critic gone non-finite
# ---------------------------------------------------------------------------------------------


def test_a_nonfinite_critic_stops_the_run_naming_the_phase(tmp_path, data, capsys):
    """gae with a critic learning rate that overflows its weights: its optimizer steps are
    skipped, and trainer.max_nonfinite_steps such steps in a row stop the run, the phase named;
    the steps before are logged."""
    over = ("algorithm.adv_estimator=gae", "critic.optim.lr=1e30", "trainer.critic_warmup=5")
    over += ("trainer.max_nonfinite_steps=1",)
    assert main(argv(tmp_path, data, *over, "trainer.total_training_steps=4")) == 2
    line = one_error(capsys)
    assert "non-finite loss or gradient, first in phase 'update_critic'" in line
    assert "trainer.max_nonfinite_steps = 1" in line
    assert steps(tmp_path)[-1] == int(line.split("step ")[1].split(":")[0])


# ---------------------------------------------------------------------------------------------
# data files that changed under a checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def own_data(data, tmp_path) -> Path:
    path = tmp_path / "train.parquet"
    shutil.copy(data, path)
    return path


def rewrite(path: Path, change: bool) -> None:
    """The same file written again: other rows (reversed) when `change`, else the same bytes
    with a new modification time."""
    if change:
        table = pq.read_table(path)
        pq.write_table(table.take(list(reversed(range(table.num_rows)))), path)
    else:
        os.utime(path, (time.time() + 5, time.time() + 5))


@pytest.mark.parametrize(
    "change, extra, rc, needle",
    [
        (True, (), 2, "resume refused: the training data changed since checkpoint"),
        (True, ("trainer.resume_ignore_config_changes=true",), 0, "resuming despite changed data files"),
        (False, (), 0, "data files modified since the checkpoint (same size and row groups)"),
    ],
)
def test_changed_data_files_are_refused_on_resume(tmp_path, own_data, capsys, change, extra, rc, needle):
    """Other rows under the same name: the resume is refused naming the file (its data position
    would point at other prompts) unless trainer.resume_ignore_config_changes; a file only
    touched (same size and row groups) resumes with a notice."""
    assert main(argv(tmp_path, own_data, "trainer.total_training_steps=1")) == 0
    rewrite(own_data, change)
    capsys.readouterr()
    assert main(argv(tmp_path, own_data, *extra)) == rc
    captured = capsys.readouterr()
    text = captured.err if rc else captured.out
    if rc:
        assert "Traceback" not in text and len([x for x in text.splitlines() if x.startswith("minirl: error:")]) == 1
    assert needle in text and str(own_data) in text
    assert steps(tmp_path) == ([1] if rc else [1, 2])
