"""Checkpoint handling that needs no killed process, run in-process through the CLI's main():
the epoch-boundary resume, retention, damaged files, config changes, never overwriting a
previous run, which runs auto resumes, the checkpoint hook, metrics.jsonl staying strict JSON and
a resumed run's summary (with the console line of a custom reward file)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minirl.checkpoint.resume import check_config, config_differences
from minirl.cli import main
from minirl.config.load import load_config, to_toml
from tests.integration.conftest import _make_data_module, cli_args


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt_data")
    _make_data_module().write_task("copy", out, 24, 4, 0)  # 3 steps per epoch at 8 prompts per step
    return out


def run(root: Path, data: Path, *overrides: str) -> int:
    overrides = ("data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=2", *overrides)
    return main(cli_args(root, data / "copy" / "train.parquet", *overrides))


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("minirl: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_resume_at_an_epoch_boundary_trains_the_remaining_steps(tmp_path, small_data, capsys):
    """verl's bug: a checkpoint at the end of epoch 1, resumed with total_epochs = 2, trained 0
    steps. Here the second epoch (steps 4-6) is trained and logged after steps 1-3."""
    assert (
        run(tmp_path, small_data, "trainer.total_training_steps=0", "trainer.total_epochs=1", "trainer.save_freq=3")
        == 0
    )
    assert (
        run(tmp_path, small_data, "trainer.total_training_steps=0", "trainer.total_epochs=2", "trainer.save_freq=3")
        == 0
    )
    out = capsys.readouterr().out
    assert f"resuming from step 3: {tmp_path / 'bench' / 'ckpt_3'}" in out
    assert steps(tmp_path / "bench") == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "bench" / "ckpt_6" / "manifest.json").exists()


def test_a_finished_run_is_not_resumed_the_same_command_starts_another(tmp_path, small_data, capsys):
    """Running a finished run's command again starts a fresh run in <name>-2 and says the first
    one is complete; pointed at explicitly (resume_path), its checkpoint has nothing to train and
    the line says how to go on."""
    assert run(tmp_path, small_data, "trainer.total_training_steps=2", "trainer.save_freq=2") == 0
    first = (tmp_path / "bench" / "metrics.jsonl").read_text()
    assert run(tmp_path, small_data, "trainer.total_training_steps=2") == 0
    out = capsys.readouterr().out
    assert f"starting fresh in {tmp_path / 'bench-2'}, not resuming: the run in {tmp_path / 'bench'} is complete" in out
    assert (tmp_path / "bench" / "metrics.jsonl").read_text() == first and steps(tmp_path / "bench-2") == [1, 2]
    explicit = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'bench' / 'ckpt_2'}"]
    assert run(tmp_path, small_data, "trainer.total_training_steps=2", *explicit) == 0
    assert "nothing to train: the checkpoint is at step 2 of 2, the run is complete" in capsys.readouterr().out


def test_a_resumed_run_ends_with_the_validation_scores_of_the_whole_run(tmp_path, small_data, capsys):
    """The end-of-run validation line of a resumed run lists the scores logged before the resume
    too (read from metrics.jsonl), not only those of its own steps."""
    val = [f'data.val_files=["{small_data / "copy" / "test.parquet"}"]', "trainer.test_freq=1"]
    assert run(tmp_path, small_data, *val, "trainer.total_training_steps=2", "trainer.save_freq=2") == 0
    capsys.readouterr()
    assert run(tmp_path, small_data, *val, "trainer.total_training_steps=3") == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("validation score"))
    assert [int(s) for s in re.findall(r"\(step (\d+)\)", line)] == [1, 2, 3], line


def test_a_custom_reward_file_is_named_at_start(tmp_path, small_data, capsys):
    """A custom_reward_function file replaces the registered rewards: the console says so."""
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    crf = [f"custom_reward_function.path={reward}", "custom_reward_function.name=score"]
    assert run(tmp_path, small_data, *crf, "trainer.total_training_steps=1") == 0
    assert f"reward: score() from {reward} (custom_reward_function)" in capsys.readouterr().out


def test_max_ckpt_to_keep_keeps_the_two_newest(tmp_path, small_data):
    assert (
        run(tmp_path, small_data, "trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2")
        == 0
    )
    run_dir = tmp_path / "bench"
    assert sorted(p.name for p in run_dir.glob("ckpt_*")) == ["ckpt_3", "ckpt_4"]
    assert (run_dir / "latest").read_text().strip() == "ckpt_4"
    assert not list(run_dir.glob(".tmp_ckpt_*"))


@pytest.mark.parametrize(
    "damage, named",
    [
        ("truncate:__0_0.distcp", "__0_0.distcp"),
        ("truncate:__0_3.distcp", "__0_3.distcp"),
        ("delete:rng/rank0.pt", "rank0.pt"),
        ("garble:trainer_state.json", "trainer_state.json"),
        ("garble:.metadata", ".metadata"),
        ("garble:manifest.json", "manifest.json"),
    ],
)
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, small_data, capsys, damage, named):
    """Truncated, missing or garbled files: exit 2, one line naming the file, no traceback."""
    assert run(tmp_path, small_data, "trainer.total_training_steps=2", "trainer.save_freq=2") == 0
    how, rel = damage.split(":")
    target = tmp_path / "bench" / "ckpt_2" / rel
    if how == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "delete":
        target.unlink()
    else:  # same size, other bytes: only the reader can tell
        target.write_bytes(b"\x00" * target.stat().st_size)
    capsys.readouterr()
    assert run(tmp_path, small_data, "trainer.total_training_steps=4") == 2
    assert named in one_error_line(capsys)


def test_a_math_changing_key_starts_fresh_under_auto_and_is_refused_under_resume_path(tmp_path, small_data, capsys):
    """lr and the estimator changed: an explicit resume_path is refused, both keys named; auto
    (running the command again) starts a fresh run in <name>-2 with one line naming them; the
    run's length may change freely; resume_ignore_config_changes resumes anyway."""
    assert run(tmp_path, small_data, "trainer.total_training_steps=2", "trainer.save_freq=2") == 0
    capsys.readouterr()
    changed = ["actor.optim.lr=0.5", "algorithm.adv_estimator=rloo", "trainer.total_training_steps=3"]
    explicit = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'bench' / 'ckpt_2'}"]
    assert run(tmp_path, small_data, *changed, *explicit) == 2
    line = one_error_line(capsys)
    assert "actor.optim.lr = 0.002 (checkpoint) vs 0.5 (now)" in line
    assert "algorithm.adv_estimator" in line and "total_training_steps" not in line
    assert run(tmp_path, small_data, *changed, "trainer.resume_ignore_config_changes=true") == 0
    assert steps(tmp_path / "bench") == [1, 2, 3]
    capsys.readouterr()
    assert run(tmp_path, small_data, *changed) == 0  # ckpt_2 still newest: step 2 of 3, other keys
    notice = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("starting fresh"))
    assert notice.startswith(f"starting fresh in {tmp_path / 'bench-2'}, not resuming: {tmp_path / 'bench' / 'ckpt_2'}")
    assert "actor.optim.lr = 0.002 (checkpoint) vs 0.5 (now)" in notice and "algorithm.adv_estimator" in notice
    assert steps(tmp_path / "bench") == [1, 2, 3] and steps(tmp_path / "bench-2") == [1, 2, 3]


def test_a_fresh_start_never_touches_a_previous_run(tmp_path, small_data, capsys):
    """Without a checkpoint to resume (or with resume_mode = 'disable') a second run with the same
    name goes to <name>-2, and says so; the first run's files are as they were."""
    assert run(tmp_path, small_data, "trainer.total_training_steps=2") == 0
    first = (tmp_path / "bench" / "metrics.jsonl").read_text()
    assert run(tmp_path, small_data, "trainer.total_training_steps=1") == 0
    assert run(tmp_path, small_data, "trainer.total_training_steps=1", "trainer.resume_mode=disable") == 0
    out = capsys.readouterr().out
    assert f"starting fresh in {tmp_path / 'bench-2'}" in out and f"starting fresh in {tmp_path / 'bench-3'}" in out
    assert (tmp_path / "bench" / "metrics.jsonl").read_text() == first
    assert steps(tmp_path / "bench-2") == [1] and steps(tmp_path / "bench-3") == [1]


def test_the_checkpoint_hook_fires_with_the_complete_directory(tmp_path, small_data, monkeypatch):
    """minirl_on_checkpoint_saved sees each full checkpoint once, after it is complete."""
    plugin = tmp_path / "ckpt_watch.py"
    log = tmp_path / "seen.txt"
    plugin.write_text(
        "import os\nfrom minirl import hookimpl\n"
        "@hookimpl\ndef minirl_on_checkpoint_saved(step, path):\n"
        f"    complete = os.path.exists(os.path.join(path, 'manifest.json'))\n"
        f"    open({str(log)!r}, 'a').write(f'{{step}} {{os.path.basename(path)}} {{complete}}\\n')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        run(
            tmp_path,
            small_data,
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            'plugins.modules=["ckpt_watch"]',
        )
        == 0
    )
    assert log.read_text().splitlines() == ["1 ckpt_1 True", "2 ckpt_2 True"]


def test_metrics_jsonl_is_strict_json_and_a_resume_drops_lines_past_the_checkpoint(tmp_path):
    """NaN is not JSON (null is); a crashed run's lines past the checkpoint, and a line cut short,
    are dropped on resume, so every step appears exactly once."""
    from minirl.config.schema import TrainerConfig
    from minirl_plugins.observe.loggers import JsonlLogger

    logger = JsonlLogger(TrainerConfig(), str(tmp_path))
    for step in (1, 2, 3):
        logger.log({"loss": float("nan") if step == 2 else 0.5, "x": float("inf")}, step)
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # the crash
    rows = [
        json.loads(line, parse_constant=lambda c: pytest.fail(c))
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[:3]
    ]
    assert rows[1] == {"step": 2, "loss": None, "x": None}
    resumed = JsonlLogger(TrainerConfig(), str(tmp_path))
    resumed.resume(2)
    resumed.log({"loss": 0.25}, 3)
    resumed.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_tensorboard_continues_the_same_run_after_a_resume(tmp_path):
    """The resumed writer purges the events the interrupted run wrote past the checkpoint, so
    each step has one value: the resumed one."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minirl.config.schema import TrainerConfig
    from minirl_plugins.observe.loggers import TensorboardLogger

    first = TensorboardLogger(TrainerConfig(), str(tmp_path))
    for step in (1, 2, 3, 4):
        first.log({"loss": float(step)}, step)
    first.close()  # the crash happened after step 4; the checkpoint is at step 2
    resumed = TensorboardLogger(TrainerConfig(), str(tmp_path))
    resumed.resume(2)
    resumed.log({"loss": 30.0}, 3)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_second_signal_stops_at_once(tmp_path):
    """Two SIGTERMs more than a second apart: the second exits immediately (128 + 15) without
    waiting for the step or the checkpoint; a repeat within the second counts once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import os, signal, sys, time\n"
        "from minirl.dist.signals import StopRequest\n"
        "with StopRequest() as stop:\n"
        "    print('ready', flush=True)\n"
        "    deadline = time.monotonic() + 30\n"
        "    while time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "print('finished the step', stop.signum, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # the same signal delivered twice (scheduler + forwarding)
    time.sleep(1.3)
    assert proc.poll() is None, "a repeat within a second must not stop the process"
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 15 and proc.returncode == 128 + signal.SIGTERM  # the step would run 30 s
    assert "finished the step" not in out and "second SIGTERM: stopping now" in err and "Traceback" not in err


def test_a_gae_run_resumes_its_critic_exactly(tmp_path, small_data):
    """PPO with a critic: the checkpoint carries the value model, its optimizer and its LR
    schedule, so a run stopped at step 2 and resumed logs the same steps 3-4 as a straight run,
    critic metrics included (they depend on the critic's weights and Adam state)."""
    gae = ["algorithm.adv_estimator=gae", "critic.optim.lr=0.01", "trainer.critic_warmup=1"]
    assert run(tmp_path / "straight", small_data, *gae, "trainer.total_training_steps=4") == 0
    assert run(tmp_path / "resumed", small_data, *gae, "trainer.total_training_steps=2", "trainer.save_freq=2") == 0
    assert run(tmp_path / "resumed", small_data, *gae, "trainer.total_training_steps=4") == 0
    volatile = ("timing_s/", "perf/", "memory_gib/")
    logged = {}
    for name in ("straight", "resumed"):
        lines = (tmp_path / name / "bench" / "metrics.jsonl").read_text().splitlines()
        logged[name] = [{k: v for k, v in json.loads(x).items() if not k.startswith(volatile)} for x in lines]
    assert [r["step"] for r in logged["resumed"]] == [1, 2, 3, 4]
    assert "critic/vf_loss" in logged["resumed"][3] and "actor/pg_loss" in logged["resumed"][3]
    assert logged["resumed"] == logged["straight"]


def test_critic_keys_are_math_only_for_a_run_with_a_critic(tmp_path, small_data, capsys):
    """A grpo run resumes with a [critic] key changed (no critic, no effect), and so does a
    checkpoint written before the [critic] section existed (its config.toml lacks it); a gae run
    refuses a changed critic lr like any math-changing key."""
    assert run(tmp_path, small_data, "trainer.total_training_steps=2", "trainer.save_freq=2") == 0
    assert run(tmp_path, small_data, "trainer.total_training_steps=3", "critic.optim.lr=0.1") == 0
    assert steps(tmp_path / "bench") == [1, 2, 3]
    current = load_config(None, []).to_dict()
    before = {k: v for k, v in current.items() if k != "critic"}
    before["trainer"] = {k: v for k, v in before["trainer"].items() if k != "critic_warmup"}
    unused = ("critic.", "trainer.critic_warmup")
    assert check_config(to_toml(load_config(None, [])), current, "ckpt", False, unused=unused) == []
    assert config_differences(before, current, unused=unused) == []
    assert "critic.cliprange_value = None (checkpoint) vs 0.5 (now)" in config_differences(before, current)
    gae = tmp_path / "gae"
    assert (
        run(gae, small_data, "algorithm.adv_estimator=gae", "trainer.total_training_steps=2", "trainer.save_freq=2")
        == 0
    )
    capsys.readouterr()
    explicit = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={gae / 'bench' / 'ckpt_2'}"]
    assert run(gae, small_data, "algorithm.adv_estimator=gae", "critic.optim.lr=0.1", *explicit) == 2
    assert "critic.optim.lr = 1e-05 (checkpoint) vs 0.1 (now)" in one_error_line(capsys)


def test_sigterm_during_a_background_write_waits_for_it_then_saves_and_stops(tmp_path, small_data, monkeypatch, capsys):
    """trainer.async_save: ckpt_1's write is held until the SIGTERM has arrived (during step 2),
    so it is in flight for sure. The run finishes step 2, waits for ckpt_1, writes ckpt_2 and
    exits 143 only once both are complete, with the one line naming ckpt_2."""
    import os
    import signal
    import threading

    from minirl.checkpoint import state as ckpt_state
    from minirl.trainer import Trainer

    signalled, write, log = threading.Event(), ckpt_state._write_rank_files, Trainer._log

    def held(tmp, snap, group=None):
        if snap.step == 1:
            assert signalled.wait(120), "no SIGTERM came"
        return write(tmp, snap, group)

    def log_then_signal(self, metrics, step):
        log(self, metrics, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            signalled.set()

    monkeypatch.setattr(ckpt_state, "_write_rank_files", held)
    monkeypatch.setattr(Trainer, "_log", log_then_signal)
    assert run(tmp_path, small_data, "trainer.total_training_steps=4", "trainer.save_freq=1") == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM after step 2: checkpoint {tmp_path / 'bench' / 'ckpt_2'} written" in err
    assert sorted(p.name for p in (tmp_path / "bench").glob("*ckpt_*")) == ["ckpt_1", "ckpt_2"]
    assert all((tmp_path / "bench" / f"ckpt_{s}" / "manifest.json").exists() for s in (1, 2))
    assert steps(tmp_path / "bench") == [1, 2]


def test_the_run_ends_only_once_its_last_background_write_is_complete(tmp_path, small_data, monkeypatch):
    """A slow disk (every background write takes 0.5 s more): when the run returns, the last
    checkpoint is complete and the checkpoint hook has fired for every save, in order."""
    import time

    from minirl.checkpoint import state as ckpt_state
    from minirl.trainer import Trainer

    write, saved = ckpt_state._write_rank_files, []

    def slow(tmp, snap, group=None):
        time.sleep(0.5)
        return write(tmp, snap, group)

    monkeypatch.setattr(ckpt_state, "_write_rank_files", slow)
    monkeypatch.setattr(Trainer, "_checkpoint_saved", lambda self, step, path: saved.append(step))
    assert run(tmp_path, small_data, "trainer.total_training_steps=3", "trainer.save_freq=1") == 0
    assert saved == [1, 2, 3] and (tmp_path / "bench" / "ckpt_3" / "manifest.json").exists()
    assert not list((tmp_path / "bench").glob(".tmp_ckpt_*"))
