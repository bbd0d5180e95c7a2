"""The real training loop on CPU: every phase runs, runs are reproducible, outputs are written."""

from __future__ import annotations

import json

import pytest
import torch

from minirl import precompile
from tests.integration.conftest import run_job

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")


def test_cpu_profile_three_steps_pass_through_every_phase(tmp_path, data_dir, capsys):
    """A 3-step run of the `cpu` profile times every phase and reports every metric group."""
    history = run_job(tmp_path, data_dir, ["trainer.total_training_steps=3"])
    assert len(history) == 3
    for metrics in history:
        for phase in PHASES:
            assert metrics[f"timing_s/{phase}"] > 0, phase
        for key in (
            "score/mean",
            "response_length/mean",
            "advantages/mean",
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/entropy",
            "actor/grad_norm",
            "actor/lr",
            "perf/throughput",
            "batch/solve_none_or_all_share",
            "rollout_corr/prob_diff_mean",
            "rollout_corr/prob_diff_max",
            "rollout_corr/log_ratio_mean",
        ):
            assert key in metrics, key
        # what holds the memory (minirl.observe.memory): full fine-tuning, a reference of its own
        held = {k.removeprefix("memory_gib/held/"): v for k, v in metrics.items() if "/held/" in k}
        assert set(held) == {"actor.trained", "actor.frozen", "actor.gradients", "actor.optimizer", "reference"} | {
            "engine.weights",
            "engine.kv_cache",
        }
        assert held["actor.frozen"] == 0 and held["actor.gradients"] == held["actor.trained"] == held["reference"]
        assert held["actor.optimizer"] >= 2 * held["actor.trained"] > 0 and held["engine.kv_cache"] > 0
    out = capsys.readouterr().out
    assert "batch: 16 prompts x n=16 = 256 sequences/step" in out
    assert "step throughput" in out and "prompt+response tokens" in out
    lines = (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert (tmp_path / "bench" / "config.toml").exists()


@pytest.mark.parametrize("engine", ["hf", "native"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_gspo_with_tis_runs_on_the_engines_log_probs(tmp_path, data_dir, engine, on_policy):
    """GSPO with TIS through the real loop, with and without the on-policy shortcut: each step
    keeps the engine's log-probs, and in float32 on CPU they agree with the actor's, so every TIS
    weight is about 1 (none at the cap) and the mismatch metrics are about 0."""
    mini = 16 if on_policy else 8
    overrides = ["trainer.total_training_steps=2", f"rollout.name={engine}", f"actor.ppo_mini_batch_size={mini}"]
    overrides += ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.tis_imp_ratio_cap=2.0"]
    history = run_job(tmp_path, data_dir, overrides)
    assert len(history) == 2
    for m in history:
        assert ("timing_s/old_log_prob" in m) != on_policy
        assert m["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m["actor/tis_capped_frac"] == 0.0
        assert 0 <= m["rollout_corr/prob_diff_mean"] <= m["rollout_corr/prob_diff_max"] < 1e-4
        assert abs(m["rollout_corr/log_ratio_mean"]) < 1e-4


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_two_seeded_runs_are_identical(tmp_path, data_dir, engine):
    """Same seed, same data: every non-timing metric is bit-identical (reproducible research)."""
    overrides = ["trainer.total_training_steps=2", f"rollout.name={engine}"]
    first = run_job(tmp_path / "a", data_dir, overrides)
    second = run_job(tmp_path / "b", data_dir, overrides)
    for m1, m2 in zip(first, second):
        stable = {k: v for k, v in m1.items() if not k.startswith(("timing_s/", "perf/", "memory_gib/"))}
        assert stable == {k: m2[k] for k in stable}


def test_saved_checkpoint_loads_back_with_the_trained_weights(tmp_path, data_dir):
    """trainer.save_hf_freq writes a Hugging Face directory that `model.path` loads exactly."""
    from minirl.config.load import load_config
    from minirl.models.loading import load_model
    from tests.integration.conftest import make_trainer

    trainer = make_trainer(tmp_path, data_dir, ["trainer.total_training_steps=2", "trainer.save_hf_freq=2"])
    trainer.fit()
    saved = tmp_path / "bench" / "hf_step_2"
    assert (saved / "model.safetensors").exists() and (saved / "config.json").exists()
    model, tokenizer = load_model(load_config(None, [f"model.path={saved}"]).model, "cpu", "float32")
    loaded = dict(model.named_parameters())
    for name, param in trainer.actor.named_parameters():
        assert torch.equal(loaded[name], param.detach()), name
    assert tokenizer.decode(tokenizer.encode("copy 7")) == "copy 7"


def test_compiled_layers_through_the_loop_match_eager(tmp_path, data_dir, monkeypatch):
    """model.compile_layers through the real loop (compiled actor and reference, the prev-log-prob
    pass, two mini-batches, the hf engine's eager copy): the same metrics as the eager run, to
    float32 rounding; step 1 logs its compiling and step 2 compiles nothing new."""
    overrides = ["trainer.total_training_steps=2", "rollout.name=hf", "actor.ppo_mini_batch_size=8"]
    eager = run_job(tmp_path / "eager", data_dir, overrides)
    monkeypatch.setattr(precompile, "OVERLAPPING_DEVICES", ("cuda", "cpu"))  # its twin, as on a GPU
    torch._dynamo.reset()  # an earlier test in this process may have compiled these layers: compile afresh
    # the twin waited for (it would be stopped unfinished: on the CPU the generation outlasts no compile)
    compiled = run_job(
        tmp_path / "compiled", data_dir, [*overrides, "model.compile_layers=true", "model.precompile_wait_s=600"]
    )
    assert len(compiled) == 2 and compiled[0]["actor/kl_loss"] > 0  # the second mini-batch's actor moved
    # what each step spent compiling (PhaseTimer): all of it in step 1, none eager
    assert [r["compile/graphs"] for r in eager] == [0, 0] and [r["compile/seconds"] for r in eager] == [0, 0]
    assert compiled[0]["compile/graphs"] >= 2 and 0 < compiled[0]["compile/seconds"] < compiled[0]["timing_s/step"]
    assert compiled[1]["compile/graphs"] == 0
    # the twin compiled ahead (model.precompile, on by default) and was waited for once; the
    # metrics below are the same with or without its graphs (tests/integration/test_precompile.py)
    assert compiled[0]["compile/precompile_passes"] >= 1 and compiled[0]["compile/precompile_unfinished"] == 0
    assert "compile/precompile_wait_s" not in compiled[1]
    for want, got in zip(eager, compiled):
        assert got["response_length/mean"] == want["response_length/mean"]  # the same samples
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
