"""Per-generate sampling state: the parameters, the seed, and which kernel samples."""

from __future__ import annotations

import torch

from minirl.protocols import SamplingParams
from minirl_plugins.engines.native.layers.sampling import sample, sample_params


class SamplerState:
    """Samples one token per logits row on the device, reproducibly from `seed`.

    Plain temperature sampling goes to the fused sampler (`fused`, a Triton kernel) when there is
    one: it reads its parameters and seed from the device buffers `buffers`, so it runs inside the
    decode step's CUDA graph. Top-k/top-p (which need a sort) and CPU runs use the torch sampler
    with a seeded generator, outside the graph.
    """

    def __init__(self, params: SamplingParams, seed: int, device: torch.device, fused, buffers):
        self.temperature, self.top_k, self.top_p = params.temperature, params.top_k, params.top_p
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.fused = None if self.top_k > 0 or self.top_p < 1.0 else fused
        self.params, self.seed = buffers
        if self.fused is not None:
            self.params.copy_(sample_params(self.temperature, "cpu"))
            self.seed.copy_(torch.tensor([seed, 0], dtype=torch.int64))

    def sample(self, logits_MV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_M int64, logprobs_M float32) of one step, outside any graph."""
        if self.fused is not None:
            return self.fused(logits_MV, self.params, self.seed)
        return sample(logits_MV, self.temperature, self.top_k, self.top_p, self.generator)
