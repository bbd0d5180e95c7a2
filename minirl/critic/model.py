"""The value model: the actor's backbone with a scalar head in place of the lm_head, and its packed
forward pass.

The backbone is critic.model.path, or (empty) the actor's own model: model.path, or model.preset
drawn with model.seed (so a preset critic starts from the actor's initial weights). The head is
nn.Linear(hidden, 1) with bias, weight ~ N(0, initializer_range²) and bias 0 (transformers'
init of a token-classification score head, as verl's critic), drawn from a generator seeded with
model.seed, so every rank draws the same head without touching the run's random stream.

The model stays a transformers causal LM whose `get_output_embeddings()` is the value head: the
assembly hooks (Ulysses, activation checkpointing, FSDP2) and minirl.forward.packed's packing apply to
it unchanged. V_t is read at the position that predicts response token t (the last prompt token
for t = 0), the positions whose hidden states give the log-probs (verl's alignment).
Legend: R response tokens of a micro-batch (r: of this rank's sequence-parallel slice), H hidden size.
"""

from __future__ import annotations

import dataclasses

import torch

from minirl.dist.context import DistContext
from minirl.forward.packed import packed_forward
from minirl.models import assembly
from minirl.models.loading import load_model_for_rank


def backbone_config(model_cfg, critic_cfg):
    """The `model` section the critic's backbone loads from (critic.model.path wins)."""
    path = critic_cfg.model.path or model_cfg.path
    return dataclasses.replace(
        model_cfg,
        path=path,
        tokenizer=model_cfg.tokenizer or model_cfg.path,  # the actor's tokenizer (a preset's when both are empty)
        seed=model_cfg.seed if not path else 0,
        enable_gradient_checkpointing=critic_cfg.model.enable_gradient_checkpointing,
    )


def add_value_head(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Replace the lm_head by a scalar head (see the module docstring for its init), in place."""
    config = model.config
    old = model.get_output_embeddings()
    # built on the meta device: nn.Linear's own init would draw from the run's random stream
    head = torch.nn.Linear(config.hidden_size, 1, bias=True, dtype=old.weight.dtype, device="meta")
    head = head.to_empty(device=old.weight.device)
    if not old.weight.is_meta:  # a meta model (ranks > 0 with a checkpoint) gets rank 0's head
        g = torch.Generator().manual_seed(seed)
        std = getattr(config, "initializer_range", 0.02)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=g) * std)
            head.bias.zero_()
    config.tie_word_embeddings = False  # the head is its own parameter; nothing may re-tie it
    model.set_output_embeddings(head)
    return model


def build_value_model(pm, cfg, dist: DistContext) -> torch.nn.Module:
    """The assembled critic (cfg is the whole config; the hooks get the critic's sections)."""
    model_cfg = backbone_config(cfg.model, cfg.critic)
    model, _ = load_model_for_rank(model_cfg, dist, getattr(torch, cfg.model.dtype))
    add_value_head(model, cfg.model.seed)
    return assembly.assemble_critic(pm, model, cfg.critic, dist)


def value_head(model, hidden_rH: torch.Tensor, labels_r: torch.Tensor) -> tuple[torch.Tensor]:
    """V [r] (float32) from the hidden states: minirl.forward.packed's head of the critic."""
    # sum over the head's one output: exactly that value, and a new tensor rather than a view
    # (FSDP2 hooks a root output for backward; a view of it may lose the hook)
    return (model.get_output_embeddings()(hidden_rH).float().sum(-1),)


def response_values(model: torch.nn.Module, prompts, responses, device: torch.device) -> torch.Tensor:
    """Values [R] (float32) at the positions that predict the response tokens, sequence-major."""
    return packed_forward(model, prompts, responses, device, value_head)[0]
