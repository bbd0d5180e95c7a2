"""Picks the implementation of each op: a fast one on CUDA when it passes its self-check, else torch.

On CUDA each fast implementation first runs next to its torch reference on small random inputs
(minirl.kernels.selfcheck); one that fails to build or disagrees is skipped with a warning, so a
broken kernel costs speed, never correctness. Elsewhere the references run.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from minirl.kernels.selfcheck import self_check
from minirl.models.varlen import FLASH_DTYPES
from minirl_plugins.engines.native.layers import (
    activation,
    attention,
    fp8_linear,
    jit,
    norm,
    paged_attention,
    rotary,
    sampling,
)


@dataclass
class Ops:
    rmsnorm: Callable = norm.rmsnorm
    add_rmsnorm: Callable = norm.add_rmsnorm
    silu_mul: Callable = activation.silu_mul
    # (x, gate_up weight) -> silu(x W_gateᵀ)·(x W_upᵀ) in one kernel, for operands
    # activation.gate_up_silu_fits; None: the GEMM, then silu_mul
    gate_up_silu: Callable | None = None
    rope_store: Callable = rotary.rope_store
    prefill_attention: Callable = attention.prefill_attention
    extend_attention: Callable = attention.extend_attention
    decode_attention: Callable = paged_attention.decode_attention
    fast_sample: Callable | None = None  # (logits, params, seed) -> (tokens, logprobs); sampling.fast_sample
    # rollout.quantization = "fp8": the GEMM on e4m3 weights and activations, the ops that quantize
    # the activations by rows and apply the row scales to its output (fp8_linear; rope_store
    # applies those of qkv)
    scaled_mm: Callable = fp8_linear.scaled_mm_ref
    rmsnorm_rows: Callable = norm.rmsnorm_rows
    silu_mul_rows: Callable = activation.silu_mul_rows
    quantize_rows: Callable = fp8_linear.quantize_rows
    quantize_into: Callable = fp8_linear.quantize_into  # the weights' e4m3 copies, at every load
    chosen: dict = field(default_factory=dict)  # op -> "triton" | "triton_fp8_pairs" | ..., where not the reference

    @property
    def graphable(self) -> bool:
        """The torch decode attention reads the longest context on the host: no CUDA graphs."""
        return self.decode_attention is not paged_attention.decode_attention


# op -> (its Triton implementation, the check that compares it with the torch reference)
TRITON = {
    "rmsnorm": (norm.rmsnorm_triton, norm.check_rmsnorm),
    "add_rmsnorm": (norm.add_rmsnorm_triton, norm.check_add_rmsnorm),
    "silu_mul": (activation.silu_mul_triton, activation.check_silu_mul),
    "rope_store": (rotary.rope_store_triton, rotary.check_rope_store),
    "decode_attention": (paged_attention.decode_attention_triton, paged_attention.check_decode_attention),
    "fast_sample": (sampling.fast_sample, sampling.check_fast_sample),
}
# prefill attention has no Triton kernel: torch's varlen flash attention is its fast path, and
# the flash kernel's that of extend attention
VARLEN_PREFILL = (attention.prefill_attention_varlen, attention.check_prefill_attention)
FLASH_EXTEND = (attention.extend_attention_flash, attention.check_extend_attention)
# an 8-bit cache under a half-precision engine: decode attention reading it as 16-bit pairs, first
# choice (1.5x the dequantizing kernel at 64 rows x 27,700 keys on the H200, docs/benchmarks.md)
FP8_PAIRS_DECODE = (paged_attention.decode_attention_fp8_pairs, paged_attention.check_decode_attention_fp8_pairs)
# rollout.quantization = "fp8": the fp8 tensor cores' GEMM (cuBLASLt), and the Triton kernels
# around it
FP8_GEMM = (fp8_linear.scaled_mm_cuda, fp8_linear.check_scaled_mm)
# a bf16 engine on compute capability 9.0 (TMA): SiLU·mul in the gate/up GEMM's epilogue
GATE_UP_SILU = (activation.gate_up_silu_triton, activation.check_gate_up_silu)
FP8_TRITON = {
    "rmsnorm_rows": (norm.rmsnorm_rows_triton, norm.check_rmsnorm_rows),
    "silu_mul_rows": (activation.silu_mul_rows_triton, activation.check_silu_mul_rows),
    "quantize_rows": (fp8_linear.quantize_rows_triton, fp8_linear.check_quantize_rows),
    "quantize_into": (fp8_linear.quantize_into_triton, fp8_linear.check_quantize_into),
}


def select_ops(
    device: torch.device,
    dtype: torch.dtype,
    use_triton: bool = True,
    kv_dtype: torch.dtype | None = None,
    quantization: str = "none",
) -> Ops:
    """kv_dtype: the KV cache's (rollout.kv_cache_dtype), when it is not `dtype`; quantization:
    rollout.quantization ("fp8" adds the fp8 GEMM and the Triton kernels around it; without the
    GEMM, which needs compute capability 8.9, ops.chosen lacks "scaled_mm" and the engine does not
    quantize)."""
    ops = Ops()
    if device.type != "cuda":
        return ops
    # a float32 engine has no fast prefill: the flash kernel takes half precision only
    candidates = []
    if dtype in FLASH_DTYPES:
        candidates += [
            ("prefill_attention", *VARLEN_PREFILL, "torch_varlen"),
            ("extend_attention", *FLASH_EXTEND, "flash"),
        ]
    if quantization == "fp8":
        candidates.append(("scaled_mm", *FP8_GEMM, "cublaslt"))
    if use_triton and jit.UNAVAILABLE:
        warnings.warn(f"native engine: Triton unavailable ({jit.UNAVAILABLE}); using pure-torch kernels")
    elif use_triton:
        if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and dtype in (torch.bfloat16, torch.float16):
            candidates.append(("decode_attention", *FP8_PAIRS_DECODE, "triton_fp8_pairs"))
        candidates += [(name, fn, check, "triton") for name, (fn, check) in TRITON.items()]
        if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0):
            candidates.append(("gate_up_silu", *GATE_UP_SILU, "triton"))
        if quantization == "fp8":
            candidates += [(name, fn, check, "triton") for name, (fn, check) in FP8_TRITON.items()]
    for i, (name, fn, check, label) in enumerate(candidates):
        if name in ops.chosen:  # a first choice passed
            continue
        run = functools.partial(check, fn, device, dtype, kv_dtype or dtype)
        problem = self_check(run, device, failed="rejected")
        if problem is not None:
            later = any(other == name for other, *_ in candidates[i + 1 :])
            instead = "the next kernel" if later else "the torch reference"
            warnings.warn(f"native engine: {name} kernel {label} {problem}; using {instead}")
            continue
        setattr(ops, name, fn)
        ops.chosen[name] = label
    return ops
