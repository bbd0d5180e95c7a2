"""LoRA (minirl/models/lora.py): only the adapters train, the reference is the base with the
adapters disabled (equal to a separate reference model), the merged weights compute what the
adapters compute, the native engine holds exactly the trainer's current adapters after every
sync, and the peft adapter directory round-trips through peft itself.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.config.load import load_config
from minirl.forward.packed import logprob_head, packed_forward
from minirl.models import assembly, lora
from minirl.models.checksum import weights_checksum
from minirl.models.fused_mlp import _adapting, _is_silu_gated
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl_plugins.algorithms.optim import build_adamw
from minirl_plugins.engines.native import build_native_engine
from tests.tiny_models import PROMPTS, engine_context

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
RESPONSES = [[3, 4, 5, 6], [8, 9], [11, 12, 13]]


def model_cfg(*overrides: str):
    return load_config(None, ["model.lora_rank=4", "model.lora_alpha=8", *overrides]).model


def base_model(seed: int = 0):
    return random_model(preset_config("tiny"), "cpu", torch.float32, seed)


def lora_model(*overrides: str, seed: int = 0):
    """(the base model, a copy of it with adapters)."""
    base = base_model(seed)
    return base, lora.apply_lora(copy.deepcopy(base), model_cfg(*overrides), "tiny")


@torch.no_grad()
def perturb_adapters(model, seed: int, scale: float = 0.05) -> None:
    """Adapter values an update could have reached (fresh B is zero: the adapters do nothing)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if lora.is_adapter_param(name):
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def log_probs(model) -> torch.Tensor:
    prompts = PROMPTS[: len(RESPONSES)]
    with torch.no_grad():
        return packed_forward(model, prompts, RESPONSES, torch.device("cpu"), logprob_head(1.0))[0]


def logits(model, ids=PROMPTS[2]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), attn_implementation="sdpa").logits


def test_only_the_adapters_carry_gradients_and_optimizer_state():
    base, model = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_param(n) for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    optim_cfg = load_config(None, ["actor.optim.lr=1e-2"]).actor.optim
    optimizer, _ = build_adamw(model, optim_cfg, total_steps=3)
    for _ in range(2):
        loss = -log_probs_grad(model).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in optimizer.state} == trainable
    for name, p in model.named_parameters():  # the base is untouched, bit for bit
        if not lora.is_adapter_param(name):
            assert torch.equal(p, base.get_parameter(name.replace(".base_layer", ""))), name
    # trained: some merged weight is not the base's
    assert any(not torch.equal(lora.merged(m), m.base_layer.weight) for m in lora.lora_layers(model).values())


def log_probs_grad(model) -> torch.Tensor:
    prompts = PROMPTS[: len(RESPONSES)]
    return packed_forward(model, prompts, RESPONSES, torch.device("cpu"), logprob_head(1.0))[0]


def test_fresh_adapters_start_as_the_base_model():
    """B starts at zero, so the policy at step 0 is the reference exactly (the KL starts at 0)."""
    base, model = lora_model()
    assert torch.equal(log_probs(model), log_probs(base))


def test_reference_with_adapters_disabled_equals_a_separate_reference_model():
    base, model = lora_model()
    perturb_adapters(model, seed=1)
    with lora.adapters_disabled(model):
        ref = log_probs(model)
    assert torch.equal(ref, log_probs(base))
    assert not torch.equal(log_probs(model), ref)  # the adapters are back on afterwards
    assert all(not m.disable_adapters for m in lora.lora_layers(model).values())


@settings(max_examples=8, deadline=None)
@given(rank=st.integers(1, 8), alpha=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_merged_weights_compute_what_the_adapters_compute(rank, alpha, seed):
    """W + B A * alpha / r in a plain model (the engines' copy) gives the LoRA model's logits.
    In float64: at alpha / r = 64 float32 rounding alone moves a logit by 1e-4."""
    _, model = lora_model(f"model.lora_rank={rank}", f"model.lora_alpha={alpha}")
    perturb_adapters(model, seed)
    model.double()
    plain = base_model().double()
    plain.load_state_dict(dict(lora.merged_weights(model)))
    torch.testing.assert_close(logits(plain), logits(model), rtol=1e-10, atol=1e-10)
    merged = lora.unload(copy.deepcopy(model))  # the hf engine's copy
    assert not lora.has_adapters(merged)
    torch.testing.assert_close(logits(merged), logits(model), rtol=1e-10, atol=1e-10)


def test_target_and_exclude_modules_pick_the_adapted_matrices():
    _, model = lora_model(
        'model.target_modules=["q_proj", "down_proj"]', 'model.exclude_modules=["layers.1.mlp.down_proj"]'
    )
    assert sorted(lora.lora_layers(model)) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    ]
    moved = [name for name, _ in assembly.full_weights(model, adapted_only=True)]
    assert moved == [f"{n}.weight" for n in lora.lora_layers(model)]
    every = [name for name, _ in assembly.full_weights(model)]
    assert every == [name for name, _ in base_model().named_parameters()]  # a plain model's names


def test_native_engine_generates_with_the_trainers_adapters_after_every_sync():
    """Each sync moves only the adapted matrices, merged; afterwards the engine's weights are
    exactly the trainer's merged weights (checksum) and it scores tokens as the LoRA model does."""
    _, model = lora_model()
    config = model.config
    engine = build_native_engine(None, engine_context(config, actor=model))
    assert engine.checksum(torch.float32) == weights_checksum(assembly.full_weights(model), torch.float32)
    for step in range(3):
        perturb_adapters(model, seed=10 + step)  # an update
        trainer_sum = weights_checksum(assembly.full_weights(model), torch.float32)
        assert engine.checksum(torch.float32) != trainer_sum  # stale until the sync
        moved = list(assembly.full_weights(model, adapted_only=True))
        assert len(moved) == 14
        engine.load_weights(moved)
        assert engine.checksum(torch.float32) == trainer_sum
        got = engine.logits(PROMPTS[2])
        torch.testing.assert_close(got.float(), logits(model)[0].float(), rtol=1e-4, atol=1e-4)


def test_peft_export_loads_in_peft_and_back_through_lora_adapter_path(tmp_path):
    from peft import PeftModel

    base, model = lora_model('model.target_modules=["q_proj", "v_proj", "up_proj"]')
    perturb_adapters(model, seed=3)
    lora.save_adapter(model, str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter"))
    # peft sums x Wᵀ + s·(x Aᵀ) Bᵀ, minirl's layer multiplies by W + s·B A: float32 rounding apart
    torch.testing.assert_close(logits(peft_model), logits(model), rtol=1e-5, atol=1e-5)
    loaded = lora.apply_lora(copy.deepcopy(base), model_cfg(f"model.lora_adapter_path={tmp_path / 'adapter'}"), "tiny")
    ours = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, ours[name]), name
        assert p.requires_grad == lora.is_adapter_param(name)  # continues training the adapter


def test_adapter_of_another_shape_is_refused_on_load(tmp_path):
    _, model = lora_model("model.lora_rank=2")
    lora.save_adapter(model, str(tmp_path / "a"))
    _, other = lora_model('model.target_modules=["q_proj"]')
    with pytest.raises(Exception, match="model.lora_adapter_path"):
        lora.load_adapter(other, str(tmp_path / "a"))


def test_bf16_base_gets_bf16_adapters():
    """One parameter dtype per module: FSDP2 refuses a mix (peft would keep float32 adapters)."""
    base = random_model(preset_config("tiny"), "cpu", torch.bfloat16, 0)
    model = lora.apply_lora(base, model_cfg(), "tiny")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_fused_mlp_keeps_a_lora_mlp_and_runs_unfused_only_while_adapting():
    """The fused gate/up kernel sees a LoRA MLP as its own (base weights) and is bypassed while
    the adapters are on: with them off (the reference pass) the kernel's product is the layer's."""
    _, model = lora_model()
    mlp = model.model.layers[0].mlp
    assert _is_silu_gated(mlp)
    assert _adapting(mlp.gate_proj)
    with lora.adapters_disabled(model):
        assert not _adapting(mlp.gate_proj)
    assert _adapting(mlp.gate_proj)


def test_target_modules_take_a_string_or_a_list(tmp_path):
    assert load_config(None, ['model.target_modules=["q_proj"]']).model.target_modules == ["q_proj"]
    assert load_config(None, ["model.target_modules=.*proj"]).model.target_modules == ".*proj"
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nlora_rank = 8\ntarget_modules = "all-linear"\nexclude_modules = ["o_proj"]\n')
    m = load_config(str(toml), []).model
    assert (m.target_modules, m.exclude_modules) == ("all-linear", ["o_proj"])


def test_hf_engine_merges_its_copy_and_takes_the_merged_sync():
    from types import SimpleNamespace

    from minirl_plugins.engines.hf import HFEngine
    from tests.tiny_models import greedy

    _, model = lora_model()
    engine = HFEngine(SimpleNamespace(max_num_seqs=8), engine_context(model.config, actor=model))
    assert not lora.has_adapters(engine.model)  # plain Linears: generate runs no adapter code
    perturb_adapters(model, seed=4, scale=0.3)
    engine.load_weights(assembly.full_weights(model, adapted_only=True))
    assert weights_checksum(engine.model.named_parameters()) == weights_checksum(assembly.full_weights(model))
    want = [int(logits(model, p)[0, -1].argmax()) for p in PROMPTS]
    got = [c.token_ids[0] for c in engine.generate(PROMPTS, greedy(max_new=1))]
    assert got == want


def test_fresh_adapters_come_from_model_seed_and_leave_the_run_stream_alone():
    """Every rank draws the same A whatever its own seed (the trainer seeds seed + rank), and
    building the adapters shifts no random stream of the run."""
    torch.manual_seed(1)
    untouched = torch.rand(3)
    torch.manual_seed(1)
    _, a = lora_model()
    assert torch.equal(torch.rand(3), untouched)
    torch.manual_seed(2)
    _, b = lora_model()
    assert all(torch.equal(p, b.get_parameter(n)) for n, p in a.named_parameters())
    _, c = lora_model("model.seed=1")
    assert not torch.equal(c.get_parameter(ADAPTER_A), a.get_parameter(ADAPTER_A))


ADAPTER_A = "model.layers.0.self_attn.q_proj.lora_A.default.weight"


def test_lora_update_flops_count_weight_gradients_of_the_adapters_only():
    """MFU of a LoRA update: forward 2·N, input gradients 2·N, weight gradients 2·n_adapters per
    token (N counts the frozen base and the adapters), attention three times its forward."""
    from minirl.adapter import FullFineTuning, LoRAFineTuning
    from minirl.observe.metrics import flops_params, train_flops

    base, model = lora_model()
    assert FullFineTuning(base, None).trained_parameters() is None
    n, n_lora = flops_params(model), LoRAFineTuning(model, None, False).trained_parameters()
    # 2 layers x r = 4 x (in + out) of q, k, v, o, gate, up, down (hidden 64, kv 32, intermediate 128)
    assert n_lora == 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert n == flops_params(base) + n_lora
    lens = [10, 6]
    attn = 2 * 2 * 64 * (100 + 36)  # 2·L·width·Σs²
    assert train_flops(model.config, n, lens, True, n_lora) == (4 * n + 2 * n_lora) * 16 + 3 * attn
    assert train_flops(model.config, n, lens, True) == 3 * (2 * n * 16 + attn)


@settings(max_examples=20, deadline=None)
@given(
    rank=st.integers(1, 8),
    alpha=st.integers(1, 64),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    target=st.sampled_from(["self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"]),
)
def test_lora_layer_forward_is_peft_s_sum(rank, alpha, rows, seed, target):
    """minirl's LoRA layer forward (x (W + s·B A)ᵀ + b with the merged weight, MergedLinear) gives
    peft's x Wᵀ + b + s·(x Aᵀ) Bᵀ and its gradients of x, A and B, in float64, leading dimensions
    kept, with and without a bias; with the adapters off it is the base layer alone."""
    _, model = lora_model(f"model.lora_rank={rank}", f"model.lora_alpha={alpha}")
    perturb_adapters(model, seed)
    model.double()
    layer = model.get_submodule(f"model.layers.1.{target}")
    assert layer.forward.__func__ is lora._forward  # installed by apply_lora
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, layer.in_features, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(2, rows, layer.out_features, generator=gen, dtype=torch.float64)
    results = []
    for forward in (layer.forward, lambda t: type(layer).forward(layer, t)):  # ours, peft's
        xi = x.clone().requires_grad_(True)
        model.zero_grad()
        out = forward(xi)
        out.backward(grad_out)
        a, b = layer.lora_A[lora.ADAPTER].weight.grad, layer.lora_B[lora.ADAPTER].weight.grad
        results.append((out.detach(), xi.grad, a.clone(), b.clone()))
    for ours, peft in zip(*results):
        torch.testing.assert_close(ours, peft, rtol=1e-12, atol=1e-12)
    with lora.adapters_disabled(model), torch.no_grad():
        assert torch.equal(layer(x), layer.base_layer(x))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 9), seed=st.integers(0, 2**16), bias=st.booleans())
def test_merged_linear_multiplies_by_the_rounded_merged_weight_and_returns_input_dtypes(rows, seed, bias):
    """Under bf16 autocast over float32 adapters (every pass on CUDA): the output is x times the
    merged weight rounded once to bf16, what an engine holding merged weights computes; the
    gradients come back in each input's dtype and equal the float64 ones within bf16 rounding;
    a frozen W and bias get none."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, rows, 24, generator=gen, requires_grad=True)
    w = torch.randn(40, 24, generator=gen).bfloat16()
    b_ = torch.randn(40, generator=gen).bfloat16() if bias else None
    a = (torch.randn(4, 24, generator=gen) * 0.3).requires_grad_(True)
    b = (torch.randn(40, 4, generator=gen) * 0.3).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora.MergedLinear.apply(x, w, b_, a, b, 2.0)
    merged = torch.addmm(w, b.detach().bfloat16(), a.detach().bfloat16(), alpha=2.0)
    want = torch.nn.functional.linear(x.detach().bfloat16(), merged, b_)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    assert (x.grad.dtype, a.grad.dtype, b.grad.dtype) == (torch.float32,) * 3
    x64, a64, b64 = (t.detach().double().requires_grad_(True) for t in (x, a, b))
    ref = torch.nn.functional.linear(x64, w.double(), None) + 2.0 * (x64 @ a64.t()) @ b64.t()
    ref.backward(dy.double())
    for got, exact in ((x.grad, x64.grad), (a.grad, a64.grad), (b.grad, b64.grad)):
        torch.testing.assert_close(got.double(), exact, rtol=3e-2, atol=3e-2 * float(exact.abs().max()))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), seed=st.integers(0, 2**16), wanted=st.sets(st.integers(0, 4), min_size=1))
def test_merged_linear_gives_a_base_that_trains_its_gradients(rows, seed, wanted):
    """Where W and b require gradients (not LoRA's frozen base, but the Function's contract), they
    get the unmerged layer's in float64, beside x's, A's and B's; whichever of the five require
    one (x not: the first layer's input; A or B alone), each gets the unmerged layer's and the
    others none."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [
        torch.randn(2, rows, 12, generator=gen, dtype=torch.float64),  # x
        torch.randn(20, 12, generator=gen, dtype=torch.float64),  # W
        torch.randn(20, generator=gen, dtype=torch.float64),  # b
        torch.randn(3, 12, generator=gen, dtype=torch.float64),  # A
        torch.randn(20, 3, generator=gen, dtype=torch.float64),  # B
    ]
    dy = torch.randn(2, rows, 20, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (
        lambda x, w, b_, a, b: lora.MergedLinear.apply(x, w, b_, a, b, 0.5),
        lambda x, w, b_, a, b: torch.nn.functional.linear(x, w, b_) + 0.5 * (x @ a.t()) @ b.t(),
    ):
        inputs = [t.clone().requires_grad_(i in wanted) for i, t in enumerate(leaves)]
        fn(*inputs).backward(dy)
        grads.append([t.grad for t in inputs])
    for i, (got, want) in enumerate(zip(*grads)):
        assert (got is None) == (i not in wanted)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_lora_dropout_in_training_runs_the_unmerged_sum():
    """Dropout on the adapters' input cannot be merged into W: a training forward with it takes
    the unmerged sum (dropped inputs change only the adapters' part); evaluation merges."""
    _, model = lora_model("model.lora_dropout=0.5")
    perturb_adapters(model, seed=4)
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    x = torch.randn(2, 5, layer.in_features)
    layer.train()
    torch.manual_seed(0)
    dropped = layer(x)
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, lora._unmerged(layer, x), rtol=0, atol=0)
    layer.eval()
    torch.testing.assert_close(layer(x), type(layer).forward(layer, x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(dropped, layer(x))


@pytest.mark.parametrize("training", [False, True])
def test_injected_adapters_take_the_models_mode(training):
    """peft builds its modules in training mode; apply_lora gives them the model's. A model loads
    in eval mode, so a log-prob pass before the first update runs without the adapters' dropout
    (the same log-probs twice, those of the merged weights), and a compiled layer sees one mode
    per kind of pass."""
    base = base_model().train(training)
    model = lora.apply_lora(base, model_cfg("model.lora_dropout=0.5"), "tiny")
    assert {m.training for m in model.modules()} == {training}
    if not training:
        perturb_adapters(model, seed=5)
        first = log_probs(model)
        torch.testing.assert_close(log_probs(model), first, rtol=0, atol=0)
        merged = base_model()
        merged.load_state_dict(dict(lora.merged_weights(model)))
        torch.testing.assert_close(first, log_probs(merged), rtol=1e-5, atol=1e-5)


def test_frozen_base_held_in_bf16_multiplies_as_autocast_does():
    """Under autocast to bf16 (every pass on CUDA) frozen Linears stored in bf16 give exactly what
    float32 ones cast on every call give: the same log-probs, the same adapter gradients, with 2
    bytes an element freed. The input embedding, the norms and the adapters keep float32."""
    _, model = lora_model()
    perturb_adapters(model, seed=2)
    held = copy.deepcopy(model)
    freed = lora.hold_frozen_in(held, torch.bfloat16)
    linears = [m for m in held.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    assert freed == 2 * sum(p.numel() for m in linears for p in m.parameters(recurse=False)) > 0
    assert {p.dtype for m in linears for p in m.parameters(recurse=False)} == {torch.bfloat16}
    assert held.lm_head in linears  # untied: multiplied like the rest
    bf16 = {n for n, p in held.named_parameters() if p.dtype == torch.bfloat16}
    assert not any(lora.is_adapter_param(n) or "norm" in n or "embed" in n for n in bf16)
    assert lora.hold_frozen_in(held, None) == 0 and lora.hold_frozen_in(held, torch.bfloat16) == 0

    def run(m):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = packed_forward(m, PROMPTS[: len(RESPONSES)], RESPONSES, torch.device("cpu"), logprob_head(1.0))[0]
        logp.float().sum().backward()
        return logp.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    (want, want_grads), (got, got_grads) = run(model), run(held)
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())


def test_a_tied_lm_head_is_the_embedding_and_stays():
    """A tied lm_head keeps the embedding's dtype unless the embedding is held in the gather dtype
    (`embedding`), and then both are: one tensor."""
    base = random_model(preset_config("qwen3-tiny"), "cpu", torch.float32, 0)
    model = lora.apply_lora(base, model_cfg(), "qwen3-tiny")
    lora.hold_frozen_in(model, torch.bfloat16)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.dtype == torch.float32
    embed = model.get_input_embeddings().weight
    assert lora.hold_frozen_in(model, torch.bfloat16, embedding=torch.bfloat16) == 2 * embed.numel()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def _layers_fwd_bwd_matmul_flops(model, tokens: int) -> int:
    """FLOPs of the GEMMs (mm, addmm) in one forward + backward of `tokens` packed tokens through
    the decoder layers under bf16 autocast, counted by torch's FlopCounterMode. The layers' input
    requires gradients, as every layer's but the first does in a real update."""
    from torch.utils.flop_counter import FlopCounterMode

    from minirl.models.attention import packed_forward_kwargs

    decoder = model.get_decoder()
    kwargs = packed_forward_kwargs([tokens // 2, tokens - tokens // 2])
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    kwargs["position_embeddings"] = decoder.rotary_emb(hidden, kwargs["position_ids"])
    hidden.requires_grad_(True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = hidden
            for layer in decoder.layers:
                out = layer(h, **kwargs)
                h = out[0] if isinstance(out, tuple) else out
        h.float().square().mean().backward()

    run()  # compiles, when compiled
    with FlopCounterMode(display=False) as counter:
        run()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_lora_update_computes_no_weight_gradient_of_the_frozen_matrices(monkeypatch, compiled):
    """What LoRA saves, counted: per token, each frozen matrix W costs 4·|W| (the forward and the
    input gradient, both with the merged weight W + s·B A) and each adapter factor 4·|A| (its
    weight gradient: dy B and x Aᵀ, then the factor's product), where full fine-tuning costs
    6·|W|; per forward and per backward each merge costs 2·r·|W| whatever the tokens. With the
    frozen base held in bf16 (lora.hold_frozen_in, as on CUDA), in eager layers and in compiled
    ones (AOTAutograd's backward graph, run op by op)."""
    from minirl.models.compile import compile_layers

    if compiled:  # inductor's kernels are opaque to the counter; aot_eager runs the same graphs op by op
        real = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", dynamic=True))
    base, model = lora_model("model.lora_rank=8")
    perturb_adapters(model, seed=1)
    lora.hold_frozen_in(model, torch.bfloat16)
    for m in (base, model):
        compile_layers(m, compiled)
    params = dict(model.get_decoder().layers.named_parameters())
    frozen = sum(p.numel() for name, p in params.items() if p.dim() == 2 and not lora.is_adapter_param(name))
    adapters = sum(p.numel() for name, p in params.items() if lora.is_adapter_param(name))
    assert adapters > 0 and all(p.dtype == torch.bfloat16 for n, p in params.items() if ".base_layer." in n)
    tokens = 24
    rank = 8
    assert _layers_fwd_bwd_matmul_flops(model, tokens) == (4 * frozen + 4 * adapters) * tokens + 2 * 2 * rank * frozen
    assert _layers_fwd_bwd_matmul_flops(base, tokens) == 6 * frozen * tokens


def test_the_engine_holds_the_actors_constant_tensors_instead_of_copies():
    """EngineContext.shared: the native engine's embedding, head and norms are the actor's own
    tensors (no second copy), the adapted matrices its own merged copies; the adapted layers'
    biases, which the actor offers too, are blocks of the engine's fused qkv bias and stay copies
    (an alias would leave the fused bias the forward adds stale: Qwen2's q/k/v biases are far from
    zero, so they are here). It generates exactly as an engine of copies does, before and after
    syncs, and refuses to load other values into what it shares."""
    _, model = lora_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    shared = dict(assembly.constant_weights(model))
    assert "model.embed_tokens.weight" in shared and "lm_head.weight" in shared
    assert "model.layers.0.self_attn.q_proj.bias" in shared and "model.norm.weight" in shared
    assert not any("lora_" in n or "base_layer" in n for n in shared)
    adapted = {n for n, _ in assembly.full_weights(model, adapted_only=True)}
    assert not adapted & set(shared) and len(adapted) == 14
    engine = build_native_engine(None, dataclasses.replace(engine_context(model.config, actor=model), shared=shared))
    copies = build_native_engine(None, engine_context(model.config, actor=model))
    params = dict(engine.model.named_parameters())
    fused = {n for n in shared if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    assert fused and engine.shared == frozenset(shared) - fused
    for name, tensor in shared.items():
        assert (params[name].data_ptr() == tensor.data_ptr()) == (name not in fused), name
    for name in adapted:
        assert (
            params[name].data_ptr()
            != dict(model.named_parameters())[name.replace(".weight", ".base_layer.weight")].data_ptr()
        )
    own = sum(p.numel() * p.element_size() for n, p in params.items() if n not in engine.shared)
    assert engine.memory_gib()["weights_gib"] == own / 2**30 < copies.memory_gib()["weights_gib"]
    for step in range(2):
        prompts = [PROMPTS[0], PROMPTS[2]]
        assert generate(engine, prompts) == generate(copies, prompts)
        perturb_adapters(model, seed=20 + step)  # an update, then the sync of what changed
        for e in (engine, copies):
            e.load_weights(assembly.full_weights(model, adapted_only=True))
        assert engine.checksum(torch.float32) == weights_checksum(assembly.full_weights(model), torch.float32)
    engine.load_weights(assembly.full_weights(model))  # every weight, the shared ones as themselves
    embed = shared["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="actor's own tensor"):
        engine.load_weights([("model.embed_tokens.weight", embed + 1.0)])
    assert torch.equal(embed, copies.model.model.embed_tokens.weight)  # the actor's untouched


def test_an_engine_in_another_dtype_shares_nothing_and_full_fine_tuning_offers_nothing():
    _, model = lora_model()
    shared = dict(assembly.constant_weights(model))
    ctx = dataclasses.replace(engine_context(model.config, actor=model, dtype=torch.bfloat16), shared=shared)
    assert build_native_engine(None, ctx).shared == frozenset()
    from minirl.adapter import FullFineTuning

    assert FullFineTuning(base_model(), None).shared_weights() == {}  # every weight changes


def test_a_tied_head_is_shared_once_with_the_embedding():
    """qwen3-tiny ties lm_head to the embedding: the engine's head is the actor's embedding too,
    and a sync of every weight (the head under its own name included) leaves the actor intact."""
    model = lora.apply_lora(
        random_model(preset_config("qwen3-tiny"), "cpu", torch.float32, 0), model_cfg(), "qwen3-tiny"
    )
    shared = dict(assembly.constant_weights(model))
    assert "lm_head.weight" not in shared  # the actor names the tied tensor once
    engine = build_native_engine(None, dataclasses.replace(engine_context(model.config, actor=model), shared=shared))
    embed = model.get_input_embeddings().weight
    assert engine.model.lm_head.weight.data_ptr() == embed.data_ptr()
    copies = build_native_engine(None, engine_context(model.config, actor=model))
    perturb_adapters(model, seed=3)
    for e in (engine, copies):
        e.load_weights(assembly.full_weights(model))
    assert generate(engine, [PROMPTS[1]]) == generate(copies, [PROMPTS[1]])
    with pytest.raises(ValueError, match="actor's own tensor"):
        engine.load_weights([("lm_head.weight", torch.zeros_like(embed))])


def generate(engine, prompts) -> list[list[int]]:
    from tests.tiny_models import greedy

    outs = engine.generate(prompts, greedy(max_new=6))
    return [o.token_ids for o in outs]


def test_merged_and_constant_weights_find_the_adapted_layers_under_wrapper_prefixes():
    """merged_weights and constant_weights look each adapted layer up by its parameter's path
    rather than walking every module: under a checkpoint wrapper's `_checkpoint_wrapped_module.`
    prefix, with a module that has a `base_layer` but no adapters, and without adapters at all,
    they give what a walk over named_modules gives: the same names in the same order, the same
    values, the constant tensors the parameters themselves."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    base, model = lora_model()
    perturb_adapters(model, seed=5)
    for m in (base, model):
        layers = m.get_decoder().layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
        m.model.decoy = torch.nn.Module()  # a base_layer, no adapters: a plain parameter
        m.model.decoy.base_layer = torch.nn.Linear(3, 2)
        m.model.decoy.base_layer.requires_grad_(False)

    def walked(m, adapted_only):
        layers = {n: x for n, x in m.named_modules() if lora._is_lora_layer(x)}
        for name, p in m.named_parameters():
            layer = name.removesuffix(".base_layer.weight")
            if layer in layers:
                yield layer + ".weight", lora.merged(layers[layer])
            elif not (adapted_only or lora.is_adapter_param(name)):
                yield name.replace(".base_layer.", "."), p

    for m in (base, model):
        for adapted_only in (False, True):
            got, want = list(lora.merged_weights(m, adapted_only)), list(walked(m, adapted_only))
            assert [n for n, _ in got] == [n for n, _ in want]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    names = [n for n, _ in lora.merged_weights(model, adapted_only=True)]
    assert len(names) == 14 and all("_checkpoint_wrapped_module." in n for n in names)
    assert "model.decoy.weight" in dict(lora.merged_weights(model))
    constant = dict(lora.constant_weights(model))
    frozen = {n.replace(".base_layer.", "."): p for n, p in model.named_parameters() if not p.requires_grad}
    assert set(constant) == set(frozen) - {n for n, _ in walked(model, True)}
    assert "model.decoy.weight" in constant and all(constant[n].data_ptr() == frozen[n].data_ptr() for n in constant)


def _graphs_of_a_step(model) -> int:
    """Graphs dynamo compiles for `model`'s layers in one training forward + backward and one
    gradient-free pass (an update, a reference pass), from a fresh dynamo cache."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    prompts = PROMPTS[: len(RESPONSES)]
    logp = packed_forward(model, prompts, RESPONSES, torch.device("cpu"), logprob_head(1.0))[0]
    logp.sum().backward()
    log_probs(model)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_layer_0_runs_the_other_layers_compiled_graphs(monkeypatch, checkpointing):
    """Dynamo guards on an input's requires_grad, so wherever layer 0's input differs from the
    other layers' in it, layer 0 compiles graphs of its own (compile._first_layer_like_the_rest):
    under LoRA's frozen embedding in training passes, and under Hugging Face's checkpointing hook
    in gradient-free ones. Full fine-tuning and LoRA, with checkpointing or without, compile the
    graphs of a plain full fine-tuning model; the adapters' gradients are unchanged, and
    uncompiling restores the hooks. aot_eager: the same graphs and guards as inductor, without
    generating code."""
    from minirl.models.compile import compile_layers, uncompile_layers
    from minirl_plugins.parallel.checkpointing import minirl_apply_activation_checkpointing

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", dynamic=True))
    plain, _ = lora_model()
    compile_layers(plain, True)
    want = _graphs_of_a_step(plain)
    base, model = lora_model()
    perturb_adapters(model, seed=2)
    eager = copy.deepcopy(model)
    for m in (base, model, eager):
        if checkpointing:
            minirl_apply_activation_checkpointing(m, model_cfg("model.enable_gradient_checkpointing=true"))
    for m in (base, model):
        compile_layers(m, True)
    assert _graphs_of_a_step(base) == _graphs_of_a_step(model) == want > 0
    ids = torch.tensor([[1, 2]])
    embed = model.get_input_embeddings()
    with torch.no_grad():
        assert not embed(ids).requires_grad
    assert embed(ids).requires_grad and embed.weight.grad is None
    prompts = PROMPTS[: len(RESPONSES)]
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
        packed_forward(m, prompts, RESPONSES, torch.device("cpu"), logprob_head(1.0))[0].sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    uncompile_layers(model)
    with torch.no_grad():  # back to Hugging Face's hook where checkpointing installed it, else none
        assert embed(ids).requires_grad == checkpointing
    assert embed(ids).requires_grad == checkpointing
