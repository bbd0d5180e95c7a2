"""The value model (minirl.critic.model): the scalar head and the alignment of the values.

V_t must be read where the log-prob of response token t is read: at the hidden state of the
position that predicts it (verl's alignment). The packed forward is compared with a plain,
unpacked transformers forward of each sequence on its own.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minirl.batch import MicroBatching
from minirl.config.load import load_config
from minirl.critic import FROM_ACTOR, resolved
from minirl.critic.model import add_value_head, backbone_config, response_values
from minirl.models.loading import random_model
from minirl.models.presets import preset_config


def _critic(seed: int = 0) -> torch.nn.Module:
    return add_value_head(random_model(preset_config("tiny"), "cpu", torch.float32, seed=3), seed)


def test_values_sit_at_the_positions_that_predict_each_response_token():
    """Packed values [R] equal head(h[len(p) − 1 + t]) of an unpacked forward, sequence by sequence."""
    model = _critic()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (5, 1, 9)]
    responses = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (3, 4, 1)]
    with torch.no_grad():
        got_R = response_values(model, prompts, responses, torch.device("cpu"))
        want = []
        for p, r in zip(prompts, responses):
            hidden = model.get_decoder()(input_ids=torch.tensor([p + r])).last_hidden_state[0]
            want.append(model.get_output_embeddings()(hidden[len(p) - 1 : len(p) - 1 + len(r)])[:, 0])
    assert got_R.shape == (8,) and got_R.dtype == torch.float32
    torch.testing.assert_close(got_R, torch.cat(want), rtol=1e-5, atol=1e-6)


def test_head_is_scalar_seeded_and_leaves_the_backbone_alone():
    """nn.Linear(H, 1): weight ~ N(0, initializer_range), bias 0, the same from the same seed on
    every rank, without moving the global random stream; the input embedding is untouched."""
    plain = random_model(preset_config("tiny"), "cpu", torch.float32, seed=3)
    embed = plain.get_input_embeddings().weight.detach().clone()
    state = torch.random.get_rng_state()
    model = add_value_head(plain, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    head = model.get_output_embeddings().requires_grad_(False)
    assert head.weight.shape == (1, model.config.hidden_size) and float(head.bias.abs().sum()) == 0.0
    assert float(head.weight.std()) == pytest.approx(model.config.initializer_range, rel=0.35)
    assert torch.equal(head.weight, _critic(seed=7).get_output_embeddings().weight)
    assert not torch.equal(head.weight, _critic(seed=8).get_output_embeddings().weight)
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert model.config.tie_word_embeddings is False


def test_backbone_defaults_to_the_actors_model_and_critic_keys_to_the_actors():
    cfg = load_config(None, ["model.seed=4", "actor.ppo_mini_batch_size=2", "actor.use_dynamic_bsz=true"])
    m = backbone_config(cfg.model, cfg.critic)
    assert (m.path, m.preset, m.seed) == ("", "tiny", 4)
    c = resolved(cfg.critic, cfg.actor)
    assert all(getattr(c, k) == getattr(cfg.actor, k) for k in FROM_ACTOR)
    own = load_config(None, ["critic.ppo_mini_batch_size=4", "critic.model.path=/x"])
    assert resolved(own.critic, own.actor).ppo_mini_batch_size == 4
    assert backbone_config(own.model, own.critic).path == "/x"
    assert dataclasses.replace(c) == c  # a plain frozen dataclass, like every section


def test_forward_keys_default_to_the_critics_update_keys():
    """verl's critic.forward_micro_batch_size_per_gpu / forward_max_token_len_per_gpu: unset, the
    values pass uses the critic's update keys (themselves the actor's when unset)."""
    cfg = load_config(None, ["actor.ppo_micro_batch_size_per_gpu=3", "critic.ppo_max_token_len_per_gpu=900"])
    c = resolved(cfg.critic, cfg.actor)
    assert (c.forward_micro_batch_size_per_gpu, c.forward_max_token_len_per_gpu) == (3, 900)
    own = load_config(None, ["critic.forward_micro_batch_size_per_gpu=16", "critic.forward_max_token_len_per_gpu=64"])
    c = resolved(own.critic, own.actor)
    assert (c.forward_micro_batch_size_per_gpu, c.forward_max_token_len_per_gpu) == (16, 64)


@pytest.mark.parametrize("dynamic", [False, True])
def test_values_pass_micro_batches_by_the_forward_keys_and_not_the_update_keys(dynamic, monkeypatch):
    """The values pass splits by the forward keys (the update keeps its own), and the values do
    not depend on the split."""
    from minirl import build
    from minirl.critic import update as critic_update
    from minirl.dist.context import DistContext
    from minirl.forward import packed
    from tests.batches import three_groups

    batch = three_groups(2, [6, 6, 9, 9, 4, 4], [5, 2, 7, 3, 1, 6])
    model, dist = _critic(), DistContext(device=torch.device("cpu"))
    seen = []
    split = packed.split_micro

    def counting(batch, micro, *args):
        out = split(batch, micro, *args)
        seen.append((micro, len(out)))
        return out

    monkeypatch.setattr(packed, "split_micro", counting)
    values = []
    for forward in (["critic.forward_micro_batch_size_per_gpu=1", "critic.forward_max_token_len_per_gpu=17"], []):
        overrides = ["critic.ppo_micro_batch_size_per_gpu=6", "critic.ppo_max_token_len_per_gpu=200", *forward]
        cfg = load_config(None, [f"critic.use_dynamic_bsz={str(dynamic).lower()}", *overrides])
        critic = build.critic_from_model(cfg, model, None, None, dist)
        assert critic.update.micro == MicroBatching(6, dynamic, 200)
        values.append(critic_update.compute_values(critic, batch, dist))
    # forward keys: 1 sequence or 17 tokens a micro-batch (6 or 4 of them); unset: the update's (1)
    assert [micro for micro, _ in seen] == [MicroBatching(1, dynamic, 17), MicroBatching(6, dynamic, 200)]
    assert [n for _, n in seen] == [4 if dynamic else 6, 1]
    torch.testing.assert_close(values[0], values[1], rtol=1e-5, atol=1e-6)
    assert float(values[0].abs().sum()) > 0


def test_critic_model_compile_layers_compiles_the_value_model_and_keeps_its_values():
    """critic.model.compile_layers compiles every decoder layer of the value model (on its own,
    without model.compile_layers), and the compiled model's values and gradients are the eager
    model's."""
    from minirl.critic.model import build_value_model
    from minirl.dist.context import DistContext
    from minirl.plugins import PluginManager

    pm, dist, cpu = PluginManager(entry_points=False), DistContext(device=torch.device("cpu")), torch.device("cpu")
    prompts, responses = [[5, 9, 2], [7, 1, 4, 4, 8]], [[3, 6], [2, 2, 9]]
    results = []
    for enabled in (False, True):
        cfg = load_config(
            None,
            [
                "trainer.device='cpu'",
                "algorithm.adv_estimator=gae",
                f"critic.model.compile_layers={str(enabled).lower()}",
            ],
        )
        model = build_value_model(pm, cfg, dist)
        compiled = [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in model.get_decoder().layers]
        assert compiled == [enabled] * len(compiled)
        values_R = response_values(model, prompts, responses, cpu)
        values_R.square().sum().backward()
        results.append((values_R.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-5)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
