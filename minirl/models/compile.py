"""Regional torch.compile (model.compile_layers): each decoder layer's forward is compiled, the
attention kernel call stays eager.

Inductor fuses the element-wise work between a layer's GEMMs (RMSNorms, rotary embeddings,
SiLU·mul, residual adds). Compiling each layer rather than the model keeps the compile short (all
layers share one graph, parameters being graph inputs) and leaves FSDP2's hooks, activation
checkpointing and the varlen attention core (a graph break) outside the graph. Layers compile with
dynamic shapes: a packed micro-batch's length differs every call, every size with a symbol of its
own, float attributes as constants (symbol_per_size). The design at length: docs/architecture.md,
"Regional compilation"; a second process can compile the graphs ahead (minirl/precompile.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Callable, Iterator

import torch

from minirl.errors import UserError

# Round like eager bf16 between fused ops: otherwise the training graph and the inference graph keep
# different intermediates in float32, and the reference and the actor disagree at identical weights
# (a KL of about 1e-3 per token at step 1 of the h200 profile, 0 in eager mode).
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
    symbol_per_size()
    layers = _layers(model)
    compiled = {}
    for layer in layers:
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, dynamic=True, options=INDUCTOR_OPTIONS)
        layer.forward = types.MethodType(compiled[cls], layer)
        seq_major_rotary(getattr(layer, "self_attn", None))
    _first_layer_like_the_rest(model, layers)
    return len(layers)


def _first_layer_like_the_rest(model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
    """Give layer 0's input the requires_grad every other layer's input has in the same pass:
    dynamo guards on it, so where they differ it compiles each piece of layer 0 (its forward up to
    the attention, the projections, the MLP block) a second time, for forward and backward, where
    layer 0 could run the others' graphs (3 of a LoRA step 1's 13 graphs, about 11 s on the H200).

    Two causes, both here. Under a frozen embedding (LoRA) its output needs no gradient while the
    layers' outputs do: where the layers train, a hook makes the embedding's output require one
    when the pass records gradients. The price is layer 0's input gradient, computed and dropped:
    its input norm's backward and one input-gradient GEMM of its q/k/v projection, about 0.1% of
    a LoRA update's FLOPs. And Hugging Face's hook (gradient_checkpointing_enable installs it, for
    reentrant checkpointing, which minirl does not use) makes the output require a gradient in
    gradient-free passes too, where no other layer's input does: it is removed while the layers
    are compiled (uncompile_layers puts it back)."""
    if getattr(model, "_require_grads_hooks", None):
        model.disable_input_require_grads()
        model.__dict__[_HF_HOOK_REMOVED] = True
    embed = model.get_input_embeddings()
    if embed is None or embed.weight.requires_grad or not any(p.requires_grad for p in layers.parameters()):
        return
    if _output_requires_grad not in embed._forward_hooks.values():
        embed.register_forward_hook(_output_requires_grad)


_HF_HOOK_REMOVED = "_minirl_removed_input_require_grads"


def _output_requires_grad(module, args, output):
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)


@contextlib.contextmanager
def claiming_gradients(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The reference's parameters require gradients while it runs, under no_grad (so nothing is
    recorded and none gets a gradient): the values are the same, and its compiled layers' guards
    match those of the actor's gradient-free passes, whose parameters require gradients. Dynamo
    guards on requires_grad, so an off-policy run's reference pass ran graphs of its own after the
    prev-log-prob pass; now it runs the actor's where nothing else differs (all four pieces of a
    layer on one CPU process; with FSDP2's actor, as on CUDA, the attention's two: FSDP2 gives
    the actor's layers a class of their own, another guard). Only for a reference outside FSDP2
    (one process): a sharded one's gathered parameters keep the flag they were made with."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    with torch.no_grad():
        for p in frozen:
            p.requires_grad_(True)
        try:
            yield model
        finally:
            for p in frozen:
                p.requires_grad_(False)


def symbol_per_size() -> None:
    """Give every dynamic size a symbol of its own and make float attributes constants, in this
    process's compiles from now on.

    By default two sizes of equal value share one symbol ("duck" shapes): a micro-batch whose
    longest sequence happens to equal another size (a head dimension, the token count of a
    one-sequence micro-batch) compiles a graph for the coincidence, the next one without it
    recompiles, and a graph compiled elsewhere (minirl.precompile's twin) matches only on the
    same coincidences. Where a graph needs two sizes equal (a broadcast), dynamo still proves it
    with a guard. A float attribute traced as a tensor input (LoRA's scaling, an addmm alpha)
    made dynamo compile a partial graph, discard it and start again."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    torch._dynamo.config.specialize_float = True


def uncompile_layers(model: torch.nn.Module) -> None:
    """Undo compile_layers (eager forwards again): for a copy that runs another kind of forward,
    e.g. the hf engine's generate with a KV cache."""
    for layer in _layers(model):
        for module in (layer, getattr(layer, "self_attn", layer)):  # the layer, its seq-major rotary
            module.__dict__.pop("forward", None)
    embed = model.get_input_embeddings()
    hooks = {} if embed is None else embed._forward_hooks
    for key in [key for key, hook in hooks.items() if hook is _output_requires_grad]:
        del hooks[key]
    if model.__dict__.pop(_HF_HOOK_REMOVED, False):
        model.enable_input_require_grads()


def constant_attention_sizes(model: torch.nn.Module) -> None:
    """After a data-parallel wrapper (FSDP2) has wrapped the compiled layers: let dynamo trace each
    layer's attention module as a plain module again, so that its int attributes (head_dim) are
    constants in the graphs.

    fully_shard marks every module of a unit FSDP-managed (`_is_fsdp_managed_module`, read by
    dynamo alone), and dynamo makes the int attributes of such modules dynamic sizes under
    dynamic=True. head_dim became a graph input, and inductor's rotary kernels indexed through
    divisions by it: 4.1-4.8 times as long as the unwrapped reference's on an H100
    (docs/benchmarks.md, "LoRA"). The attention module holds no parameters of its own; its
    projections, whose parameters FSDP2 swaps in and out around each forward, stay FSDP-managed."""
    for layer in _layers(model):
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, "_is_fsdp_managed_module", False) and next(attn.parameters(recurse=False), None) is None:
            attn._is_fsdp_managed_module = False


def seq_major_rotary(attn: torch.nn.Module | None) -> bool:
    """Give `attn` its class's forward with the rotary embedding applied to the [B, N, H, D] view
    of q and k, transposed back after: the same operations on the same values, so the same bits;
    with a dynamic N, inductor's kernel for Hugging Face's [B, H, N, D] layout indexes through
    divisions by N, this one by constants only (on the H200 both run about equally fast,
    docs/benchmarks-history.md). False, and nothing changed, for an attention whose module has no
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
