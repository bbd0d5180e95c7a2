"""AdamW with linear warm-up, then a constant or cosine learning rate (verl's actor.optim keys)."""

from __future__ import annotations

import math

import torch

from minirl import hookimpl


def warmup_steps(cfg, total_steps: int) -> int:
    """actor.optim.lr_warmup_steps wins when >= 0, else lr_warmup_steps_ratio × total steps."""
    if cfg.lr_warmup_steps >= 0:
        return cfg.lr_warmup_steps
    return int(cfg.lr_warmup_steps_ratio * total_steps)


def lr_factor(step: int, warmup: int, total: int, style: str, min_ratio: float) -> float:
    """The multiplier of the base lr before optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_adamw(model: torch.nn.Module, cfg, total_steps: int):
    """AdamW and its LambdaLR schedule; cfg is an `optim` section (warmup_style is validated)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused kernel (one pass over each tensor) on CUDA and on the CPU alike: on the CPU it
    # is about 7x the default per-tensor loop (111M parameters, 2 cores: 61 vs 444 ms a step),
    # which is the optimizer of fsdp_config.param_offload. Mixed devices keep the default.
    fused = bool(params) and len({p.device.type for p in params}) == 1 and params[0].device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **({"fused": True} if fused else {}),
    )
    warmup = warmup_steps(cfg, total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, total_steps, cfg.warmup_style, cfg.min_lr_ratio)
    )
    return optimizer, schedule


@hookimpl(trylast=True)
def minirl_build_optimizer(model, cfg, total_steps):
    return build_adamw(model, cfg, total_steps)
