"""One decoder for Qwen2, Llama 3 and Qwen3, with parameter names identical to transformers'.

q/k/v and gate/up are each one fused weight (one GEMM), exposed as `q_proj.weight`, `k_proj.weight`,
... Parameters that are row views of it: load_weights copies by Hugging Face name straight into
the fused storage, in place, so CUDA graphs captured over it stay valid. Never call `.to()` on
this model: build it where and in the dtype it will run.

With rollout.quantization = "fp8" (DecoderLM.quantize_fp8) the layers run their forward_fp8:
the same ops in the same order, the four GEMMs on e4m3 copies, the activations passed on as e4m3
rows with their scales, or as a GEMM's output before its rows' scales (layers/fp8_linear.py).

Shape legend: N tokens, E hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minirl_plugins.engines.native.layers.activation import gate_up_silu_fits
from minirl_plugins.engines.native.layers.fp8_linear import Fp8Weight, quantizable
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
        self.qkv_fp8 = self.o_fp8 = None  # Fp8Weight, with rollout.quantization = "fp8"

    def forward(self, x_NE, positions_N, meta: StepMeta, rope: tuple[torch.Tensor, torch.Tensor]):
        qkv = F.linear(x_NE, self.qkv_weight, self.qkv_bias)
        o = self.attend(qkv, positions_N, meta, rope)
        return F.linear(o, self.o_proj.weight, self.o_proj.bias)

    def forward_fp8(self, xq_NE, xs_N1, positions_N, meta: StepMeta, rope):
        """From the input's e4m3 rows and scales to o_proj's output before its row scales, and
        those scales (rollout.quantization = "fp8"; fp8_linear)."""
        ops, dtype = self.ops, self.o_proj.weight.dtype
        qkv = self.qkv_fp8.matmul(xq_NE, ops, dtype)
        oq, os_ = ops.quantize_rows(self.attend(qkv, positions_N, meta, rope, (xs_N1, self.qkv_bias)))
        return self.o_fp8.matmul(oq, ops, dtype), os_

    def attend(self, qkv, positions_N, meta: StepMeta, rope, rows=None):
        """Rotary and the KV cache's write, then attention: [N, H·D]. rows = (row scales, qkv
        bias): qkv is the fp8 GEMM's output before its rows' scales, which rope_store applies first."""
        s, ops, heads = self.spec, self.ops, self.spec.heads
        k_cache, v_cache = meta.kv_cache[0, self.layer], meta.kv_cache[1, self.layer]
        norms = (self.q_norm.weight, self.k_norm.weight) if s.qk_norm else (None, None)
        slots, eps = meta.slot_mapping_N, s.rms_norm_eps
        ops.rope_store(qkv, positions_N, *rope, slots, k_cache, v_cache, heads, *norms, eps, rows)
        if meta.ctx_slots_M is not None:
            return ops.extend_attention(qkv, k_cache, v_cache, meta, heads, self.scale)
        if meta.is_prefill:
            return ops.prefill_attention(qkv, meta, heads, self.scale)
        return ops.decode_attention(qkv, k_cache, v_cache, meta, heads, self.scale)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: Ops, dtype):
        super().__init__()
        self.ops = ops
        i, e = spec.intermediate_size, spec.hidden_size
        self.gate_up_weight, self.gate_up_bias, (self.gate_proj, self.up_proj) = _fused([i, i], e, dtype, spec.mlp_bias)
        self.down_proj = Proj(torch.empty(e, i, dtype=dtype), torch.zeros(e, dtype=dtype) if spec.mlp_bias else None)
        self.gate_up_fp8 = self.down_fp8 = None  # Fp8Weight, with rollout.quantization = "fp8"

    def forward(self, x_NE):
        ops, w, b = self.ops, self.gate_up_weight, self.gate_up_bias
        if ops.gate_up_silu is not None and gate_up_silu_fits(x_NE, w, b):
            h = ops.gate_up_silu(x_NE, w)
        else:
            h = ops.silu_mul(F.linear(x_NE, w, b))
        return F.linear(h, self.down_proj.weight, self.down_proj.bias)

    def forward_fp8(self, xq_NE, xs_N1):
        """e4m3 rows and scales in; down's output before its row scales, and those scales, out."""
        ops, dtype = self.ops, self.down_proj.weight.dtype
        hq, hs = ops.silu_mul_rows(self.gate_up_fp8.matmul(xq_NE, ops, dtype), xs_N1)
        return self.down_fp8.matmul(hq, ops, dtype), hs


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

    def forward_fp8(self, x_NE, xs_N1, residual_NE, positions_N, meta, rope):
        """forward with fp8 GEMMs: x is the previous layer's down output before its row scales
        xs (the embeddings, and xs None, in the first layer); returns this layer's, and the
        residual stream."""
        ops = self.ops
        (hq, hs), residual_NE = ops.rmsnorm_rows(x_NE, self.input_layernorm.weight, self.eps, residual_NE, xs_N1, True)
        o, os_ = self.self_attn.forward_fp8(hq, hs, positions_N, meta, rope)
        (hq, hs), residual_NE = ops.rmsnorm_rows(
            o, self.post_attention_layernorm.weight, self.eps, residual_NE, os_, True
        )
        return (*self.mlp.forward_fp8(hq, hs), residual_NE)


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, ops: Ops, dtype):
        super().__init__()
        self.ops, self.eps = ops, spec.rms_norm_eps
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, ops, dtype) for i in range(spec.num_layers))
        self.norm = Norm(spec.hidden_size, dtype)

    @property
    def fp8(self) -> bool:
        """Every layer's GEMMs on e4m3 copies (DecoderLM.quantize_fp8)."""
        return self.layers[0].self_attn.qkv_fp8 is not None

    def forward(self, ids_N, positions_N, meta, rope):
        x, residual = self.embed_tokens(ids_N), None
        if self.fp8:
            return self._forward_fp8(x, positions_N, meta, rope)
        for layer in self.layers:
            x, residual = layer(x, residual, positions_N, meta, rope)
        return self.ops.add_rmsnorm(x, residual, self.norm.weight, self.eps)[0]

    def _forward_fp8(self, x, positions_N, meta, rope):
        scale = residual = None
        for layer in self.layers:
            x, scale, residual = layer.forward_fp8(x, scale, residual, positions_N, meta, rope)
        return self.ops.rmsnorm_rows(x, self.norm.weight, self.eps, residual, scale)[0]


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

    def fp8_unsupported(self) -> str | None:
        """Why quantize_fp8 cannot apply to this model, or None."""
        if self.spec.o_bias or self.spec.mlp_bias:
            return "the model has o_proj or MLP biases (the fp8 path adds only the qkv bias)"
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        weights = (attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight)
        if not all(quantizable(w) for w in weights):
            return f"the fp8 GEMM needs dimensions in multiples of 16 (here: {[tuple(w.shape) for w in weights]})"
        return None

    def quantize_fp8(self) -> int:
        """Give every layer's qkv, o, gate/up and down matrix an e4m3 copy (fp8_linear) that the
        forward multiplies with; returns how many. refresh_fp8() fills them."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_fp8, attn.o_fp8 = Fp8Weight(attn.qkv_weight), Fp8Weight(attn.o_proj.weight)
            mlp.gate_up_fp8, mlp.down_fp8 = Fp8Weight(mlp.gate_up_weight), Fp8Weight(mlp.down_proj.weight)
        return 4 * len(self.model.layers)

    def refresh_fp8(self) -> None:
        """Rewrite the e4m3 copies from the weights, in place (after every load)."""
        for module in self.modules():
            if isinstance(module, Fp8Weight):
                module.refresh(self.model.ops.quantize_into)
