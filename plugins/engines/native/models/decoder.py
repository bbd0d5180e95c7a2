"""One decoder for Qwen2, Llama 3 and Qwen3, with parameter names identical to transformers'.

q/k/v and gate/up are each one fused weight (one GEMM), exposed as `q_proj.weight`, `k_proj.weight`,
... Parameters that are row views of it: load_weights copies by Hugging Face name straight into
the fused storage, in place, so CUDA graphs captured over it stay valid. Never call `.to()` on
this model: build it where and in the dtype it will run.

Shape legend: N tokens, E hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minirl_plugins.engines.native.layers.meta import StepMeta
from minirl_plugins.engines.native.layers.ops import Ops
from minirl_plugins.engines.native.models.spec import ModelSpec


class Proj(nn.Module):
    """Holds `weight` (and `bias`) under Hugging Face names; views into a fused tensor when given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class Norm(nn.Module):
    def __init__(self, size: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)


def _fused(rows: list[int], cols: int, dtype, bias: bool):
    """A fused [sum(rows), cols] weight (and bias) and Proj views of its row blocks."""
    weight = torch.empty(sum(rows), cols, dtype=dtype)
    b = torch.zeros(sum(rows), dtype=dtype) if bias else None
    views, start = [], 0
    for r in rows:
        views.append(Proj(weight[start : start + r], None if b is None else b[start : start + r]))
        start += r
    return weight, b, views


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, ops: Ops, dtype):
        super().__init__()
        self.spec, self.layer, self.ops = spec, layer, ops
        rows = [spec.q_size, spec.kv_size, spec.kv_size]
        self.qkv_weight, self.qkv_bias, (self.q_proj, self.k_proj, self.v_proj) = _fused(
            rows, spec.hidden_size, dtype, spec.qkv_bias
        )
        o_bias = torch.zeros(spec.hidden_size, dtype=dtype) if spec.o_bias else None
        self.o_proj = Proj(torch.empty(spec.hidden_size, spec.q_size, dtype=dtype), o_bias)
        if spec.qk_norm:
            self.q_norm, self.k_norm = Norm(spec.head_dim, dtype), Norm(spec.head_dim, dtype)
        self.scale = spec.head_dim**-0.5

    def forward(self, x_NE, positions_N, meta: StepMeta, rope: tuple[torch.Tensor, torch.Tensor]):
        s, ops, heads = self.spec, self.ops, self.spec.heads
        qkv = F.linear(x_NE, self.qkv_weight, self.qkv_bias)
        k_cache, v_cache = meta.kv_cache[0, self.layer], meta.kv_cache[1, self.layer]
        norms = (self.q_norm.weight, self.k_norm.weight) if s.qk_norm else (None, None)
        ops.rope_store(qkv, positions_N, *rope, meta.slot_mapping_N, k_cache, v_cache, heads, *norms, s.rms_norm_eps)
        if meta.ctx_slots_M is not None:
            o = ops.extend_attention(qkv, k_cache, v_cache, meta, heads, self.scale)
        elif meta.is_prefill:
            o = ops.prefill_attention(qkv, meta, heads, self.scale)
        else:
            o = ops.decode_attention(qkv, k_cache, v_cache, meta, heads, self.scale)
        return F.linear(o, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: Ops, dtype):
        super().__init__()
        self.ops = ops
        i, e = spec.intermediate_size, spec.hidden_size
        self.gate_up_weight, self.gate_up_bias, (self.gate_proj, self.up_proj) = _fused([i, i], e, dtype, spec.mlp_bias)
        self.down_proj = Proj(torch.empty(e, i, dtype=dtype), torch.zeros(e, dtype=dtype) if spec.mlp_bias else None)

    def forward(self, x_NE):
        h = self.ops.silu_mul(F.linear(x_NE, self.gate_up_weight, self.gate_up_bias))
        return F.linear(h, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, ops: Ops, dtype):
        super().__init__()
        self.ops, self.eps = ops, spec.rms_norm_eps
        self.self_attn = Attention(spec, layer, ops, dtype)
        self.mlp = MLP(spec, ops, dtype)
        self.input_layernorm = Norm(spec.hidden_size, dtype)
        self.post_attention_layernorm = Norm(spec.hidden_size, dtype)

    def forward(self, x_NE, residual_NE, positions_N, meta, rope):
        if residual_NE is None:
            residual_NE, h = x_NE, self.ops.rmsnorm(x_NE, self.input_layernorm.weight, self.eps)
        else:
            h, residual_NE = self.ops.add_rmsnorm(x_NE, residual_NE, self.input_layernorm.weight, self.eps)
        h = self.self_attn(h, positions_N, meta, rope)
        h, residual_NE = self.ops.add_rmsnorm(h, residual_NE, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(h), residual_NE


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, ops: Ops, dtype):
        super().__init__()
        self.ops, self.eps = ops, spec.rms_norm_eps
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, ops, dtype) for i in range(spec.num_layers))
        self.norm = Norm(spec.hidden_size, dtype)

    def forward(self, ids_N, positions_N, meta, rope):
        x, residual = self.embed_tokens(ids_N), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions_N, meta, rope)
        return self.ops.add_rmsnorm(x, residual, self.norm.weight, self.eps)[0]


class DecoderLM(nn.Module):
    """Causal LM: `model.*` backbone and `lm_head`, named as transformers names them."""

    def __init__(self, spec: ModelSpec, ops: Ops, dtype):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, ops, dtype)
        if spec.tie_word_embeddings:
            self.lm_head = Proj(self.model.embed_tokens.weight)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Proj(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype))

    def forward(self, ids_N, positions_N, meta: StepMeta, rope) -> torch.Tensor:
        """Final hidden states h_NE (after the last norm)."""
        return self.model(ids_N, positions_N, meta, rope)

    def compute_logits(self, h_ME: torch.Tensor) -> torch.Tensor:
        return F.linear(h_ME, self.lm_head.weight)
