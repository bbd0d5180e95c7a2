"""A random-init tiny model learns the synthetic copy task with minirl's real loop.

Chance is about 1/259 (the byte vocabulary). The test asks for a greedy validation score of at
least 0.9 on held-out prompt phrasings after training (0.7 for gspo and gae: MIN_SCORE says
why), for each outcome estimator and for PPO with a critic (gae), and checks
that both the sampled training reward and the validation before training start near chance.
This is the end-to-end proof that rollout, reward, log-probs, advantages, loss and optimizer
agree on signs and scales: a sign error or a broken normalisation anywhere keeps it at chance.
"""

from __future__ import annotations

import json

import pytest
import tomllib

from tests.integration.conftest import run_job

STEPS = 300
RECIPE = [
    f"trainer.total_training_steps={STEPS}",
    "data.max_response_length=2",
    "rollout.n=16",
    "actor.use_kl_loss=false",
    "actor.optim.lr=2e-3",
    "trainer.val_before_train=true",
    f"trainer.test_freq={STEPS // 3}",
    'trainer.logger=["jsonl"]',
]


# The entropy bonus keeps the policy exploring (without it, it can lock onto wrong digits). Its
# weight was picked per estimator at one thread (final greedy score): grpo 0.05 -> 1.0;
# reinforce_plus_plus 0.025 -> 1.0 (0.05 -> 0.9, 0.1 -> 0.8: its whitened per-token advantages
# need less push); rloo 0.025 -> 1.0 (0.0125 -> 0.9; its raw score differences are small).
# gae (PPO with a critic, γ = λ = 1) at critic lr 5e-3: 0.035 -> 1.0 (0.05 -> 0.9); at critic
# lr 2e-3: 0.035 -> 0.8, 0.05 -> 0.8 (0.9 at step 100, then down), and 0.025 with lr 1e-3 -> 0.4.
ENTROPY_COEFF = {"grpo": 0.05, "reinforce_plus_plus": 0.025, "rloo": 0.025, "gae": 0.035}
OWN_KEYS = {"gae": ["critic.optim.lr=5e-3"]}
# The greedy score asked of each case at the end (10 held-out prompts, so steps of 0.1). The
# 300-step trajectory is chaotic and CPUs round BLAS reductions differently (AVX2 against AVX-512
# paths), so the same seed ends differently on another machine: gspo and gae, tuned to 1.0 on one,
# ended at 0.8 on an AVX-512 Xeon (validation at steps 100 / 200 / 300: gspo 0.7 / 0.9 / 0.8, gae
# 0.8 / 0.8 / 0.8) while the other cases stayed at 1.0. Chance is about 0.004; a sign or scale
# error anywhere keeps a run there.
MIN_SCORE = {"gspo": 0.7, "gae": 0.7}  # the critic must track the policy's improving values

# case -> overrides: each estimator with the PPO loss, and GSPO (grpo advantages, the sequence
# ratio with its 3e-4 / 4e-4 clip, seq-mean-token-mean as its recipe has it). The cpu profile
# has two mini-batches per step, so the second one's sequence ratios move off 1 and get clipped.
CASES = {
    name: [f"algorithm.adv_estimator={name}", f"actor.entropy_coeff={c}", *OWN_KEYS.get(name, [])]
    for name, c in ENTROPY_COEFF.items()
}
CASES["gspo"] = [
    "algorithm.adv_estimator=grpo",
    "actor.policy_loss=gspo",
    "actor.loss_agg_mode=seq-mean-token-mean",
    "actor.entropy_coeff=0.05",
]

# Dynamic sampling trains on informative groups only, so its updates are larger and it learns in
# fewer steps (val 0.7 at step 30, 1.0 at step 90 when measured every 30 steps); once the task is
# learnt nearly every group scores all-1 and each step draws up to the cap.
CASES["grpo+filter_groups"] = CASES["grpo"] + [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.max_num_gen_batches=4",
    "trainer.total_training_steps=100",
    "trainer.test_freq=100",
]
# fp8 rollouts: the engine's GEMMs on e4m3 weights and activations and its KV cache in e4m3, so it
# samples from a policy off the trainer's; truncated importance sampling turns on with them
# (actor.tis_imp_ratio_cap = 2) and corrects for it. The grpo recipe must still learn in the
# 300 steps every case gets. Measured greedy val: 0.9 at step 100, 1.0 at 200 and 300 on one
# machine; on an AVX-512 Xeon (Sapphire Rapids), every 25 steps: 0.9 at 100 and 125,
# down to 0.7 at 175 and 200 (the sampled score 0.75 at step 160), 0.9 at 225 and 1.0 from 250
# to 300, where the same seed without fp8 holds 1.0 from step 150. Rounded rollouts make the
# trajectory noisier, not unlearnable; a 200-step run ended inside that dip and failed.
CASES["grpo+fp8_rollout"] = CASES["grpo"] + [
    "rollout.quantization=fp8",
    "rollout.kv_cache_dtype=fp8",
]
# the largest |p_roll - p_old| of a step with fp8 rollouts: 0.19 and 0.32 measured on the two machines
# above (the float32 engines stay below 1e-3); an engine computing another policy is off by up to 1
FP8_MISMATCH = 0.5


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_model_learns_copy_task(tmp_path, data_dir, case, one_thread):
    """one_thread (tests/conftest.py): a 300-step trajectory is chaotic, and the BLAS reductions
    of 1 and 2 threads round differently (rloo's run diverged at step 91 between them), so the
    run is pinned to the one setting every machine has."""
    history = run_job(tmp_path, data_dir, RECIPE + CASES[case])
    logged = [json.loads(line) for line in (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()]
    before, after = logged[0]["val/score/mean"], history[-1]["val/score/mean"]
    # the mean score of every sample; dynamic sampling's score/mean is over the kept groups only
    scores = [m.get("filter_groups/generated_score_mean", m["score/mean"]) for m in history]
    curve = " ".join(f"{s:.2f}" for s in scores[::30])
    mismatch = max(m["rollout_corr/prob_diff_max"] for m in history)
    mismatch_line = f"max |p_roll - p_old| {mismatch:.1e}"
    vals = " ".join(f"{m['step']}: {m['val/score/mean']:.2f}" for m in logged if "val/score/mean" in m)
    print(f"{case}: val {vals}; sampled score every 30 steps: {curve}; {mismatch_line}")
    if "filter_groups/num_gen_batches" in history[0]:
        drawn = [m["filter_groups/num_gen_batches"] for m in history]
        print(f"{case}: mean prompt batches per step {sum(drawn) / len(drawn):.2f}")
    assert logged[0]["step"] == 0 and before < 0.05, "the random-init model should start near chance"
    assert sum(scores[:5]) / 5 < 0.05
    wanted = MIN_SCORE.get(case, 0.9)
    assert after >= wanted, f"{case} did not learn: greedy val score {after:.3f} < {wanted}; sampled curve {curve}"
    if "fp8" in case:  # rounded on purpose, within bounds, and weighed by TIS
        config = tomllib.loads((tmp_path / "bench" / "config.toml").read_text())
        assert 1e-3 < mismatch < FP8_MISMATCH and config["actor"]["tis_imp_ratio_cap"] == 2.0
    else:
        assert mismatch < 1e-3, "the native engine and the actor share weights and dtype (float32 on CPU)"
