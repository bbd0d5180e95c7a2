"""LoRA adapters on the actor (model.lora_rank > 0 or model.lora_adapter_path), through peft.

peft's layer injection (`inject_adapter_in_model`) replaces each targeted nn.Linear in place by a
LoRA layer that holds the frozen Linear as `base_layer` plus `lora_A` and `lora_B`; the model keeps
its class, its decoder and its other modules, so minirl's assembly (activation checkpointing,
compiled layers, FSDP2, Ulysses) sees the same tree with three more leaves per targeted matrix.
Only the adapters require gradients, so the optimizer holds state for them alone.

Here: injection, the adapters switched off (the reference), the merged weights (what an engine
computes with) and peft's adapter directory in and out; the model adapter (minirl.adapter.lora)
decides when each is used. peft is imported only here, when LoRA is on (the extra minirl[lora]).
"""

from __future__ import annotations

import contextlib
import json
import os
import types
from typing import Iterator

import torch

from minirl.errors import UserError
from minirl.models.loading import seeded
from minirl.models.names import full_tensor, hf_name

ADAPTER = "default"  # peft's adapter name; one adapter per model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_BASE = ".base_layer"


def enabled(model_cfg) -> bool:
    """LoRA is on: a rank, or an adapter to continue from (whose config gives the rank)."""
    return model_cfg.lora_rank > 0 or bool(model_cfg.lora_adapter_path)


def peft_config(model_cfg):
    """The peft LoraConfig of [model]: the adapter directory's own when lora_adapter_path is set."""
    from peft import LoraConfig

    if model_cfg.lora_adapter_path:
        return LoraConfig.from_pretrained(os.path.expanduser(model_cfg.lora_adapter_path))
    exclude = model_cfg.exclude_modules or None
    return LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        target_modules=model_cfg.target_modules,
        exclude_modules=exclude,
        lora_dropout=model_cfg.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, model_cfg, base_name: str = "") -> torch.nn.Module:
    """Inject the adapters in place and freeze everything else; returns the model.

    Fresh adapters draw A from model.seed (B is zero, so the model starts as the base: the
    reference is then exactly the starting policy) without touching the run's random stream, so
    every rank draws the same ones. lora_adapter_path loads its weights instead. base_name:
    what adapter_config.json records as base_model_name_or_path (model.path or the preset)."""
    from peft import inject_adapter_in_model

    config = peft_config(model_cfg)
    config.base_model_name_or_path = base_name or config.base_model_name_or_path
    device = next(model.parameters()).device
    training = model.training
    # peft draws A on the CPU or on the base layer's device: both generators from model.seed
    with seeded(torch.device("cpu"), model_cfg.seed), seeded(device, model_cfg.seed):
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
        if is_adapter_param(name):  # peft keeps float32 adapters on a bf16 base; FSDP2 wants one dtype
            param.data = param.data.to(model.dtype)
    for layer in lora_layers(model).values():
        layer.forward = types.MethodType(_forward, layer)
    # peft's new modules start in training mode whatever the model's: in an eval model a log-prob
    # pass before the first update would drop out the adapters' input (lora_dropout), and a
    # compiled layer would meet two modes in the same kind of pass (a recompile at step 2)
    model.train(training)
    model.lora_config = config  # what save_adapter writes
    if model_cfg.lora_adapter_path:
        load_adapter(model, model_cfg.lora_adapter_path)
    return model


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's output x (W + s·B A)ᵀ + b, computed with the merged weight (MergedLinear):
    one GEMM forward and one for the input gradient, as a plain Linear's, where the unmerged sum
    x Wᵀ + s·(x Aᵀ) Bᵀ adds a pass over the [M, out] output forward and a second input-gradient
    GEMM and its sum backward (docs/architecture.md, "LoRA adapters"). The adapters' gradients
    are the unmerged layer's. With dropout on the adapters' input in a training forward the
    weight cannot be merged: the sum in one addmm's epilogue (_unmerged). Other cases (adapters
    off or merged by peft, peft's variants such as DoRA, extra arguments) run peft's forward."""
    if self._disable_adapters or self.merged or args or kwargs or getattr(self, "lora_variant", None):
        return type(self).forward(self, x, *args, **kwargs)
    if getattr(self.lora_dropout[ADAPTER], "p", 0.0) > 0 and self.training:  # no guard on the mode without dropout
        return _unmerged(self, x)
    base = self.base_layer
    a, b = self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight
    return MergedLinear.apply(x, base.weight, base.bias, a, b, self.scaling[ADAPTER])


def _unmerged(self, x: torch.Tensor) -> torch.Tensor:
    """x Wᵀ + b + s·(dropout(x) Aᵀ) Bᵀ with the adapters' sum in the epilogue of one addmm: the
    [M, out] output is read and written once more, and the backward has no pass over it of its
    own (addmm's gradient of its first argument is the incoming one)."""
    y = self.base_layer(x)
    xa = self.lora_A[ADAPTER](self.lora_dropout[ADAPTER](x))
    out = torch.addmm(
        y.reshape(-1, y.shape[-1]),
        xa.reshape(-1, xa.shape[-1]),
        self.lora_B[ADAPTER].weight.t(),
        alpha=self.scaling[ADAPTER],
    )
    return out.view(y.shape)


class MergedLinear(torch.autograd.Function):
    """y = x (W + s·B A)ᵀ + b in the pass's matmul dtype (autocast's, else the inputs'), the merged
    weight made by one addmm (the sum taken in float32 and rounded once, as the engines' merge
    does) and made again in the backward rather than kept. The gradients: dx = dy (W + s·B A),
    dA = s·(dy B)ᵀ x, dB = s·dyᵀ (x Aᵀ), each in the matmul dtype and returned in its input's
    dtype, as autocast's casts would; W and b get theirs only if they require one (LoRA's are
    frozen). Autocast is off inside: the dtypes are explicit, the same in the backward."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s: float):
        dt = _matmul_dtype(x, w)
        with torch.autocast(x.device.type, enabled=False):
            y = torch.nn.functional.linear(x.to(dt), _merge(w, a, b, s, dt), None if bias is None else bias.to(dt))
        ctx.save_for_backward(x, w, a, b)
        ctx.s, ctx.dt, ctx.bias_dtype = s, dt, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, a, b = ctx.saved_tensors
        s, dt = ctx.s, ctx.dt
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        with torch.autocast(dy.device.type, enabled=False):
            dy_M = dy.reshape(-1, dy.shape[-1]).to(dt)
            x_M = x.reshape(-1, x.shape[-1]).to(dt)
            dx = (dy_M @ _merge(w, a, b, s, dt)).view(x.shape).to(x.dtype) if need_x else None
            da = ((dy_M @ b.to(dt)).t() @ x_M).mul_(s).to(a.dtype) if need_a else None
            db = (dy_M.t() @ (x_M @ a.to(dt).t())).mul_(s).to(b.dtype) if need_b else None
            dw = (dy_M.t() @ x_M).to(w.dtype) if need_w else None
            dbias = dy_M.sum(0).to(ctx.bias_dtype) if need_bias and ctx.bias_dtype is not None else None
        return dx, dw, dbias, da, db, None


def _matmul_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype a Linear's matmul runs in here: autocast's where it is on, else the promoted one."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(x.dtype, w.dtype)


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, dtype: torch.dtype) -> torch.Tensor:
    """W + s·B A in `dtype`: one GEMM with the sum in its epilogue, accumulated in float32 and
    rounded once (no [out, in] product, scaled copy or sum of its own)."""
    return torch.addmm(w.to(dtype), b.to(dtype), a.to(dtype), alpha=s)


def hold_frozen_in(model: torch.nn.Module, dtype: torch.dtype | None, embedding: torch.dtype | None = None) -> int:
    """Store the frozen Linear matrices (the LoRA layers' base, an untied lm_head) and biases in
    `dtype`, the dtype every pass multiplies them in (minirl.forward.packed.matmul_dtype; None:
    nothing to do): the same products, without a float32 master copy of weights no optimizer
    updates, nor a cast on every call (autocast caches casts only of weights that train).

    The input embedding is not multiplied but looked up: autocast leaves it alone, so it keeps its
    dtype unless `embedding` names the dtype every pass reads it in anyway (the data-parallel
    sharding's gather dtype, minirl.forward.packed.param_dtype, under a mesh): then it is held in
    that, with a tied lm_head, which is the embedding. The norms keep theirs. Returns the bytes
    freed."""
    freed = 0
    embed = model.get_input_embeddings().weight
    if embedding is not None and not embed.requires_grad and embed.dtype != embedding:
        freed += embed.numel() * (embed.element_size() - embedding.itemsize)
        embed.data = embed.data.to(embedding)
    if dtype is None:
        return freed
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight is embed:
            continue
        for param in module.parameters(recurse=False):
            if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                freed += param.numel() * (param.element_size() - dtype.itemsize)
                param.data = param.data.to(dtype)
    return freed


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: LoRA layer} of the model (empty without adapters); names as the model has them."""
    return {name: m for name, m in model.named_modules() if _is_lora_layer(m)}


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def has_adapters(model: torch.nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model for the duration: every LoRA layer computes base_layer(x) alone.

    peft's own switch (enable_adapters(False)) also flips requires_grad of the adapters, which an
    FSDP2 model must not see change between its forward and backward; the flag it reads is set
    here directly (tests/unit/test_lora.py holds the result to a separate base model's output)."""
    layers = [m for m in model.modules() if _is_lora_layer(m)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def merged(layer: torch.nn.Module) -> torch.Tensor:
    """W + B A * alpha / r in W's dtype: the weight the rollout engines compute with. The sum is
    taken in float32 at least and rounded once."""
    w = full_tensor(layer.base_layer.weight)
    a = full_tensor(layer.lora_A[ADAPTER].weight)
    b = full_tensor(layer.lora_B[ADAPTER].weight)
    dtype = _at_least_float32(torch.promote_types(w.dtype, a.dtype))
    return _merge(w, a, b, layer.scaling[ADAPTER], dtype).to(w.dtype)


def merged_weights(model: torch.nn.Module, adapted_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in the model's parameter order with the adapters merged: a targeted
    matrix becomes W + B A * alpha / r under its plain name (`.base_layer` removed), the adapters
    themselves are left out. adapted_only: the targeted matrices only. Names keep the model's
    wrapper prefixes (minirl.models.assembly.hf_name removes them). A model without adapters
    gives its parameters as they are. Every rank of a sharded model must iterate: the gathers are
    collectives."""
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue
        adapted = _adapted_layer(model, name)
        if adapted is not None:
            yield adapted[0] + ".weight", merged(adapted[1])
        elif not adapted_only:
            yield name.replace(_BASE + ".", "."), full_tensor(param)


def _adapted_layer(model: torch.nn.Module, name: str) -> tuple[str, torch.nn.Module] | None:
    """(name, LoRA layer) of the layer whose frozen matrix `name` is (`<layer>.base_layer.weight`),
    or None. Looked up by its path, not found by a walk over every module per call: the walk and
    its attribute checks took half the host time of a weight sync (qwen2-1.5b's 196 matrices, 11
    of 24 ms, CPU). The path is followed through `_modules`, the tree named_parameters names
    (wrappers included), as get_submodule would, at a twentieth of its cost (9 us a lookup).
    Nothing is cached on the model, whose copies would carry a stale cache."""
    suffix = _BASE + ".weight"
    if not name.endswith(suffix):
        return None
    path, layer = name[: -len(suffix)], model
    for atom in path.split("."):
        layer = layer._modules[atom]
    return (path, layer) if _is_lora_layer(layer) else None


def constant_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters a LoRA run never changes and that an engine loads as they
    are: the frozen ones outside the adapted matrices (the embedding, an untied head, the norms,
    the adapted layers' biases), under the names merged_weights gives them. A sharded parameter
    (DTensor) is left out: no process holds it whole."""
    for name, param in model.named_parameters():
        if param.requires_grad or is_adapter_param(name) or hasattr(param, "full_tensor"):
            continue
        if _adapted_layer(model, name) is None:  # an adapted matrix the engine holds merged
            yield name.replace(_BASE + ".", "."), param.detach()


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters in peft's file layout: `base_model.model.<module>.lora_A.weight` (the
    adapter name dropped), full tensors on the CPU. Every rank must call (gathers)."""

    out = {}
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            key = "base_model.model." + hf_name(name).replace(f".{ADAPTER}.", ".")
            out[key] = full_tensor(param).to("cpu", copy=True).contiguous()
    return out


def save_adapter(model: torch.nn.Module, path: str, is_main: bool = True) -> None:
    """A peft adapter directory that peft's PeftModel.from_pretrained and lora_adapter_path load."""
    state = adapter_state(model)
    if not is_main:
        return
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.lora_config.save_pretrained(path)


@torch.no_grad()
def load_adapter(model: torch.nn.Module, path: str) -> None:
    """Copy a peft adapter directory's weights into the model's adapters (shapes checked up front
    by minirl.validate.files; a missing or extra tensor is an error here)."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(os.path.expanduser(path), ADAPTER_WEIGHTS))
    params = {name: p for name, p in model.named_parameters() if is_adapter_param(name)}
    want = {"base_model.model." + hf_name(n).replace(f".{ADAPTER}.", "."): n for n in params}
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    if missing or extra:
        raise UserError(
            f"model.lora_adapter_path = {path!r}: the adapter does not fit the model "
            f"({len(missing)} adapter tensors missing, e.g. {missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]}); "
            "use an adapter trained on this base model with the same target_modules"
        )
    for key, name in want.items():
        param, tensor = params[name], saved[key]
        if tuple(tensor.shape) != tuple(param.shape):
            raise UserError(
                f"model.lora_adapter_path = {path!r}: {key} has shape {tuple(tensor.shape)}, the model's adapter "
                f"{tuple(param.shape)}; use an adapter trained on this base model"
            )
        param.copy_(tensor.to(param.dtype))


def unload(model: torch.nn.Module) -> torch.nn.Module:
    """Merge every adapter into its base Linear and put the Linear back in place of the LoRA layer
    (a plain model with the adapters' effect: the hf engine's copy, the merged export)."""
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            layer.base_layer.weight.copy_(merged(layer))
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, layer.base_layer)
    return model


def read_adapter_config(path: str) -> dict:
    with open(os.path.join(os.path.expanduser(path), ADAPTER_CONFIG)) as f:
        return json.load(f)
