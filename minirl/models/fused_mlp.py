"""SiLU·mul in the gate/up GEMM's epilogue, for the gradient-free forwards (model.fused_mlp).

A Llama-family MLP is down(silu(x Wgᵀ) · x Wuᵀ). Hugging Face runs it as two cuBLAS GEMMs, each
writing an M×I bf16 tensor, and one element-wise kernel (fused by model.compile_layers) that reads
both back and writes their product: 3·M·I·2 bytes that exist only to be read once. Here one Triton
kernel multiplies a row tile of x by the same column tile of Wg and of Wu (two float32
accumulators sharing the x tile, loaded by TMA) and writes only silu(g)·u.

Bits: the epilogue rounds as eager bf16 does (g and u to bf16, silu in float32 to bf16, the
product in float32 to bf16), so it differs from the unfused forward only where the two GEMMs'
float32 sums, taken in another order, round to different bf16 values. On the 1.5B shape at
M = 28,000 none did (scripts/bench_mlp.py; docs/benchmarks.md).

Scope: gradient-free forwards only (log-prob and value passes). With gradients, the backward needs
g and u, which this kernel never writes, so the update keeps Hugging Face's MLP. Used when x and
both weights are contiguous bf16 on a CUDA device with TMA (compute capability 9.0+, checked once
when the forwards are installed), the hidden size is a multiple of BLOCK_K and the intermediate
size of BLOCK_N; anything else runs the MLP as Hugging Face writes it. The checks are on tensor
properties only, so under model.compile_layers they become guards of the compiled layer (one
graph with gradients, one without), and the kernel is a custom op the graph calls as it is.
"""

from __future__ import annotations

import types
import warnings

import torch

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WARPS, STAGES = 128, 128, 64, 16, 8, 3
_OP = "minirl::gate_up_silu"


def fuse_mlps(model: torch.nn.Module, enabled: bool) -> int:
    """Give each of the model's MLPs the fused gradient-free forward when `enabled`; returns how
    many. Only MLPs built exactly like Hugging Face's SiLU-gated one (gate_proj, up_proj,
    down_proj without bias, act_fn SiLU) change; on a machine without the kernel none does, and
    a warning says so."""
    if not enabled:
        return 0
    if not kernel_available():
        warnings.warn(
            "model.fused_mlp = true: no CUDA device with TMA (compute capability 9.0+) and triton "
            "here, so the MLPs run unfused; set model.fused_mlp = false to silence this",
            stacklevel=2,
        )
        return 0
    mlps = [m for m in model.modules() if _is_silu_gated(m)]
    for mlp in mlps:
        mlp.forward = types.MethodType(_forward, mlp)
    return len(mlps)


def kernel_available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    try:
        import triton.tools.tensor_descriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _is_silu_gated(mlp) -> bool:
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    linear = all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projections)
    return linear and isinstance(getattr(mlp, "act_fn", None), _silu_classes())


def _silu_classes() -> tuple[type, ...]:
    """torch's SiLU and transformers' (ACT2FN["silu"] is its own class since transformers 5)."""
    from transformers import activations

    return tuple(c for c in (torch.nn.SiLU, getattr(activations, "SiLUActivation", None)) if c is not None)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    wg, wu = self.gate_proj.weight, self.up_proj.weight
    if kernel_applies(x, wg, wu):
        h = torch.ops.minirl.gate_up_silu(x.reshape(-1, x.shape[-1]), wg, wu)
        return self.down_proj(h.view(*x.shape[:-1], wg.shape[0]))
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def kernel_applies(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> bool:
    tensors = (x, wg, wu)
    return (
        not torch.is_grad_enabled()
        and all(t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
        and wg.shape == wu.shape
        and x.shape[-1] == wg.shape[1]
        and wg.shape[1] % BLOCK_K == 0
        and wg.shape[0] % BLOCK_N == 0
    )


@torch.library.custom_op(_OP, mutates_args=())
def gate_up_silu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    """silu(x Wgᵀ) · (x Wuᵀ) for x [M, K], Wg and Wu [I, K], all bf16 on the GPU: [M, I]."""
    from minirl.models.fused_mlp_triton import launch

    return launch(x, wg, wu, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WARPS, STAGES)


@gate_up_silu.register_fake
def _(x, wg, wu):
    return x.new_empty(x.shape[0], wg.shape[0])
