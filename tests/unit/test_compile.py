"""Regional torch.compile (model.compile_layers, minirl/models/compile.py): compiled decoder
layers give the eager log-probs, entropies and gradients, and packed micro-batches of new lengths
reuse the compiled graphs instead of recompiling.

On CPU inductor compiles the tiny model's layers to C++ (about 40 s on 2 cores, once for the
module); the gpu-marked test runs the same comparison in bf16 on CUDA, where the fused
element-wise kernels round differently from the eager ones.
"""

from __future__ import annotations

import pytest
import torch

from minirl.forward.packed import response_logprobs
from minirl.models.compile import compile_layers
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

# (prompt lengths, response lengths) of three micro-batches: different packed lengths and counts
MICRO = [([5, 7], [3, 9]), ([11, 4, 6], [2, 8, 5]), ([9], [13])]


def _model(device: str) -> torch.nn.Module:
    return random_model(preset_config("tiny"), device, torch.float32, seed=5)


def _micro_batch(prompt_lens, response_lens, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, 250, (n,), generator=g).tolist() for n in response_lens]
    return prompts, responses


def _loss_and_grads(model, prompts, responses, device):
    model.zero_grad(set_to_none=True)
    logp_R, ent_R = response_logprobs(model, prompts, responses, 0.7, torch.device(device), with_entropy=True)
    weights_R = torch.linspace(-1.0, 1.0, logp_R.numel(), device=logp_R.device)
    ((weights_R * logp_R).sum() + 0.1 * ent_R.sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logp_R.detach(), ent_R.detach(), grads


def _compare(device: str, atol_value: float, rtol_grad: float) -> None:
    eager, compiled = _model(device), _model(device)
    assert compile_layers(compiled, True) == len(compiled.get_decoder().layers)
    assert compile_layers(eager, False) == 0
    graphs = []
    for i, (p_lens, r_lens) in enumerate(MICRO):
        prompts, responses = _micro_batch(p_lens, r_lens, seed=i)
        want = _loss_and_grads(eager, prompts, responses, device)
        got = _loss_and_grads(compiled, prompts, responses, device)
        torch.testing.assert_close(got[0], want[0], atol=atol_value, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=atol_value, rtol=0)
        for name, g in want[2].items():
            scale = float(g.abs().max()) or 1.0
            err = float((got[2][name] - g).abs().max())
            assert err <= rtol_grad * scale, f"{name}: gradient error {err:.3g} against max |g| {scale:.3g}"
        with torch.no_grad():  # a log-prob pass: the inference graph
            nograd_R, _ = response_logprobs(compiled, prompts, responses, 0.7, torch.device(device))
        # the inference graph rounds as the training graph does (emulate_precision_casts), so a
        # reference or prev-log-prob pass agrees bit for bit with the update's forward
        assert torch.equal(nograd_R, got[0]), float((nograd_R - got[0]).abs().max())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] == graphs[2], f"new packed lengths recompiled the layers: graphs {graphs}"


def test_compiled_layers_equal_eager_and_do_not_recompile_per_length():
    """Log-probs, entropies and every parameter's gradient against eager, over three packed
    micro-batches of different lengths, and no-grad passes equal to the grad ones."""
    _compare("cpu", atol_value=1e-5, rtol_grad=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_layers_on_cuda_in_bf16():
    """Under bf16 autocast the eager and fused element-wise kernels may still round differently
    (reductions accumulate in another order): values agree to bf16's resolution of a log-prob
    (|logp| ~ 5.5 at the tiny vocabulary); no-grad and grad passes agree exactly."""
    _compare("cuda", atol_value=0.05, rtol_grad=0.05)


def test_a_run_compiles_the_actor_and_reference_layers_only_when_asked():
    """build.models (what the trainer calls) compiles every decoder layer of the actor and of
    the reference with model.compile_layers = true, and none without it."""
    from minirl import build
    from minirl.config.load import load_config
    from minirl.dist.context import DistContext
    from minirl.plugins import PluginManager

    pm, dist = PluginManager(entry_points=False), DistContext(device=torch.device("cpu"))
    for enabled in (True, False):
        cfg = load_config(
            None, ["trainer.device='cpu'", "actor.use_kl_loss=true", f"model.compile_layers={str(enabled).lower()}"]
        )
        _, adapter = build.models(pm, cfg, dist)
        for model in (adapter.actor, adapter.reference.model):
            compiled = [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in model.get_decoder().layers]
            assert compiled == [enabled] * len(compiled)


def test_the_reference_pass_runs_the_actors_gradient_free_graphs(monkeypatch):
    """build.models' reference (one process, compiled layers) claims gradients while it runs, so
    after the actor's gradient-free pass (an off-policy run's prev-log-prob pass) it compiles
    nothing of its own: the same log-probs bit for bit, and afterwards its parameters are frozen
    again, without gradients. aot_eager: the same graphs and guards as inductor."""
    from minirl import build
    from minirl.config.load import load_config
    from minirl.dist.context import DistContext
    from minirl.plugins import PluginManager

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", dynamic=True))
    cfg = load_config(None, ["trainer.device='cpu'", "actor.use_kl_loss=true", "model.compile_layers=true"])
    _, adapter = build.models(PluginManager(entry_points=False), cfg, DistContext(device=torch.device("cpu")))
    prompts, responses = _micro_batch([5, 7], [3, 9], seed=0)
    cpu = torch.device("cpu")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        actor_logp, _ = response_logprobs(adapter.actor, prompts, responses, 1.0, cpu)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with adapter.reference() as ref:
            assert all(p.requires_grad for p in ref.parameters())
            ref_logp, _ = response_logprobs(ref, prompts, responses, 1.0, cpu)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs > 0
    assert torch.equal(ref_logp, actor_logp)  # the same weights at step 1
    frozen = adapter.reference.model
    assert not any(p.requires_grad or p.grad is not None for p in frozen.parameters())
    with torch.no_grad():  # as it was: its own graphs, the same values
        torch.testing.assert_close(response_logprobs(frozen, prompts, responses, 1.0, cpu)[0], ref_logp, rtol=0, atol=0)


def test_a_deep_copy_runs_its_own_layers_and_uncompile_restores_eager():
    """The hf engine deep-copies the actor: the copy's compiled layers must compute with the
    copy's weights (a compiled bound method of the original would silently use the original's),
    and uncompile_layers gives the copy eager forwards back."""
    import copy

    model = _model("cpu")
    compile_layers(model, True)
    clone = copy.deepcopy(model)
    for original, copied in zip(model.get_decoder().layers, clone.get_decoder().layers):
        assert copied.forward.__self__ is copied and original.forward.__self__ is original
    prompts, responses = _micro_batch([5, 7], [3, 9], seed=0)
    cpu = torch.device("cpu")
    with torch.no_grad():
        clone.get_decoder().layers[0].mlp.down_proj.weight.mul_(3.0)
        want, _ = response_logprobs(model, prompts, responses, 1.0, cpu)
        got, _ = response_logprobs(clone, prompts, responses, 1.0, cpu)
        assert float((got - want).abs().max()) > 1e-3  # the copy's changed weight is used
        from minirl.models.compile import uncompile_layers

        uncompile_layers(clone)
        assert all("forward" not in layer.__dict__ for layer in clone.get_decoder().layers)
        assert all("forward" not in layer.self_attn.__dict__ for layer in clone.get_decoder().layers)
        eager, _ = response_logprobs(clone, prompts, responses, 1.0, cpu)
        torch.testing.assert_close(eager, got, atol=1e-5, rtol=0)


def test_seq_major_rotary_is_the_same_computation_bit_for_bit():
    """compile_layers gives each attention the rotary embedding on the [B, N, H, D] view (the
    layout whose compiled kernel has no division by the dynamic length). In eager mode it must
    be the same computation: log-probs and every gradient equal to Hugging Face's, bit for bit.
    All layers share one patched function (one compiled graph)."""
    from minirl.models.compile import seq_major_rotary

    plain, patched = _model("cpu"), _model("cpu")
    attns = [layer.self_attn for layer in patched.get_decoder().layers]
    assert all(seq_major_rotary(attn) for attn in attns)
    assert len({attn.forward.__func__ for attn in attns}) == 1
    assert attns[0].forward.__func__ is not type(attns[0]).forward
    prompts, responses = _micro_batch([5, 7, 4], [3, 9, 6], seed=1)
    want, got = (_loss_and_grads(m, prompts, responses, "cpu") for m in (plain, patched))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name
    assert not seq_major_rotary(torch.nn.Linear(2, 2)) and not seq_major_rotary(None)


def test_seq_major_rotary_leaves_other_rotary_helpers_alone():
    """An attention whose module's apply_rotary_pos_emb has other parameters (Gemma's one-tensor
    helper (x, cos, sin, unsqueeze_dim) is called once for q and once for k) keeps its forward."""
    import types

    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
        return x

    scope = {"apply_rotary_pos_emb": apply_rotary_pos_emb}
    exec("def forward(self, x):\n    return apply_rotary_pos_emb(x, 1.0, 0.0, unsqueeze_dim=2)", scope)
    attn_cls = type("OneTensorAttention", (torch.nn.Module,), {"forward": scope["forward"]})
    attn = attn_cls()
    from minirl.models.compile import seq_major_rotary

    assert not seq_major_rotary(attn) and "forward" not in attn.__dict__
    assert isinstance(attn.forward, types.MethodType) and attn(torch.ones(2)).tolist() == [1.0, 1.0]


@pytest.fixture
def one_rank_group():
    """What one process on a GPU joins (spmd.single_process there: a one-rank group and its (dp, sp)
    mesh, so FSDP2 wraps the actor), here over gloo on the CPU."""
    from minirl.config.load import load_config
    from minirl.dist import spmd

    cfg = load_config(None, ["trainer.device='cpu'"])
    try:
        yield spmd.init_rank(cfg, 0, 1, 0, f"tcp://127.0.0.1:{spmd.free_port()}")
    finally:
        spmd.shutdown()


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_layers_compile_with_the_attention_sizes_as_constants(monkeypatch, one_rank_group, lora):
    """FSDP2 marks every module of a wrapped layer FSDP-managed, and dynamo makes the int
    attributes of such modules dynamic sizes under dynamic=True: the attention's head_dim became a
    graph input, and inductor's rotary kernels indexed through divisions by it (4.1-4.8 times as
    long on an H100). build.models' FSDP2 actor, the full model's and LoRA's (whose reference pass is
    the actor with its adapters off), compiles graphs that take no head_dim."""
    from minirl import build
    from minirl.config.load import load_config
    from minirl.plugins import PluginManager

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=record, dynamic=True))
    overrides = ["trainer.device='cpu'", "actor.use_kl_loss=true", "model.compile_layers=true"]
    overrides += ["model.lora_rank=4", "model.lora_alpha=8"] if lora else []
    cfg = load_config(None, overrides)
    _, adapter = build.models(PluginManager(entry_points=False), cfg, one_rank_group)
    assert all(hasattr(layer, "reshard") for layer in adapter.actor.get_decoder().layers)  # FSDP2 units
    torch._dynamo.reset()
    prompts, responses = _micro_batch([5, 7], [3, 9], seed=0)
    with torch.no_grad():  # the actor's gradient-free pass, then the reference's
        response_logprobs(adapter.actor, prompts, responses, 1.0, torch.device("cpu"))
        with adapter.reference() as ref:
            response_logprobs(ref, prompts, responses, 1.0, torch.device("cpu"))
    attention = [gm for gm in graphs if "torch.cat" in gm.code]  # rotate_half
    assert attention, "no compiled graph applies the rotary embedding"
    assert not [gm for gm in graphs if "head_dim" in gm.code], "head_dim is a graph input: a dynamic size"
