"""Host-to-device copies that do not stop the host.

`torch.tensor(values, device="cuda")` and `cpu_tensor.to("cuda")` copy from pageable memory, and
torch follows such a copy with a stream synchronisation: the host waits for every queued kernel
before it can build the next micro-batch, and the device idles while it does (about 6 ms a
micro-batch of the log-prob pass; docs/benchmarks.md). Staged in pinned memory the copy instead
queues behind the kernels; torch's pinned-memory cache keeps the staging buffer until it has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """t on `device`; a CPU tensor bound for CUDA goes through pinned memory, without a sync."""
    if device is None:
        return t
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_to(values, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`, copied as to_device does."""
    return to_device(torch.tensor(values, dtype=dtype), device)
