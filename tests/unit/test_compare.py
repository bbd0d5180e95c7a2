"""`python -m minirl compare`: the end-of-run table over run directories, numbers checked by hand."""

from __future__ import annotations

import csv
import io
import json

import pytest

from minirl.cli import main
from minirl.errors import UserError
from minirl.observe.runs.compare import render_csv, render_markdown, render_text
from minirl.observe.runs.read import config_differences, parse_steps, read_run


def write_run(root, name: str, records: list[dict], config: str | None, tail: str = "") -> str:
    """A run directory as the trainer leaves it; `tail` is appended raw (a line cut short)."""
    run = root / name
    run.mkdir()
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(lines + tail)
    if config is not None:
        (run / "config.toml").write_text(config)
    return str(run)


CONFIG = """[actor]
use_kl_loss = {kl}
[algorithm]
adv_estimator = "{est}"
[trainer]
experiment_name = "{name}"
total_training_steps = 3
logger = ["console", "jsonl"]
"""

# step 1 is warm-up and excluded by the default --steps 2:; its huge times would show if it were not
RUN_A = [
    {"step": 0, "val/score/mean": 0.0},
    {"step": 1, "timing_s/step": 99.0, "timing_s/gen": 99.0, "perf/throughput": 1.0, "score/mean": 9.0},
    {"step": 2, "timing_s/step": 4.0, "timing_s/gen": 2.0, "perf/throughput": 200.0, "score/mean": 0.5},
    {
        "step": 3,
        "timing_s/step": 2.0,
        "timing_s/gen": 1.0,
        "perf/throughput": 400.0,
        "score/mean": None,
        "val/score/mean": 0.25,
    },
]
# no score (a metric set of its own), a ref phase A has not, a last line cut short by a live run
RUN_B = [
    {"step": 1, "timing_s/step": 99.0, "timing_s/gen": 99.0, "perf/throughput": 1.0},
    {"step": 2, "timing_s/step": 2.5, "timing_s/gen": 1.2, "perf/throughput": 360.0, "timing_s/ref": 0.5},
    {
        "step": 3,
        "timing_s/step": 3.2,
        "timing_s/gen": 1.8,
        "perf/throughput": 330.0,
        "timing_s/ref": 0.7,
        "val/score/mean": 0.5,
    },
]
TRUNCATED = '{"step": 4, "timing_s/st'


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path, "a", RUN_A, CONFIG.format(est="grpo", name="a", kl="true") + "[actor.optim]\nlr = 0.001\n")
    b = write_run(tmp_path, "b", RUN_B, CONFIG.format(est="rloo", name="b", kl="false"), tail=TRUNCATED)
    return a, b


def row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(label + " "))
    return line[len(label) :].split()


def test_text_table_has_hand_computed_means_and_differences(runs, capsys):
    """Means over steps 2..3 (A step 3.0, B (2.5+3.2)/2 = 2.85: -5.0%, less time is better; A
    throughput 300, B 345: +15.0%, more is better; gen 1.5 vs 1.5: no mark); a null value is left
    out of the mean (A's score is 0.5, not 0.25); a metric one run lacks is a dash."""
    text = render_text([read_run(p) for p in runs], parse_steps("2:"))
    assert row(text, "step time") == ["s", "3", "2.85", "-5.0%", "better"]
    assert row(text, "generation time") == ["s", "1.5", "1.5", "+0.0%"]
    assert row(text, "step throughput") == ["tok/s", "300", "345", "+15.0%", "better"]
    assert row(text, "ref logprob time") == ["s", "—", "0.6", "—"]
    assert row(text, "score") == ["0.5", "—", "—"]
    assert row(text, "val score") == ["0.25", "0.5", "+100.0%", "better"]
    assert "prev logprob time" not in text  # no run logged it


def test_csv_is_unrounded_and_lists_config_differences(runs):
    """CSV carries the exact means and the change in percent, then one row per differing config key
    (a key only one run has counts as differing; an equal key does not)."""
    out = list(csv.reader(io.StringIO(render_csv([read_run(p) for p in runs], parse_steps("2:")))))
    assert out[0] == ["metric", "unit", "a", "b", "b vs a (%)"]
    by_label = {r[0]: r for r in out[1:]}
    assert float(by_label["step time"][2]) == 3.0
    assert float(by_label["step time"][3]) == pytest.approx(2.85)
    assert float(by_label["step time"][4]) == pytest.approx(-5.0)
    assert by_label["score"][3:] == ["", ""]
    config_rows = [r for r in out if r[1] == "config"]
    assert [r[0] for r in config_rows] == [
        "actor.optim.lr",
        "actor.use_kl_loss",
        "algorithm.adv_estimator",
        "trainer.experiment_name",
    ]
    assert by_label["algorithm.adv_estimator"][2:4] == ["grpo", "rloo"]
    assert by_label["actor.optim.lr"][2:4] == ["0.001", ""]


def test_markdown_names_the_differing_keys(runs):
    text = render_markdown([read_run(p) for p in runs], parse_steps("2:"))
    assert "| step time | s | 3 | 2.85 | -5.0% better |" in text
    assert "| `algorithm.adv_estimator` | grpo | rloo |" in text
    assert "| `actor.use_kl_loss` | true | false |" in text  # as TOML writes it
    assert "trainer.logger" not in text and "total_training_steps" not in text


def test_truncated_last_line_is_skipped_with_a_warning(runs, capsys):
    """A run still writing leaves half a line; reading it must not crash and must say which line."""
    run = read_run(runs[1])
    assert [r["step"] for r in run.records] == [1, 2, 3]
    err = capsys.readouterr().err
    assert "metrics.jsonl line 4" in err and "skipped" in err


def test_resumed_run_keeps_the_later_line_of_a_repeated_step(tmp_path):
    """A resume that re-did a step may leave it twice; the re-done one is what the run used."""
    path = write_run(tmp_path, "r", [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 2, "x": 5.0}], None)
    run = read_run(path)
    assert [(r["step"], r["x"]) for r in run.records] == [(1, 1.0), (2, 5.0)]


def test_crashed_run_is_reported_as_stopped_short(tmp_path):
    """A run with fewer steps than total_training_steps is named in the note under the table."""
    a = write_run(tmp_path, "a", RUN_A, CONFIG.format(est="grpo", name="a", kl="true"))
    b = write_run(tmp_path, "b", RUN_B[:2], CONFIG.format(est="grpo", name="b", kl="true"))
    text = render_text([read_run(a), read_run(b)], parse_steps("2:"))
    assert "b stopped at step 2 of 3" in text and "a stopped" not in text
    assert config_differences([read_run(a), read_run(b)])[0][0] == "trainer.experiment_name"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.parametrize(
    "status, says",
    [
        (None, "still running, or crashed"),
        (
            {"state": "stopped", "signal": "SIGINT", "checkpoint": "runs/b/ckpt_2"},
            "stopped by SIGINT; resumable from runs/b/ckpt_2",
        ),
        ({"state": "crashed", "error": "RuntimeError: boom", "checkpoint": None}, "crashed: RuntimeError: boom"),
        ({"state": "stopped", "signal": "a second SIGINT", "checkpoint": None}, "no checkpoint to resume from"),
        ({"state": "running", "pid": "self", "checkpoint": "runs/b/ckpt_1"}, "still running (process"),
        ({"state": "running", "pid": "dead", "checkpoint": "runs/b/ckpt_1"}, "is gone"),
        ({"state": "running", "pid": 1, "host": "elsewhere"}, "running on elsewhere (process 1), or killed there"),
    ],
)
def test_a_run_stopped_short_says_why(tmp_path, status, says):
    """compare tells a Ctrl-C'd run (resumable from its checkpoint) from a crashed one, a killed
    one (its process is gone) and one that is still running, from the run's status.json."""
    import os
    import socket

    path = write_run(tmp_path, "b", RUN_B[:2], CONFIG.format(est="grpo", name="b", kl="true"))
    if status is not None:
        pid = {"self": os.getpid(), "dead": _dead_pid()}.get(status.get("pid"), status.get("pid"))
        record = {"step": 2, "host": socket.gethostname(), **status, "pid": pid}
        (tmp_path / "b" / "status.json").write_text(json.dumps(record))
    note = read_run(path).stopped_short()
    assert note.startswith("stopped at step 2 of 3 (") and says in note, note
    if status and status.get("checkpoint") and status["state"] != "stopped":
        assert f"the newest checkpoint: {status['checkpoint']}" in note


@pytest.mark.parametrize("spec, want", [("2:", (2, None)), ("5:10", (5, 10)), (":4", (0, 4)), ("7", (7, 7))])
def test_steps_spec(spec, want):
    assert parse_steps(spec) == want


@pytest.mark.parametrize("spec", ["x", "3:1", "-1:"])
def test_bad_steps_spec_is_a_user_error(spec):
    with pytest.raises(UserError, match="--steps"):
        parse_steps(spec)


def test_cli_compare_and_its_user_errors(runs, tmp_path, capsys):
    """The subcommand prints the table; a directory without metrics.jsonl or a wrong --names count is
    one error line (exit 2) naming the input."""
    assert main(["compare", *runs, "--names", "grpo,rloo", "--format", "markdown"]) == 0
    assert "| metric | unit | grpo | rloo | rloo vs grpo |" in capsys.readouterr().out
    assert main(["compare", runs[0], str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no metrics.jsonl" in capsys.readouterr().err
    assert main(["compare", *runs, "--names", "x"]) == 2
    assert "1 names for 2 runs" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("plugins", "compare", "report"):
        assert any(line.split()[:1] == [command] for line in out.splitlines())
