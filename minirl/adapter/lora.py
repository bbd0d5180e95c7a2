"""LoRA: only the adapters train (minirl.models.lora injects them); the reference is the actor
itself with its adapters off, the engines get the merged weights, a checkpoint holds the adapters
and their optimizer state, and the export is peft's adapter directory (docs/architecture.md,
"LoRA adapters")."""

from __future__ import annotations

import os
from typing import Iterator

import torch

from minirl.adapter.full import Reference
from minirl.checkpoint.hf import save_hf_checkpoint
from minirl.forward.packed import matmul_dtype, param_dtype
from minirl.models import assembly, lora


class LoRAFineTuning:
    saves_trainable_only = True  # the frozen base is rebuilt from model.path / model.preset

    def __init__(self, actor: torch.nn.Module, reference: Reference | None, save_merged: bool):
        self.actor, self.reference, self.save_merged = actor, reference, save_merged

    @classmethod
    def assemble(cls, pm, model: torch.nn.Module, cfg, dist, needs_reference: bool) -> LoRAFineTuning:
        """The adapters go in before the assembly; the reference costs no second model."""
        lora.apply_lora(model, cfg.model, cfg.model.path or cfg.model.preset)
        # no float32 copy of the frozen base; the embedding too where the sharding gathers it in bf16
        gathered = param_dtype(cfg.actor.fsdp_config, dist.device.type) if dist.mesh is not None else None
        lora.hold_frozen_in(model, matmul_dtype(dist.device), embedding=gathered)
        actor = assembly.assemble_actor(pm, model, cfg, dist)
        reference = Reference(actor, lora.adapters_disabled) if needs_reference else None
        return cls(actor, reference, cfg.model.lora_save_merged)

    def engine_weights(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged weights (W + B A * alpha / r); changed_only: the targeted matrices alone (the
        frozen rest is what the engine loaded when it was built)."""
        return assembly.full_weights(self.actor, adapted_only=changed_only)

    def shared_weights(self) -> dict[str, torch.Tensor]:
        """What an engine next to the actor may hold instead of copies (EngineContext.shared): the
        frozen tensors outside the adapted matrices, by Hugging Face name. The embedding and an
        untied head of qwen2-7b are 2.2 GB of bf16 that the engine need not hold twice."""
        return dict(assembly.constant_weights(self.actor))

    def trained_parameters(self) -> int | None:
        return sum(p.numel() for name, p in self.actor.named_parameters() if lora.is_adapter_param(name))

    def describe(self, trainer_cfg, run_dir: str) -> str:
        """The start-up line: what trains, and where the adapters go."""
        c, layers = self.actor.lora_config, lora.lora_layers(self.actor)
        targets = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in layers}))
        trained, total = self.trained_parameters(), sum(p.numel() for p in self.actor.parameters())
        hf = os.path.join(run_dir, "hf_step_<N>")
        if trainer_cfg.save_hf_freq > 0:
            merged = f" (the merged model in {hf}/merged)" if self.save_merged else ""
            out = f"every {trainer_cfg.save_hf_freq} steps a peft adapter directory {hf}{merged}"
        else:
            out = (
                "no adapter directory during the run (trainer.save_hf_freq = 0; after it, python -m minirl export "
                "--checkpoint CKPT --out DIR --keep-adapter writes the merged model and the adapter)"
            )
        return (
            f"LoRA: only the adapters train: rank {c.r}, alpha {c.lora_alpha}, on {len(layers)} linear layers "
            f"({targets}), {trained:,} trainable parameters of {total:,} "
            f"({100 * trained / total:.2g}%); checkpoints hold the adapters and their optimizer state; {out}"
        )

    def save_hf(self, tokenizer, path: str, dist) -> None:
        """A peft adapter directory with the tokenizer; with model.lora_save_merged also `path/merged`,
        the full model with the adapters merged."""
        lora.save_adapter(self.actor, path, dist.is_main)
        if dist.is_main:
            tokenizer.save_pretrained(path)
        if self.save_merged:
            save_hf_checkpoint(self.actor, tokenizer, os.path.join(path, "merged"), dist)
