"""minirl's native rollout engine, registered as rollout engine `native`.

Pure PyTorch with Triton kernels on GPU: a paged KV cache sized from a memory fraction, continuous
batching, one varlen prefill shared by a prompt's n samples, CUDA-graph decode, device-side
sampling with log-probs, in-place weight loads. Laid out after nano-vllm: engine/ (sequence,
block_manager, scheduler, model_runner, engine), layers/ (one module per op, its torch
reference beside its Triton kernel; ops chooses), models/ (spec, decoder), weights (loads by
Hugging Face name, weights_checksum).
"""

from __future__ import annotations

from minirl import hookimpl
from minirl.protocols import EngineContext


def build_native_engine(rollout_cfg, ctx: EngineContext):
    """factory(rollout_cfg, ctx) -> NativeEngine; see config.py for what it reads."""
    from minirl_plugins.engines.native.config import EngineConfig
    from minirl_plugins.engines.native.engine.engine import NativeEngine

    return NativeEngine(EngineConfig.resolve(rollout_cfg, ctx), ctx)


@hookimpl
def minirl_rollout_engines():
    return {"native": build_native_engine}
