"""Tests of scripts/make_data.py: its files load, score, split cleanly and repeat by seed."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from minirl.config.schema import DataConfig
from minirl.data.prompts import load_prompts
from minirl.plugins import Registry
from minirl.reward.manager import RewardManager
from minirl_plugins import rewards
from tests.scripts import import_script

TASKS = ("gsm8k", "countdown", "copy")
make_data = import_script("make_data")


class StubTokenizer:
    """Characters as tokens, a plain-text chat template: no download, predictable lengths."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def correct_response(record) -> str:
    """What a perfect policy would answer, built from the row's own solution."""
    if record.data_source == "gsm8k":
        return "Let me think.\n" + record.extra_info["answer"]
    if record.data_source == "countdown":
        return f"<think>ok</think><answer>{record.extra_info['solution']}</answer>"
    return record.ground_truth


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return out, {task: make_data.write_task(task, out, 60, 20, seed=0) for task in TASKS}


@pytest.mark.parametrize("task", TASKS)
def test_outputs_load_and_their_solutions_score_one(written, task):
    """Generated files pass load_prompts, and each row's own solution scores 1.0 with the
    registered reward function: the data and the rewards agree."""
    _, paths = written
    reg = Registry("reward_functions")
    for name, fn in rewards.minirl_reward_functions().items():
        reg.add(name, fn, "test")
    cfg = DataConfig(max_prompt_length=1024)
    for split in ("train", "test"):
        records = load_prompts([str(paths[task][split])], StubTokenizer(), cfg)
        assert len(records) == (60 if split == "train" else 20)
        result = RewardManager(reg).score(records, [correct_response(r) for r in records])
        assert result.scores == [1.0] * len(records) and result.count("error") == 0
        assert [r.extra_info["split"] for r in records] == [split] * len(records)
        assert [r.extra_info["index"] for r in records] == list(range(len(records)))


@pytest.mark.parametrize("task", TASKS)
def test_train_and_test_share_no_prompt(written, task):
    """Evaluation on the test split must measure held-out prompts, not memorised ones."""
    _, paths = written
    prompts = {
        split: {row[0]["content"] for row in pq.read_table(p).column("prompt").to_pylist()}
        for split, p in paths[task].items()
    }
    assert not prompts["train"] & prompts["test"]


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_by_seed(tmp_path, task):
    """Same seed -> identical rows (reproducible runs); another seed -> different rows."""
    rows = lambda seed, sub: pq.read_table(
        make_data.write_task(task, tmp_path / sub, 30, 10, seed)["train"]
    ).to_pylist()
    assert rows(1, "a") == rows(1, "b")
    assert rows(1, "a") != rows(2, "c")


def test_gsm8k_format(written):
    """GSM8K's shape: the prompt asks for "####", the worked answer ends with "#### <truth>",
    and every step's arithmetic is right (the solutions are training targets for SFT too)."""
    table = pq.read_table(written[1]["gsm8k"]["train"]).to_pylist()
    for row in table:
        assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
        answer = row["extra_info"]["answer"]
        assert answer.endswith(f"#### {row['reward_model']['ground_truth']}")
        for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", answer):
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
        assert int(row["reward_model"]["ground_truth"]) >= 0


def test_countdown_and_copy_shapes(written):
    """countdown has 3-4 numbers and a positive target; copy prompts are short single digits."""
    for row in pq.read_table(written[1]["countdown"]["train"]).to_pylist():
        truth = row["reward_model"]["ground_truth"]
        assert 3 <= len(truth["numbers"]) <= 4 and 1 <= truth["target"] <= 999
        assert "<answer>" in row["prompt"][0]["content"]
    rows = pq.read_table(written[1]["copy"]["train"]).to_pylist()
    assert all(len(r["prompt"][0]["content"]) < 40 for r in rows)
    assert {r["reward_model"]["ground_truth"] for r in rows} == {str(d) for d in range(10)}


def test_cli_writes_every_task(tmp_path, capsys):
    """The documented command line works end to end."""
    make_data.main(["--out", str(tmp_path), "--seed", "0", "--train", "8", "--test", "4", "--tasks", "gsm8k", "copy"])
    assert (tmp_path / "gsm8k" / "train.parquet").exists()
    assert pq.read_table(tmp_path / "copy" / "test.parquet").num_rows == 4
    assert not (tmp_path / "countdown").exists()
    assert "wrote" in capsys.readouterr().out


def test_unknown_task_is_an_error(tmp_path):
    """A typo in a task name lists the valid ones."""
    with pytest.raises(ValueError, match="gsm8k, countdown, copy"):
        make_data.write_task("gsm9k", tmp_path, 1, 1, 0)
