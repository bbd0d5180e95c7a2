"""The AdamW plugin (minirl_plugins.algorithms.optim): torch's fused kernel on the CPU as on CUDA, its step
equal to a float64 AdamW written out here; and the warm-up/cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch

from minirl.config.load import load_config
from minirl_plugins.algorithms.optim import build_adamw, lr_factor


def _adamw_float64(p, grads, lr, betas, eps, wd):
    """Decoupled weight decay, bias-corrected moments (Loshchilov & Hutter), in float64."""
    p = p.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def test_cpu_adamw_is_fused_and_equals_the_float64_formula():
    cfg = load_config(None, ["actor.optim.lr=0.01", "actor.optim.weight_decay=0.1"]).actor.optim
    model = torch.nn.Linear(64, 32)
    start = model.weight.detach().clone()
    optimizer, _ = build_adamw(model, cfg, total_steps=10)
    assert optimizer.defaults["fused"] is True
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(model.weight.shape, generator=g) * 10 ** (-k) for k in range(3)]
    for grad in grads:
        model.weight.grad, model.bias.grad = grad.clone(), torch.zeros_like(model.bias)
        optimizer.step()
    want = _adamw_float64(start, grads, 0.01, cfg.betas, cfg.eps, 0.1)
    assert float((model.weight.detach().double() - want).abs().max()) < 1e-6
    assert float((model.weight.detach().double() - start.double()).abs().max()) > 1e-3  # it moved


@pytest.mark.parametrize("style", ["constant", "cosine"])
def test_warmup_then_schedule(style):
    total, warmup = 10, 4
    factors = [lr_factor(s, warmup, total, style, 0.1) for s in range(total + 1)]
    assert factors[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    if style == "constant":
        assert factors[warmup:] == [1.0] * (total + 1 - warmup)
    else:
        want = [
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
            for s in range(warmup, total + 1)
        ]
        assert factors[warmup:] == pytest.approx(want)
