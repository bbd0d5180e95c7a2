"""Activation checkpointing of the decoder layers (model.enable_gradient_checkpointing): every
layer, or the first model.recompute_num_layers of them.

Applied before data-parallel sharding, as the assembly order requires, so FSDP2 sees the
checkpointed layers. A layer left out keeps its activations for the backward instead of
recomputing its forward: at long context, memory left over after the recomputed layers buys back
their share of the recomputation (docs/benchmarks.md, "Long context").
"""

from __future__ import annotations

from minirl import hookimpl
from minirl.errors import UserError


@hookimpl
def minirl_apply_activation_checkpointing(model, cfg):
    if not cfg.enable_gradient_checkpointing:
        return
    # Non-reentrant checkpointing works with packed inputs whose kwargs carry no gradient and
    # composes with FSDP2; the reentrant variant does neither.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.get_decoder().layers
    section = "model" if hasattr(cfg, "preset") else "critic.model"
    keep_from = _recomputed(cfg.recompute_num_layers, len(layers), section)
    for layer in list(layers)[keep_from:]:
        layer.gradient_checkpointing = False


def _recomputed(n: int, num_layers: int, section: str) -> int:
    if n > num_layers:
        raise UserError(
            f"{section}.recompute_num_layers = {n}: the model has {num_layers} decoder layers; "
            f"use -1 (every layer) or a number from 0 to {num_layers}"
        )
    return num_layers if n < 0 else n
