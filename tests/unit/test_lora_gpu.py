"""LoRA on CUDA (skipped without one): compiled decoder layers with LoRA layers inside give the
eager log-probs and adapter gradients, also with the adapters disabled (the reference); the fused
gate/up MLP runs on the base weights in the reference pass and gives the unfused base's
log-probs; the native engine on the GPU holds exactly the trainer's merged weights after a sync.
"""

from __future__ import annotations

import copy

import pytest
import torch

from minirl.config.load import load_config
from minirl.forward.packed import response_logprobs
from minirl.models import assembly, lora
from minirl.models.checksum import weights_checksum
from minirl.models.compile import compile_layers
from minirl.models.fused_mlp import fuse_mlps, kernel_problem
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
PROMPTS, RESPONSES = [[5, 6, 7, 8, 9], [9, 10, 3]], [[11, 12, 13], [14, 15, 16, 17, 18]]


def _models(dtype=torch.float32, preset="tiny", **shape):
    cfg = load_config(None, ["model.lora_rank=8", "model.lora_alpha=16"]).model
    base = random_model(preset_config(preset, **shape), CUDA, dtype, 5)
    model = lora.apply_lora(copy.deepcopy(base), cfg, preset)
    with torch.no_grad():
        gen = torch.Generator(device=CUDA).manual_seed(1)
        for name, p in model.named_parameters():
            if lora.is_adapter_param(name):
                p.add_(torch.randn(p.shape, generator=gen, device=CUDA, dtype=p.dtype) * 0.05)
    return base, model


def _logp(model, grad=False):
    with torch.set_grad_enabled(grad), torch.autocast("cuda", torch.bfloat16):
        return response_logprobs(model, PROMPTS, RESPONSES, 1.0, CUDA)[0]


def test_compiled_lora_layers_equal_eager_with_adapters_on_and_off():
    base, eager = _models()
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled, True) == 2
    for m in (eager, compiled):
        m.zero_grad()
        _logp(m, grad=True).sum().backward()
    torch.testing.assert_close(_logp(compiled), _logp(eager), atol=0.05, rtol=0)
    grads = {n: p.grad for n, p in eager.named_parameters() if p.requires_grad}
    for name, p in compiled.named_parameters():
        if p.requires_grad:
            scale = float(grads[name].abs().max()) or 1.0
            assert float((p.grad - grads[name]).abs().max()) <= 0.05 * scale, name
        else:
            assert p.grad is None, name
    with lora.adapters_disabled(compiled):
        off = _logp(compiled)
    torch.testing.assert_close(off, _logp(base), atol=0.05, rtol=0)


@pytest.mark.skipif(kernel_problem() is not None, reason="the fused MLP kernel does not run here")
def test_fused_mlp_runs_the_reference_pass_of_a_lora_model():
    """With the adapters off the fused kernel computes the base MLP (bf16 weights, shapes its tiles
    divide): the reference log-probs are the unfused base's to a bf16 rounding."""
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    base, model = _models(torch.bfloat16, **shape)
    assert fuse_mlps(model, True) == 2
    with lora.adapters_disabled(model):
        off = _logp(model)
    torch.testing.assert_close(off, _logp(base), atol=0.05, rtol=0)
    unfused = copy.deepcopy(model)
    from minirl.models.fused_mlp import unfuse_mlps

    unfuse_mlps(unfused)
    torch.testing.assert_close(_logp(model), _logp(unfused), atol=0, rtol=0)  # adapters on: peft's forward


def test_native_engine_on_cuda_holds_the_merged_adapters_after_a_sync():
    from minirl_plugins.engines.native import build_native_engine
    from tests.tiny_models import engine_context

    _, model = _models()
    engine = build_native_engine(None, engine_context(model.config, actor=model, device="cuda", dtype=torch.bfloat16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter_param(name):
                p.mul_(1.5)
    engine.load_weights(assembly.full_weights(model, adapted_only=True))
    assert engine.checksum(torch.bfloat16) == weights_checksum(assembly.full_weights(model), torch.bfloat16)


def test_frozen_base_in_bf16_gives_the_float32_bases_log_probs_and_gradients():
    """What LoRAFineTuning.assemble does on CUDA: the frozen Linears stored in bf16 multiply as
    autocast multiplies float32 ones, bit for bit, forward and adapter gradients."""
    _, model = _models()
    held = copy.deepcopy(model)
    assert lora.hold_frozen_in(held, torch.bfloat16) > 0
    results = []
    for m in (model, held):
        m.zero_grad()
        logp = _logp(m, grad=True)
        logp.sum().backward()
        results.append((logp.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want)
    assert all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
