"""Full fine-tuning: every parameter trains, and the reference is a frozen copy of the starting
model, assembled on its own."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, ContextManager, Iterator

import torch
from torch.distributed.tensor import DTensor

from minirl.checkpoint.hf import save_hf_checkpoint
from minirl.models import assembly
from minirl.models.compile import claiming_gradients


class Reference:
    """The frozen reference policy: `with reference() as model:` runs it (a model of its own, or
    the actor under a mode that makes it the reference: LoRA's adapters off)."""

    def __init__(
        self, model: torch.nn.Module, mode: Callable[[torch.nn.Module], ContextManager] = contextlib.nullcontext
    ):
        self.model, self.mode = model, mode

    def __call__(self) -> ContextManager[torch.nn.Module]:
        return self.mode(self.model)


class FullFineTuning:
    saves_trainable_only = False  # a checkpoint holds every parameter and its optimizer state

    def __init__(self, actor: torch.nn.Module, reference: Reference | None):
        self.actor, self.reference = actor, reference

    @classmethod
    def assemble(cls, pm, model: torch.nn.Module, cfg, dist, needs_reference: bool) -> FullFineTuning:
        """The reference is copied before the actor is sharded and wrapped."""
        reference = None
        if needs_reference:
            frozen = copy.deepcopy(model).eval().requires_grad_(False)
            frozen = assembly.assemble_reference(pm, frozen, cfg.ref, dist, cfg.model)
            plain = not any(isinstance(p, DTensor) for p in frozen.parameters())
            reference = Reference(
                frozen, claiming_gradients if cfg.model.compile_layers and plain else contextlib.nullcontext
            )
        return cls(assembly.assemble_actor(pm, model, cfg, dist), reference)

    def engine_weights(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What an engine loads, by Hugging Face name (after an update every parameter changed)."""
        return assembly.full_weights(self.actor)

    def shared_weights(self) -> dict[str, torch.Tensor]:
        """What an engine may hold instead of a copy (EngineContext.shared): nothing, every
        parameter changes at every update."""
        return {}

    def trained_parameters(self) -> int | None:
        """The parameters that get weight gradients, for the MFU (None: all of them)."""
        return None

    def describe(self, trainer_cfg, run_dir: str) -> str | None:
        """The start-up line of a LoRA run; full fine-tuning, the usual case, has none."""
        return None

    def save_hf(self, tokenizer, path: str, dist) -> None:
        save_hf_checkpoint(self.actor, tokenizer, path, dist)
