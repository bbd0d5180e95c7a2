"""A random-init tiny model learns a multi-turn task that needs a tool, with minirl's real loop.

The `lookup` task (scripts/make_data.py): the prompt names a key, the digit is random per row and
only the `lookup` tool knows it. To score, the model must (1) write the tool call in its first
turn, (2) read the tool's reply, which tool_agent appends as masked tokens, and (3) answer with the
digit in a second turn. Guessing without the call scores 0.1 on average at best; calling and
then guessing a digit 0.28 (the reward's partial credit: 0.1 for the call, 0.1 more for a digit).
A greedy validation score of 0.9 on held-out keys therefore means the model reads the tool's
reply: the end-to-end proof that the agent loop, the masks with holes (tool tokens trained
nowhere), the continued engine requests and the reward on the trajectory agree.

Measured with this recipe (bench.toml's cpu-agent profile) at one thread: greedy validation 0.0 ->
0.28 at step 100 (every sample calls and answers a digit), 0.92 / 1.0 at step 200 and 1.0 at
step 250 in the two runs at entropy_coeff 0.1 and 0.075. Rollouts are not bit-reproducible run to
run (tool replies return in thread order), so the test runs 300 steps: 100 past the point where
both runs were at 0.9 or more.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import ROOT, _make_data_module, run_job

STEPS = 300


@pytest.fixture(scope="module")
def lookup_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lookup_data")
    _make_data_module().write_task("lookup", out, 2000, 50, 0)
    return out


@pytest.mark.slow
def test_tiny_model_learns_to_call_the_tool_and_use_its_answer(tmp_path, lookup_dir, one_thread):
    """bench.toml's cpu-agent profile as it is (its recipe is this test's), on held-out keys."""
    history = run_job(
        tmp_path,
        lookup_dir,
        [
            f'data.train_files=["{lookup_dir}/lookup/train.parquet"]',
            f'data.val_files=["{lookup_dir}/lookup/test.parquet"]',
            f"rollout.multi_turn.tool_config_path={ROOT}/examples/tools/lookup.yaml",
            f"trainer.total_training_steps={STEPS}",
            "trainer.val_before_train=true",
            f"trainer.test_freq={STEPS // 3}",
            'trainer.logger=["jsonl"]',
        ],
        profile="cpu-agent",
    )
    logged = [json.loads(line) for line in (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()]
    vals = [(m["step"], m["val/score/mean"]) for m in logged if "val/score/mean" in m]
    last = history[-1]
    curve = " ".join(f"{m['score/mean']:.2f}" for m in history[::25])
    print(f"lookup: val {vals}; sampled score every 25 steps: {curve}")
    assert vals[0][1] <= 0.2  # before training: no call, so at best a guess
    assert vals[-1][1] >= 0.9, vals  # calling and guessing a digit tops out at 0.28
    # every sample calls the tool and answers in a second turn; the tool's tokens are not the model's
    assert last["agent/assistant_turns/mean"] > 1.9 and last["agent/tool_ok"] > 0
    assert last["response/model_token_share"] < 0.2
