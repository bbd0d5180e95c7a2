"""Turning a plain model into the actor, the reference and the critic, in the order the core fixes:
sequence parallel -> activation checkpointing -> regional compile (model.compile_layers) and the
fused MLP (model.fused_mlp) -> data-parallel sharding -> optimizer.

Plugins do the work through the assembly hooks; this module only calls them in order.
"""

from __future__ import annotations

import copy
from typing import Iterator

import torch

from minirl.dist.context import DistContext
from minirl.models import lora
from minirl.models.compile import compile_layers, constant_attention_sizes, uncompile_layers
from minirl.models.fused_mlp import fuse_mlps, unfuse_mlps
from minirl.models.names import hf_name  # re-exported: the engines' import


def assemble_actor(pm, model: torch.nn.Module, cfg, dist: DistContext) -> torch.nn.Module:
    """cfg is the whole config: the hooks get their own sections (actor, model)."""
    return _assemble(pm, model, cfg.actor, cfg.model, dist)


def assemble_critic(pm, model: torch.nn.Module, critic_cfg, dist: DistContext) -> torch.nn.Module:
    """The value model through the actor's recipe; the hooks get the critic's sections (critic,
    critic.model), which carry the same key names as the actor's."""
    return _assemble(pm, model, critic_cfg, critic_cfg.model, dist, "critic.model")


def assemble_reference(pm, model: torch.nn.Module, ref_cfg, dist: DistContext, model_cfg=None) -> torch.nn.Module:
    """model_cfg: the [model] section (the reference is the actor's model, sped up as it is);
    None leaves the reference as it is, neither compiled nor fused (tests that build one). A
    frozen model needs no activation checkpointing."""
    return _assemble(pm, model, ref_cfg, model_cfg, dist, checkpointing=False)


def _assemble(pm, model, parallel_cfg, model_cfg, dist, section="model", checkpointing=True) -> torch.nn.Module:
    """parallel_cfg: actor, ref or critic; model_cfg: [model] or [critic.model], named by `section`."""
    pm.hook.minirl_apply_sequence_parallel(model=model, cfg=parallel_cfg, mesh=dist.mesh)
    if checkpointing:
        pm.hook.minirl_apply_activation_checkpointing(model=model, cfg=model_cfg)
    if model_cfg is not None:
        speed_up(model, model_cfg, section)
    wrapped = pm.hook.minirl_apply_data_parallel(model=model, cfg=parallel_cfg, mesh=dist.mesh)
    model = model if wrapped is None else wrapped
    if model_cfg is not None and model_cfg.compile_layers:
        constant_attention_sizes(model)
    return model


def speed_up(model: torch.nn.Module, model_cfg, section: str = "model") -> None:
    """model_cfg: [model] or [critic.model] (compile_layers, fused_mlp), named by `section`."""
    compile_layers(model, model_cfg.compile_layers)
    fuse_mlps(model, model_cfg.fused_mlp, f"{section}.fused_mlp")


def build_optimizer(pm, model: torch.nn.Module, optim_cfg, total_steps: int):
    result = pm.hook.minirl_build_optimizer(model=model, cfg=optim_cfg, total_steps=total_steps)
    if result is None:
        raise RuntimeError("no plugin built an optimizer (minirl_plugins.algorithms.optim should have)")
    return result


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters a forward without backward leaves behind (a log-prob or
    values pass): FSDP2 keeps the root, and a trained model's last layer, gathered for a
    backward that never comes. Every sharded module, not just the root: a layer left gathered
    kept its pre-update copy in the next update's forward passes, so mini-batches after the
    first trained on stale weights (tests/distributed/test_dp_update_parity.py)."""
    for module in model.modules():
        if hasattr(module, "reshard"):
            module.reshard()


def full_weights(model: torch.nn.Module, adapted_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) one parameter at a time, never the whole model at once: a
    sharded parameter (DTensor) is gathered just for the moment its copy is made. A LoRA layer
    comes merged (W + B A * alpha / r under W's name, no adapter tensors), so every consumer (the
    engines, the checksum, the HF export) sees a plain model; adapted_only: only those merged
    matrices (what a LoRA update changes)."""
    for name, tensor in lora.merged_weights(model, adapted_only):
        yield hf_name(name), tensor


def constant_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of a LoRA model's parameters that never change and that engines
    load as they are (minirl.models.lora.constant_weights); none for a model without adapters."""
    for name, tensor in lora.constant_weights(model):
        yield hf_name(name), tensor


def plain_copy(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the actor as Hugging Face's generate runs it, on `device` in `dtype`: LoRA layers
    merged into plain Linears, decoder layers uncompiled, MLPs unfused (an engine that copies
    the module instead of loading weights by name)."""
    plain = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    lora.unload(plain)
    uncompile_layers(plain)
    unfuse_mlps(plain)
    return plain
