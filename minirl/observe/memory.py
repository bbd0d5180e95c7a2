"""What holds the training device's memory: the bytes each part of the run keeps, by count.

`held_memory` counts the tensors the trainer keeps between steps (the actor's weights that train
and its frozen ones, their optimizer state, the reference when it is a model of its own, the
critic), each storage once and only where it lies on the training device (an offloaded optimizer
state is not device memory). Gradients live only during the update: their bytes are those of the
weights that train (a gradient has its parameter's shape, dtype and sharding). The rollout engine
reports its own (its weights, its KV cache while it is allocated), as `<name>_gib` in last_stats.

Logged as memory_gib/held/<holder> beside each phase's peak (memory_gib/<phase>, PhaseTimer): a
phase's peak minus what is held during it is its activations and workspace (docs/benchmarks.md,
"What holds the memory").
"""

from __future__ import annotations

from typing import Iterable

import torch

GIB = 2**30


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _same_device(a: torch.device, b: torch.device) -> bool:
    """One device, where an index left out ("cuda") means the current one."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class StorageCounter:
    """Bytes of distinct storages on one device: a storage counted under one holder is not counted
    again under another (tied weights, views into fused buffers, a reference that is the actor)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seen: set[int] = set()

    def count(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            t = _local(tensor)
            if not _same_device(t.device, self.device):
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (AdamW: exp_avg, exp_avg_sq and the step counts)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def gradient_bytes(params: Iterable[torch.nn.Parameter], device: torch.device) -> int:
    """What the weights that train take again as gradients during the update."""
    counter = StorageCounter(device)
    return sum(counter.count([p]) for p in params if p.requires_grad)


def held_memory(device, actor, optimizer, reference=None, critic=None) -> dict[str, float]:
    """memory_gib/held/<holder> of the training device. reference: the reference model when it is
    not the actor (full fine-tuning; LoRA's reference is the actor with its adapters off);
    critic: (model, optimizer)."""
    counter = StorageCounter(device)
    params = list(actor.parameters())
    held = {
        "actor.trained": counter.count(p for p in params if p.requires_grad),
        "actor.frozen": counter.count(p for p in params if not p.requires_grad),
        "actor.gradients": gradient_bytes(params, device),
        "actor.optimizer": counter.count(optimizer_tensors(optimizer)),
    }
    if reference is not None and reference is not actor:
        held["reference"] = counter.count(reference.parameters())
    if critic is not None:
        model, critic_optimizer = critic
        held["critic"] = counter.count(model.parameters()) + gradient_bytes(model.parameters(), device)
        held["critic"] += counter.count(optimizer_tensors(critic_optimizer))
    return {f"memory_gib/held/{name}": value / GIB for name, value in held.items()}


def memory_line(metrics: dict[str, float]) -> str | None:
    """One console line from a step's metrics: what is held, then each phase's peak; None
    without phase peaks (not a CUDA run)."""
    held = {k.removeprefix("memory_gib/held/"): v for k, v in metrics.items() if k.startswith("memory_gib/held/")}
    peaks = {
        k.removeprefix("memory_gib/"): v
        for k, v in metrics.items()
        if k.startswith("memory_gib/") and not k.startswith("memory_gib/held/") and k != "memory_gib/step"
    }
    if not peaks:
        return None
    parts = ", ".join(f"{name} {gib:.1f}" for name, gib in held.items() if gib >= 0.05)
    top = ", ".join(f"{name} {gib:.1f}" for name, gib in sorted(peaks.items(), key=lambda kv: -kv[1])[:4])
    return f"memory (GiB): held: {parts}; phase peaks: {top} (the rest of a peak is activations and workspace)"
