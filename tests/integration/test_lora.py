"""LoRA runs through minirl's real loop: a resumed run is bit-identical to one that never stopped
(the checkpoint holds the adapters and their AdamW state only), save_hf_freq writes a peft adapter
directory (and the merged model on request) that a new run continues from, and the tiny model
learns the copy task with LoRA alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minirl.models import lora
from minirl.models.loading import random_model
from minirl.models.presets import preset_config, preset_tokenizer
from tests.integration.conftest import make_trainer, run_job

LORA = ["model.lora_rank=8", "model.lora_alpha=16", "actor.optim.lr=1e-2"]
SHORT = [
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "data.max_response_length=2",
    'trainer.logger=["jsonl"]',
    "actor.use_kl_loss=true",  # the reference: the actor's base (adapters disabled)
]
VOLATILE = ("timing_s/", "perf/", "memory_gib/")


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


@pytest.mark.slow
def test_lora_resume_is_bit_exact_and_checkpoints_hold_only_the_adapters(tmp_path, data_dir):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*LORA, *SHORT, "trainer.save_freq=1", "trainer.save_hf_freq=2"]
    run_job(straight, data_dir, [*common, "trainer.total_training_steps=2"])
    run_job(resumed, data_dir, [*common, "trainer.total_training_steps=1"])
    trainer = make_trainer(resumed, data_dir, [*common, "trainer.total_training_steps=2"])
    assert trainer.start_step == 1
    shared = trainer.source.engine.shared  # the engine holds the actor's frozen embedding, head, norms
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= shared
    trainer.fit()
    assert [r["step"] for r in metrics(resumed / "bench")] == [1, 2]
    assert metrics(resumed / "bench") == metrics(straight / "bench")
    got = load_file(resumed / "bench" / "hf_step_2" / "adapter_model.safetensors")
    want = load_file(straight / "bench" / "hf_step_2" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and len(got) == 28
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the resumable checkpoint: adapters and AdamW moments, not the frozen base (~1.4 MB in fp32)
    size = sum(f.stat().st_size for f in (straight / "bench" / "ckpt_1").glob("*.distcp"))
    adapters = sum(t.numel() for t in want.values()) * 4
    assert 3 * adapters <= size < 3 * adapters + 200_000


def test_save_hf_writes_a_peft_adapter_and_the_merged_model_that_runs_continue_from(tmp_path, data_dir):
    first = tmp_path / "first"
    trainer = make_trainer(
        first,
        data_dir,
        [*LORA, *SHORT, "trainer.total_training_steps=2", "trainer.save_hf_freq=2", "model.lora_save_merged=true"],
    )
    trainer.fit()
    out = first / "bench" / "hf_step_2"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    merged = load_file(out / "merged" / "model.safetensors")
    layer = trainer.actor.get_submodule("model.layers.0.self_attn.q_proj")
    assert not torch.equal(lora.merged(layer), layer.base_layer.weight)  # trained: the merged weight is not the base's
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], lora.merged(layer))
    # continue from the adapter: the new run starts with the trained adapters
    second = make_trainer(
        tmp_path / "second", data_dir, [*SHORT, f"model.lora_adapter_path={out}", "trainer.total_training_steps=1"]
    )
    ours = {n: p for n, p in trainer.actor.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in second.actor.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    # the merged model loads as model.path and scores tokens as the LoRA actor does
    plain = make_trainer(tmp_path / "third", data_dir, [*SHORT, f"model.path={out / 'merged'}"])
    ids = torch.tensor([[5, 17, 42, 7, 9]])
    with torch.no_grad():
        a = trainer.actor(ids, attn_implementation="sdpa").logits
        b = plain.actor(ids, attn_implementation="sdpa").logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pretrained_tiny(tmp_path_factory) -> Path:
    """The tiny preset as a Hugging Face directory, its lm_head scaled by 8: a stand-in for a
    pretrained base. LoRA leaves lm_head and the final norm frozen, and the random init's lm_head
    (std 0.02 over a unit-RMS hidden state of 64 values) bounds every logit by about 1.3, so no
    adapter could make the random base confident in any token (measured: the sampled score
    stayed at chance for 150 steps); a pretrained model's output layer has no such bound."""
    out = tmp_path_factory.mktemp("pretrained_tiny")
    model = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    preset_tokenizer("tiny").save_pretrained(out)
    return out


LEARN_STEPS = 150


@pytest.mark.slow
def test_tiny_model_learns_copy_task_with_lora(tmp_path, data_dir, pretrained_tiny, one_thread):
    """GRPO trains only rank-32 adapters on every linear layer (the base, lm_head and the
    embeddings frozen) and the greedy validation score goes from 0 to >= 0.9."""
    history = run_job(
        tmp_path,
        data_dir,
        [
            f"model.path={pretrained_tiny}",
            "model.lora_rank=32",
            "model.lora_alpha=64",
            "actor.optim.lr=5e-4",
            "actor.entropy_coeff=0.02",
            f"trainer.total_training_steps={LEARN_STEPS}",
            "data.max_response_length=2",
            "rollout.n=16",
            "actor.use_kl_loss=false",
            "trainer.val_before_train=true",
            f"trainer.test_freq={LEARN_STEPS}",
            'trainer.logger=["jsonl"]',
        ],
    )
    logged = [json.loads(line) for line in (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()]
    before, after = logged[0]["val/score/mean"], history[-1]["val/score/mean"]
    curve = " ".join(f"{m['score/mean']:.2f}" for m in history[::25])
    print(f"lora: val {before:.3f} -> {after:.3f}; sampled score every 25 steps: {curve}")
    assert before <= 0.2
    assert after >= 0.9
