"""Activation checkpointing of the first model.recompute_num_layers decoder layers
(plugins/parallel/checkpointing.py): which layers recompute, that the gradients are the same
whatever the number (recomputation repeats the same forward), and the error for too many."""

from __future__ import annotations

import pytest
import torch

from minirl.config.schema import CriticModelConfig, ModelConfig
from minirl.errors import UserError
from minirl.forward.packed import logprob_head, packed_forward
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl_plugins.parallel.checkpointing import minirl_apply_activation_checkpointing


def _model(recompute: int | None):
    model = random_model(preset_config("tiny"), "cpu", torch.float32, seed=3)
    if recompute is not None:
        cfg = ModelConfig(enable_gradient_checkpointing=True, recompute_num_layers=recompute)
        minirl_apply_activation_checkpointing(model=model, cfg=cfg)
    return model.train()


def _grads(model) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (5, 3)]
    responses = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (7, 4)]
    logp, _ = packed_forward(model, prompts, responses, torch.device("cpu"), logprob_head(1.0))
    logp.sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("recompute", [-1, 0, 1])
def test_the_first_n_layers_recompute_and_gradients_do_not_change(recompute):
    model = _model(recompute)
    layers = model.get_decoder().layers
    n = len(layers) if recompute < 0 else recompute
    assert [layer.gradient_checkpointing for layer in layers] == [i < n for i in range(len(layers))]
    for got, want in zip(_grads(model), _grads(_model(None)), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_more_layers_than_the_model_has_is_an_error_naming_the_section():
    model = random_model(preset_config("tiny"), "cpu", torch.float32)
    n = len(model.get_decoder().layers)
    for cfg, key in ((ModelConfig, "model."), (CriticModelConfig, "critic.model.")):
        with pytest.raises(UserError, match=rf"{key}recompute_num_layers = {n + 1}: the model has {n} decoder"):
            minirl_apply_activation_checkpointing(
                model=model, cfg=cfg(enable_gradient_checkpointing=True, recompute_num_layers=n + 1)
            )
