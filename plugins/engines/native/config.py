"""The engine's own settings, resolved from the `rollout` config section and EngineContext.extra.

From `rollout`: gpu_memory_utilization (share of free device memory for the KV cache),
kv_cache_dtype, quantization, max_num_seqs, enforce_eager. From ctx.extra (optional): max_model_len, max_batch_rows
(the sequences one generate call asks for: the trainer's prompts per rank x n; the KV cache holds no
more than they can fill), max_num_batched_tokens, page_size, num_kv_pages (fixes the cache size;
tests use it), cpu_kv_cache_bytes, max_graph_batch, use_triton, decode_steps, path (a local
checkpoint), seed (of random weights).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

ROLLOUT_KEYS = ("max_num_seqs", "gpu_memory_utilization", "enforce_eager", "quantization")  # and kv_cache_dtype
# the rest: ctx.extra

# rollout.kv_cache_dtype: "auto" keeps the engine's dtype; fp8 stores keys and values with scale 1,
# clamped to the format's largest finite value
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 1024
    max_model_len: int = 32768
    max_batch_rows: int = 0  # 0: unknown, plan for max_num_seqs rows
    max_num_batched_tokens: int = 16384
    page_size: int = 16
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False
    num_kv_pages: int = 0  # 0: size from memory
    cpu_kv_cache_bytes: int = 64 << 20
    max_graph_batch: int = 512
    use_triton: bool = True
    decode_steps: int = 1  # decode steps per host round trip (8 on CUDA by default)
    quantization: str = "none"  # "fp8": e4m3 weights and activations in the layers' GEMMs (fp8_linear)
    kv_cache_dtype: torch.dtype | None = None  # None: the engine's dtype

    @classmethod
    def resolve(cls, rollout_cfg, ctx) -> "EngineConfig":
        """Each field from rollout_cfg (ROLLOUT_KEYS; None: defaults) or ctx.extra, as its default's type."""
        extra = dict(ctx.extra or {})
        max_pos = getattr(ctx.model_config, "max_position_embeddings", 32768)
        on_cuda = str(ctx.device).startswith("cuda")
        defaults = {"max_model_len": min(max_pos, 32768), "decode_steps": 8 if on_cuda else 1}
        values = {}
        for f in dataclasses.fields(cls):
            if f.name == "kv_cache_dtype":  # a name to look up, below
                continue
            default = defaults.get(f.name, f.default)
            value = getattr(rollout_cfg, f.name, default) if f.name in ROLLOUT_KEYS else extra.get(f.name, default)
            values[f.name] = type(f.default)(value)
        kv_dtype = KV_CACHE_DTYPES[getattr(rollout_cfg, "kv_cache_dtype", "auto")]  # checked up front (minirl.validate)
        cfg = cls(**values, kv_cache_dtype=kv_dtype)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        # the rollout keys are validated up front (minirl.validate); ctx.extra comes from code
        assert 0.0 < self.gpu_memory_utilization <= 1.0 and self.max_num_seqs >= 1, self
        assert self.max_batch_rows >= 0 and self.page_size >= 1 and self.decode_steps >= 1, self
        assert self.max_model_len >= 1 and self.max_num_batched_tokens >= 1, self
