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

Rotary layout: Hugging Face attentions transpose q and k to [B, H, N, D] before the rotary
embedding; with a dynamic N, inductor's fused kernel for that layout indexes through divisions
by N. A compiled layer's attention applies the same rotary function to the [B, N, H, D] view
(`unsqueeze_dim=2`) and transposes the result back: the same element-wise operations on the same
values, so the same bits, with only constant divisors in the kernel's index arithmetic. (The
profile of a whole run had found the rotary kernel slow; a single layer on the H200 runs both
layouts equally fast, the seq-major one 1% faster forward + backward: docs/benchmarks.md.)
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable

import torch

from minirl.errors import UserError

INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
_STANDARD_ROTARY = ("q", "k", "cos", "sin", "unsqueeze_dim")  # apply_rotary_pos_emb's parameters


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
        seq_major_rotary(getattr(layer, "self_attn", None))
    return len(layers)


def uncompile_layers(model: torch.nn.Module) -> None:
    """Undo compile_layers (eager forwards again): for a copy that runs another kind of forward,
    e.g. the hf engine's generate with a KV cache."""
    for layer in _layers(model):
        layer.__dict__.pop("forward", None)
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            attn.__dict__.pop("forward", None)


def seq_major_rotary(attn: torch.nn.Module | None) -> bool:
    """Give `attn` its class's forward with the rotary embedding applied in [B, N, H, D] layout
    (module docstring); False, and nothing changed, for an attention whose module has no
    `apply_rotary_pos_emb` with exactly the parameters (q, k, cos, sin, unsqueeze_dim)."""
    forward = getattr(type(attn), "forward", None)
    if attn is None or not isinstance(forward, types.FunctionType):
        return False
    rotary = forward.__globals__.get("apply_rotary_pos_emb")
    if not callable(rotary) or list(inspect.signature(rotary).parameters) != list(_STANDARD_ROTARY):
        return False  # e.g. Gemma's one-tensor helper (x, cos, sin, unsqueeze_dim)
    attn.forward = types.MethodType(_with_seq_major_rotary(forward, rotary), attn)
    return True


@functools.cache
def _with_seq_major_rotary(forward: types.FunctionType, rotary: Callable) -> types.FunctionType:
    """One function per (forward, rotary) pair, so every layer shares it and one compiled graph."""

    def rotary_seq_major(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1:  # a caller already in another layout
            return rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        q_BNHD, k_BNKD = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
        return q_BNHD.transpose(1, 2), k_BNKD.transpose(1, 2)

    scope = {**forward.__globals__, "apply_rotary_pos_emb": rotary_seq_major}
    patched = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    patched.__kwdefaults__ = forward.__kwdefaults__
    patched.__qualname__ = forward.__qualname__
    return patched


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(
            f"model.compile_layers = true: {type(model).__name__} has no decoder layers "
            "(`get_decoder().layers`) to compile; set model.compile_layers = false"
        )
    return layers
