"""model.fused_mlp (minirl/models/fused_mlp.py): the gate/up GEMM with SiLU·mul in its epilogue.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py), on float32 inputs
whose values are bf16's: the interpreter multiplies bf16 tiles in half precision and converts
float32 to bf16 by truncation, so there the reference rounds by truncation too. On the GPU
(`gpu` marker) the kernel is checked against the unfused bf16 computation bit for bit, alone and
inside a compiled model's gradient-free pass.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.models import fused_mlp
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """To bf16 as the device under test rounds: the interpreter truncates the low 16 bits."""
    if INTERPRETED and t.device.type == "cpu":
        return (t.float().view(torch.int32) & -65536).view(torch.float32)
    return t.to(torch.bfloat16).float()


def reference(x, wg, wu):
    """silu(x Wgᵀ)·(x Wuᵀ) with eager bf16's roundings, products summed in float32."""
    g, u = _bf16(x.float() @ wg.float().T), _bf16(x.float() @ wu.float().T)
    return _bf16(_bf16(g / (1 + torch.exp(-g))) * u)


def inputs(m, k, n, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    wg, wu = ((torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for _ in range(2))
    return tuple(t.to(device=device, dtype=dtype) for t in (x, wg, wu))


def assert_matches(out, ref, max_differing=0.01):
    """Nearly all equal, and all within four bf16 steps (2⁻⁵ relative) of the reference: only the
    order of the float32 sums differs, which moves a rounding of g or u by a step now and then;
    SiLU and the product carry that step into the result, which is rounded once more, so an
    element can land two steps away (seen: -0.46875 against -0.47265625, m = 15, seed 67, under
    the interpreter's truncation) and, by count, up to about three. Where a sum nearly cancels,
    more than that of a tiny value: hence the 1e-5 floor. A wrong tile or mask is far off, and
    in many elements."""
    out, ref = out.float(), ref.float()
    assert bool(((out - ref).abs() <= ref.abs() * 2**-5 + 1e-5).all()), (out - ref).abs().max()
    assert (out != ref).float().mean().item() <= max_differing


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 80), k_blocks=st.integers(1, 3), n_tiles=st.integers(1, 2), seed=st.integers(0, 99))
def test_kernel_under_the_interpreter(m, k_blocks, n_tiles, seed):
    from minirl.kernels.fused_mlp import launch

    x, wg, wu = inputs(m, 32 * k_blocks, 64 * n_tiles, seed=seed)
    out = launch(x, wg, wu, bm=32, bn=64, bk=32, group_m=2, warps=4, stages=2)
    assert out.shape == (m, 64 * n_tiles)
    assert_matches(out, reference(x, wg, wu))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
def test_custom_op_registration():
    """The op's fake (meta) implementation agrees with the real one: what torch.compile traces."""
    torch.library.opcheck(torch.ops.minirl.gate_up_silu, inputs(5, 64, 128))


def _mlps(model):
    return [layer.mlp for layer in model.get_decoder().layers]


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "llama3-tiny"])
def test_fuse_mlps_installs_on_silu_gated_mlps_and_leaves_others(preset, monkeypatch):
    monkeypatch.setattr(fused_mlp, "kernel_problem", lambda: None)
    model = random_model(preset_config(preset), "cpu", torch.float32, seed=0)
    mlps = _mlps(model)
    mlps[0].act_fn = torch.nn.GELU()  # not SiLU-gated any more: keeps its forward
    assert fused_mlp.fuse_mlps(model, True) == len(mlps) - 1
    assert "forward" not in vars(mlps[0]) and all("forward" in vars(m) for m in mlps[1:])
    assert fused_mlp.fuse_mlps(model, False) == 0


def test_without_the_kernel_fuse_mlps_warns_naming_the_key_and_changes_nothing(monkeypatch):
    from minirl.config.load import load_config
    from minirl.models import assembly

    monkeypatch.setattr(fused_mlp, "kernel_problem", lambda: "there is no CUDA device")
    cfg = load_config(None, ["model.fused_mlp=true", "critic.model.fused_mlp=true"])
    for section, model_cfg in (("model", cfg.model), ("critic.model", cfg.critic.model)):
        model = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
        with pytest.warns(UserWarning, match=rf"^{section}\.fused_mlp = true: there is no CUDA device"):
            assembly.speed_up(model, model_cfg, section)
        assert not any("forward" in vars(m) for m in _mlps(model))


def test_without_cuda_the_kernel_check_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert fused_mlp.kernel_problem() == "there is no CUDA device"


def test_a_run_fuses_the_actor_and_reference_mlps_only_when_asked(monkeypatch):
    """build.models (what the trainer calls) installs the fused forward on every MLP of the actor
    and of the reference with model.fused_mlp = true, and on none without it."""
    from minirl import build
    from minirl.config.load import load_config
    from minirl.dist.context import DistContext
    from minirl.plugins import PluginManager

    monkeypatch.setattr(fused_mlp, "kernel_problem", lambda: None)
    pm, dist = PluginManager(entry_points=False), DistContext(device=torch.device("cpu"))
    for enabled in (True, False):
        overrides = ["trainer.device='cpu'", "actor.use_kl_loss=true", f"model.fused_mlp={str(enabled).lower()}"]
        _, adapter = build.models(pm, load_config(None, overrides), dist)
        for model in (adapter.actor, adapter.reference.model):
            assert ["forward" in vars(m) for m in _mlps(model)] == [enabled] * len(_mlps(model))


def test_a_deep_copy_runs_its_own_mlps_and_unfuse_restores_them(monkeypatch):
    """The hf engine deep-copies the actor and unfuses the copy for generate."""
    import copy

    monkeypatch.setattr(fused_mlp, "kernel_problem", lambda: None)
    model = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
    fused_mlp.fuse_mlps(model, True)
    clone = copy.deepcopy(model)
    assert all(c.forward.__self__ is c for c in _mlps(clone))
    fused_mlp.unfuse_mlps(clone)
    assert not any("forward" in vars(m) for m in _mlps(clone))
    assert all("forward" in vars(m) for m in _mlps(model))


def test_the_kernel_applies_only_to_gradient_free_bf16_cuda_forwards():
    x, wg, wu = inputs(4, 64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not fused_mlp.kernel_applies(x, wg, wu)  # CPU tensors
    if torch.cuda.is_available():
        x, wg, wu = (t.cuda() for t in (x, wg, wu))
        with torch.no_grad():
            assert fused_mlp.kernel_applies(x, wg, wu)
            assert not fused_mlp.kernel_applies(*(t.cuda() for t in inputs(4, 96, 128, dtype=torch.bfloat16)))  # K
            assert not fused_mlp.kernel_applies(*(t.cuda() for t in inputs(4, 64, 64, dtype=torch.bfloat16)))  # I
            assert not fused_mlp.kernel_applies(x[:0], wg, wu)  # no rows
            shifted = torch.empty(4 * 64 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(4, 64)
            assert not fused_mlp.kernel_applies(shifted, wg, wu)  # starts 2 bytes in: TMA needs 16
        assert not fused_mlp.kernel_applies(x, wg, wu)  # gradients on


def test_fused_forward_falls_back_to_hugging_faces_mlp_off_the_gpu(monkeypatch):
    monkeypatch.setattr(fused_mlp, "kernel_problem", lambda: None)
    plain = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
    fused = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
    fused_mlp.fuse_mlps(fused, True)
    ids = torch.randint(0, plain.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, fused(input_ids=ids).logits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
def test_fused_forward_through_the_kernel_under_the_interpreter(monkeypatch):
    """The kernel branch of the MLP forward (the [B, N, D] input flattened, the product put back
    in shape, down_proj): a float32 model whose MLPs take the kernel without gradients agrees with
    Hugging Face's to bf16's precision in the MLP."""
    from minirl.kernels import fused_mlp as fused_mlp_triton

    launches = []
    launch = fused_mlp_triton.launch
    monkeypatch.setattr(fused_mlp, "kernel_problem", lambda: None)
    monkeypatch.setattr(fused_mlp, "kernel_applies", lambda *a: not torch.is_grad_enabled())
    monkeypatch.setattr(fused_mlp_triton, "launch", lambda *a: launches.append(a[0].shape) or launch(*a))
    plain = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
    fused = random_model(preset_config("tiny"), "cpu", torch.float32, seed=0)
    fused_mlp.fuse_mlps(fused, True)
    ids = torch.randint(0, plain.config.vocab_size, (2, 9))
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, fused(input_ids=ids).logits
    assert launches == [(18, 64)] * len(_mlps(fused))
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert float((got - want).abs().max()) > 0  # the kernel's bf16 roundings, not the plain path


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 127, 1000, 28000])
def test_kernel_matches_the_unfused_bf16_computation(m):
    """The 1.5B shape (hidden 1536, intermediate 8960): cuBLAS GEMMs, eager silu·mul."""
    assert fused_mlp.kernel_problem() is None  # the H200 runs it
    x, wg, wu = inputs(m, 1536, 8960, device="cuda", dtype=torch.bfloat16, seed=m)
    unfused = torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)
    assert_matches(torch.ops.minirl.gate_up_silu(x, wg, wu), unfused, max_differing=1e-4)


@needs_cuda
@pytest.mark.gpu
def test_compiled_model_gradient_free_pass_matches_the_unfused_one():
    """Log-probs of a compiled bf16 model (the tiny preset, whose MLP tiles divide) with and
    without model.fused_mlp; with gradients both run Hugging Face's MLP, bit for bit."""
    from minirl.models.compile import compile_layers

    models = []
    for fuse in (False, True):
        model = random_model(preset_config("tiny"), "cuda", torch.bfloat16, seed=0)
        compile_layers(model, True)
        assert fused_mlp.fuse_mlps(model, fuse) == (len(_mlps(model)) if fuse else 0)
        models.append(model)
    ids = torch.randint(0, models[0].config.vocab_size, (4, 300), device="cuda")
    with torch.no_grad():
        plain = models[0](input_ids=ids).logits.float().log_softmax(-1)
        fused, kernels = _with_kernel_names(lambda: models[1](input_ids=ids).logits.float().log_softmax(-1))
    assert "gate_up_silu_kernel" in kernels
    torch.testing.assert_close(fused, plain, atol=2e-2, rtol=0)
    plain = models[0](input_ids=ids).logits  # with gradients: Hugging Face's MLP in both
    fused, kernels = _with_kernel_names(lambda: models[1](input_ids=ids).logits)
    assert "gate_up_silu_kernel" not in kernels
    assert torch.equal(plain, fused)


def _with_kernel_names(fn):
    """fn()'s result and the names of the CUDA kernels it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
