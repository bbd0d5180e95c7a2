"""`python -m minirl export` and `eval` after a one-step CPU run: the exported directory loads in
transformers and gives the trained actor's logits (LoRA: merged, to float tolerance); eval of
the checkpoint and of its export generate the same greedy responses, score them per data_source
and write every sample; a user's mistake is one line naming the flag or the row, exit 2.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from minirl.cli import main
from minirl.models.loading import load_model
from tests.integration.conftest import make_trainer

SMALL = [
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "trainer.total_training_steps=1",
    "trainer.save_freq=1",
    'trainer.logger=["jsonl"]',
    "actor.optim.lr=1e-2",  # a step that moves the weights visibly
]
LORA = ["model.lora_rank=8", "model.lora_alpha=16"]


@pytest.fixture(scope="module", params=["full", "lora"])
def trained(request, tmp_path_factory, data_dir):
    """(run directory, the trained actor) of a one-step run with a checkpoint."""
    if request.param == "lora":
        pytest.importorskip("peft")
    root = tmp_path_factory.mktemp(request.param)
    trainer = make_trainer(root, data_dir, SMALL + (LORA if request.param == "lora" else []))
    trainer.fit()
    return root / "bench", trainer.actor, trainer.cfg


def test_export_loads_in_transformers_with_the_trained_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, actor, cfg = trained
    out = tmp_path / "hf"
    keep = ["--keep-adapter"] if hasattr(actor, "lora_config") else []
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out), *keep]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 2]])
    with torch.no_grad():
        want, got = actor(input_ids=ids).logits, hf(input_ids=ids).logits
    tol = 1e-5 if keep else 0.0  # LoRA: W + B A * alpha / r rounded once, against the unmerged forward
    assert (want - got).abs().max().item() <= tol
    untrained = load_model(cfg.model, "cpu", torch.float32)[0]
    with torch.no_grad():  # the step moved the weights: the export holds the trained ones
        assert (untrained(input_ids=ids).logits - want).abs().max().item() > 1e-3
    if keep:
        assert (out / "adapter" / "adapter_config.json").is_file()
        assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_eval_of_a_checkpoint_and_its_export_agree(trained, tmp_path, data_dir, capsys):
    run_dir, *_ = trained
    data = [str(data_dir / "copy" / "test.parquet"), str(data_dir / "gsm8k" / "test.parquet")]
    assert main(["export", "--checkpoint", str(run_dir / "ckpt_1"), "--out", str(tmp_path / "hf")]) == 0
    # the checkpoint's config says data.max_prompt_length = 64 (cpu profile), an HF directory gets
    # the default: one override for both, long enough for the gsm8k prompts
    common = ["--data", *data, "--greedy", "--max-response-length", "8", "data.max_prompt_length=512"]
    assert main(["eval", "--model", str(run_dir), *common, "--out", str(tmp_path / "a.jsonl")]) == 0
    assert main(["eval", "--model", str(tmp_path / "hf"), *common, "--out", str(tmp_path / "b.jsonl")]) == 0
    a, b = (_read(tmp_path / name) for name in ("a.jsonl", "b.jsonl"))
    assert len(a) == 100 and [r["response"] for r in a] == [r["response"] for r in b]
    out = capsys.readouterr().out
    assert out.count("pass@1") == 2 and "copy " in out and "gsm8k " in out and "all " in out


def test_eval_samples_n_and_reports_pass_at_k(trained, tmp_path, data_dir, capsys):
    """--n 4: four samples a prompt; the table's mean score is the file's, pass@1..4 reported."""
    run_dir, *_ = trained
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n"
    )
    argv = ["eval", "--model", str(run_dir), "--data", str(data_dir / "copy" / "test.parquet"), "--n", "4"]
    argv += ["--out", str(tmp_path / "s.jsonl"), "--max-response-length", "4", f"custom_reward_function.path={reward}"]
    assert main(argv) == 0
    rows = _read(tmp_path / "s.jsonl")
    assert len(rows) == 200 and {r["prompt_index"] for r in rows} == set(range(50))
    mean = sum(r["score"] for r in rows) / len(rows)
    all_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("all "))
    assert all_line.split()[1:4] == ["50", "4", f"{mean:.4f}"] and len(all_line.split()) == 7  # pass@1, @2, @4


@pytest.mark.parametrize(
    "argv, says",
    [
        (["eval", "--model", "/nonexistent", "--data", "X", "--out", "o.jsonl"], "--data X: no such file"),
        (["eval", "--model", "/nonexistent", "--data", "{copy}", "--out", "o.jsonl"], "--model /nonexistent: no such"),
        (["eval", "--model", "{run}", "--data", "{copy}", "--out", "o", "--greedy", "--n", "2"], "--greedy with --n 2"),
        (["eval", "--model", "{run}", "--data", "{odd}", "--out", "o.jsonl"], "custom_reward_function.path"),
        (["export", "--checkpoint", "{copy}", "--out", "x"], "no such directory"),
        (["export", "--checkpoint", "{tmp}", "--out", "{tmp}/x"], "no complete checkpoint there"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(trained, tmp_path, data_dir, capsys, argv, says):
    run_dir, *_ = trained
    odd = tmp_path / "odd.parquet"
    table = pq.read_table(data_dir / "copy" / "test.parquet").slice(0, 2)
    column = table.schema.get_field_index("data_source")
    pq.write_table(table.set_column(column, "data_source", pa.array(["my_task"] * 2)), odd)
    subs = {"{copy}": str(data_dir / "copy" / "test.parquet"), "{run}": str(run_dir), "{odd}": str(odd)}
    subs["{tmp}"] = str(tmp_path)
    argv = [_sub(a, subs) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def _sub(arg: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        arg = arg.replace(key, value)
    return arg


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
