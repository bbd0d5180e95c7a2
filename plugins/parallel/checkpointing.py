"""Activation checkpointing of every decoder layer (model.enable_gradient_checkpointing).

Applied before data-parallel sharding, as the assembly order requires, so FSDP2 sees the
checkpointed layers.
"""

from __future__ import annotations

from minirl import hookimpl


@hookimpl
def minirl_apply_activation_checkpointing(model, cfg):
    if not cfg.enable_gradient_checkpointing:
        return
    # Non-reentrant checkpointing works with packed inputs whose kwargs carry no gradient and
    # composes with FSDP2; the reentrant variant does neither.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
