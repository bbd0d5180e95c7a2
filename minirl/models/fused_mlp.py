"""SiLU·mul in the gate/up GEMM's epilogue, for the gradient-free forwards (model.fused_mlp).

A Llama-family MLP is down(silu(x Wgᵀ) · x Wuᵀ). Hugging Face writes both M×I GEMM outputs and
reads them back to multiply them; one Triton kernel (minirl/kernels/fused_mlp.py) writes only
silu(g)·u. It rounds as eager bf16 does, so it differs from the unfused forward only where the
GEMMs' float32 sums, taken in another order, round differently: on the 1.5B shape at M = 28,000
none did (dev/bench_mlp.py; docs/benchmarks-history.md). Gradient-free forwards only (log-prob
and value passes): the backward needs g and u, which the kernel never writes. So a checkpointed
forward and its recomputation must both run with gradients, as minirl's non-reentrant
checkpointing does; a reentrant one would recompute unfused what it first ran fused. The design
at length: docs/architecture.md.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from minirl.kernels.selfcheck import expect_close, self_check

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WARPS, STAGES = 128, 128, 64, 16, 8, 3


def fuse_mlps(model: torch.nn.Module, enabled: bool, key: str = "model.fused_mlp") -> int:
    """Give each of the model's MLPs the fused gradient-free forward when `enabled`; returns how
    many. Only MLPs built exactly like Hugging Face's SiLU-gated one (gate_proj, up_proj,
    down_proj without bias, act_fn SiLU) change. Where the kernel cannot run (kernel_problem)
    none does, and a warning names `key`, the config key that asked for it."""
    if not enabled:
        return 0
    problem = kernel_problem()
    if problem is not None:
        warnings.warn(f"{key} = true: {problem}, so the MLPs run unfused; set {key} = false to silence this")
        return 0
    mlps = [m for m in model.modules() if _is_silu_gated(m)]
    for mlp in mlps:
        mlp.forward = types.MethodType(_forward, mlp)
    return len(mlps)


def unfuse_mlps(model: torch.nn.Module) -> None:
    """Undo fuse_mlps: for a copy that runs another kind of forward (the hf engine's generate,
    whose decode steps are not what the kernel's tiles are for)."""
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) is _forward:
            del module.forward


@functools.cache
def kernel_problem() -> str | None:
    """Why the kernel cannot run on this machine's current CUDA device, or None when it can.
    Checked once (minirl.kernels.selfcheck) on a small input, a partial row tile included."""
    if not torch.cuda.is_available():
        return "there is no CUDA device"
    if torch.cuda.get_device_capability() < (9, 0):
        return "the GPU has no TMA (compute capability below 9.0)"
    device = torch.device("cuda", torch.cuda.current_device())
    return self_check(lambda: _check_kernel(device), device, failed="the kernel failed on this GPU")


def _check_kernel(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2 * BLOCK_K, generator=gen)
    wg, wu = (torch.randn(2 * BLOCK_N, 2 * BLOCK_K, generator=gen) * (2 * BLOCK_K) ** -0.5 for _ in range(2))
    x, wg, wu = (t.to(device, torch.bfloat16) for t in (x, wg, wu))
    with torch.no_grad():
        got = gate_up_silu(x, wg, wu).float()
        want = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)).float()
    # a rounding apart at most; a broken kernel is far off
    problem = "the kernel disagrees with the unfused computation on this GPU"
    expect_close([got], [want], rtol=2**-6, atol=1e-2, problem=problem)


def _is_silu_gated(mlp) -> bool:
    from transformers import activations

    projections = [_linear(getattr(mlp, name, None)) for name in ("gate_proj", "up_proj", "down_proj")]
    linear = all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projections)
    # ACT2FN["silu"] is transformers' own class since transformers 5, torch's before
    silu = (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU))
    return linear and isinstance(getattr(mlp, "act_fn", None), silu)


def _linear(projection):
    """The Linear a projection computes with: itself, or a LoRA layer's frozen base_layer."""
    return getattr(projection, "base_layer", projection)


def _adapting(projection) -> bool:
    """A peft adapter layer (LoRA) with its adapters on: its output is not x Wᵀ alone."""
    return not getattr(projection, "disable_adapters", True)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj, self.up_proj
    wg, wu = _linear(gate).weight, _linear(up).weight
    # LoRA on gate/up: the kernel computes silu(x Wgᵀ)·(x Wuᵀ) with the base weights, which is the
    # layer's output only with the adapters off (the reference pass); otherwise peft's forward runs
    if not (_adapting(gate) or _adapting(up)) and kernel_applies(x, wg, wu):
        h = torch.ops.minirl.gate_up_silu(x.reshape(-1, x.shape[-1]), wg, wu)
        return self.down_proj(h.view(*x.shape[:-1], wg.shape[0]))
    return type(self).forward(self, x)  # the module's own forward


def kernel_applies(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> bool:
    """No gradients; CUDA tensors that operands_fit the training tiling. Tensor properties and the
    grad mode only, so under model.compile_layers they become the compiled layer's guards (one
    graph with gradients, one without), and the kernel is a custom op the graph calls as it is."""
    return (
        not torch.is_grad_enabled()
        and all(t.is_cuda for t in (x, wg, wu))
        and operands_fit(x, wg, wu, BLOCK_N, BLOCK_K)
    )


def operands_fit(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, block_n: int, block_k: int) -> bool:
    """Contiguous bf16 tensors whose data start 16-byte aligned (TMA); at least one row; sizes
    the tiles (block_n output columns, block_k deep) divide. The native engine's decode MLPs ask
    the same of their tiling (plugins/engines/native/layers/activation.py)."""
    tensors = (x, wg, wu)
    return (
        all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
        and all(t.storage_offset() % 8 == 0 for t in tensors)
        and x.numel() > 0
        and wg.shape == wu.shape
        and x.shape[-1] == wg.shape[1]
        and wg.shape[1] % block_k == 0
        and wg.shape[0] % block_n == 0
    )


@torch.library.custom_op("minirl::gate_up_silu", mutates_args=())
def gate_up_silu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    """silu(x Wgᵀ) · (x Wuᵀ) for x [M, K], Wg and Wu [I, K], all bf16 on the GPU: [M, I]."""
    from minirl.kernels.fused_mlp import launch

    return launch(x, wg, wu, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WARPS, STAGES)


@gate_up_silu.register_fake
def _(x, wg, wu):
    return x.new_empty(x.shape[0], wg.shape[0])
