"""The model adapter: how the policy is fine-tuned, every parameter (`full`) or LoRA adapters on
a frozen base (`lora`, model.lora_rank). Chosen once, when the actor is assembled (build.models);
it alone answers what depends on the choice: which parameters train, what the reference is, the
weights an engine gets after an update, what a checkpoint holds and what the Hugging Face export
writes. May import `models`, `checkpoint` and everything below them."""

from __future__ import annotations

from minirl.adapter.full import FullFineTuning, Reference
from minirl.adapter.lora import LoRAFineTuning
from minirl.models import lora

__all__ = ["FullFineTuning", "LoRAFineTuning", "Reference", "assemble"]


def assemble(pm, model, cfg, dist, needs_reference: bool) -> FullFineTuning | LoRAFineTuning:
    """The adapter of [model] around the actor assembled from the loaded `model`, with a reference
    when `needs_reference` (a KL term)."""
    kind = LoRAFineTuning if lora.enabled(cfg.model) else FullFineTuning
    return kind.assemble(pm, model, cfg, dist, needs_reference)
