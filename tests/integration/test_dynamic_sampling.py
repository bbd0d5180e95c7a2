"""Dynamic sampling (algorithm.filter_groups) in the real loop, through the command line in this
process: steps train on informative groups only, the data position runs ahead of the step and
is saved, and a resumed run is exactly the straight one.

The reward makes half of the prompts all-correct for any model: even digits always score 1, odd
digits score by the parity of the response's first character (a coin flip for a random model),
so about half of each batch's groups carry no signal and steps need further prompt batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from minirl.cli import main
from tests.integration.conftest import _make_data_module, cli_args

VOLATILE = ("timing_s/", "perf/", "memory_gib/")
PLUGIN = (Path(__file__).parents[1] / "distributed" / "ds_half_solved.py").read_text()  # the reward plugin


@pytest.fixture(scope="module")
def half_data(tmp_path_factory) -> Path:
    """48 copy prompts (6 batches of 8 per epoch) scored by the half_solved plugin."""
    out = tmp_path_factory.mktemp("ds_data")
    path = _make_data_module().write_task("copy", out, 48, 4, 0)["train"]
    table = pq.read_table(path)
    column = table.column_names.index("data_source")
    pq.write_table(table.set_column(column, "data_source", pa.array(["half_solved"] * table.num_rows)), path)
    (out / "ds_half_solved.py").write_text(PLUGIN)
    sys.path.insert(0, str(out))
    yield path
    sys.path.remove(str(out))
    sys.modules.pop("ds_half_solved", None)


def run(root: Path, data: Path, *overrides: str) -> None:
    overrides = (
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        'plugins.modules=["ds_half_solved"]',
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "trainer.save_freq=2",
        "trainer.save_hf_freq=4",
        *overrides,
    )
    assert main(cli_args(root, data, *overrides)) == 0


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, half_data) -> Path:
    root = tmp_path_factory.mktemp("ds_straight")
    run(root, half_data, "trainer.total_training_steps=4")
    return root / "bench"


def test_steps_train_on_informative_groups_and_draw_further_batches(straight):
    """Each step holds 8 informative groups (no all-equal group left), drawn from 2 or more
    prompt batches; the epoch metric and the checkpoint's data position count the batches."""
    rows = metrics(straight)
    drawn = [r["filter_groups/num_gen_batches"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and sum(drawn) > 4
    for r in rows:
        assert r["filter_groups/cap_hit"] == 0.0 and r["filter_groups/groups_kept"] == 8.0
        assert r["batch/solve_none_or_all_share"] == 0.0  # the trained batch has no all-equal group
        assert r["filter_groups/groups_dropped"] == 8 * r["filter_groups/num_gen_batches"] - 8
        # generation throughput counts every response generated (1 or 2 tokens each), dropped ones too
        sequences = 8 * 4 * r["filter_groups/num_gen_batches"]
        assert sequences <= r["perf/generated_response_tokens"] <= 2 * sequences
        assert r["perf/generated_response_tokens"] > r["perf/total_response_tokens"]
        gen_rate = r["perf/generated_response_tokens"] / r["timing_s/gen"]
        assert r["perf/gen_throughput_per_gpu"] == pytest.approx(gen_rate)
    assert rows[-1]["filter_groups/epoch"] == sum(drawn) / 6
    saved = json.loads((straight / "ckpt_2" / "trainer_state.json").read_text())["data"]
    assert saved["batches_drawn"] == drawn[0] + drawn[1]
    assert (saved["epoch"], saved["batch_in_epoch"]) == divmod(int(drawn[0] + drawn[1]), 6)


def test_resume_with_filter_groups_is_exact(tmp_path, half_data, straight):
    """Two steps, then a resume from ckpt_2 to step 4: the same metrics and weights as the
    straight run (the resumed run continues at the saved data position, not at step x batch)."""
    run(tmp_path, half_data, "trainer.total_training_steps=2")
    run(tmp_path, half_data, "trainer.total_training_steps=4")
    got, want = metrics(tmp_path / "bench"), metrics(straight)
    assert [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in got] == [
        {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in want
    ]
    w_got = load_file(tmp_path / "bench" / "hf_step_4" / "model.safetensors")
    w_want = load_file(straight / "hf_step_4" / "model.safetensors")
    assert w_got.keys() == w_want.keys()
    for name in w_want:
        assert torch.equal(w_got[name], w_want[name]), name
