"""Regional torch.compile (model.compile_layers): each decoder layer's forward is compiled, the
attention kernel call stays eager.

A decoder layer is a few GEMMs (cuBLAS already runs them near the matmul ceiling) surrounded by
element-wise work: two RMSNorms in float32, rotary embeddings, SiLU·mul, residual adds, each an
eager kernel that reads and writes the whole activation. Inductor fuses them into a few kernels
(forward and backward). Compiling a layer rather than the model keeps the compile short (all
layers share one graph: parameters are graph inputs, not constants) and leaves FSDP2's hooks,
activation checkpointing and the packed varlen attention outside the graph: the attention core
is a graph break (minirl.models.attention calls it through torch.compiler.disable), so its
Python-int boundaries never become part of a guard.

Shapes: a packed micro-batch's length differs every call, so layers are compiled with dynamic
shapes from the start (one graph, no recompile per length).

Rounding: inductor emulates eager's bf16 rounding between the ops it fuses
(emulate_precision_casts). Without it, a fused kernel keeps some intermediates in float32 that
eager rounds to bf16, and which ones depends on the graph: the training graph (which must save
activations for backward) and the inference graph (log-prob passes) round differently. The
reference and the actor then disagree at identical weights (a KL of about 1e-3 per token at step
1 of the h200 profile, 0 in eager mode), and so would a prev-log-prob pass and the update.
"""

from __future__ import annotations

import types

import torch

from minirl.errors import UserError

INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def compile_layers(model: torch.nn.Module, enabled: bool) -> int:
    """Compile every decoder layer's forward in place when `enabled`; returns how many.

    Each layer gets the compiled class function bound to itself as an instance attribute: the
    module (its hooks, names, checkpoint wrapper) is unchanged, and a deep copy of the model
    (the hf engine copies the actor) binds the copy's layers to the copies, not to the originals.
    """
    if not enabled:
        return 0
    layers = _layers(model)
    compiled = {}
    for layer in layers:
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, dynamic=True, options=INDUCTOR_OPTIONS)
        layer.forward = types.MethodType(compiled[cls], layer)
    return len(layers)


def uncompile_layers(model: torch.nn.Module) -> None:
    """Undo compile_layers (eager forwards again): for a copy that runs another kind of forward,
    e.g. the hf engine's generate with a KV cache."""
    for layer in _layers(model):
        layer.__dict__.pop("forward", None)


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(
            f"model.compile_layers = true: {type(model).__name__} has no decoder layers "
            "(`get_decoder().layers`) to compile; set model.compile_layers = false"
        )
    return layers
