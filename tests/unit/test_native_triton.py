"""The native engine's Triton kernels compute what their pure-torch references compute.

On a machine without a GPU they run under Triton's interpreter (TRITON_INTERPRET=1), so a
kernel bug shows up here before it costs a GPU run. triton is a test dependency (constraints.txt),
so a missing one fails; tests/unit/test_native_gpu.py runs the same checks compiled, on CUDA.
"""

import functools
import math

import pytest
import torch

from tests.triton_interpreter import interpreter_fixes, require_interpreter

if torch.cuda.is_available():
    pytest.skip("interpreter checks are for machines without a GPU", allow_module_level=True)
require_interpreter()

import triton  # noqa: E402, F401  (a missing triton fails here instead of testing the torch fallbacks)

from minirl.kernels.selfcheck import self_check  # noqa: E402
from minirl.protocols import SamplingParams  # noqa: E402
from minirl_plugins.engines.native.layers import ops as ops_mod  # noqa: E402
from minirl_plugins.engines.native.layers import sampling  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    with interpreter_fixes():
        yield {name: fn for name, (fn, _check) in ops_mod.TRITON.items()}


def check(name, fn, kv_dtype=None):
    ops_mod.TRITON[name][1](fn, torch.device("cpu"), torch.float32, kv_dtype)


@pytest.mark.parametrize("name", ["rmsnorm", "add_rmsnorm", "silu_mul", "rope_store", "decode_attention"])
def test_kernel_matches_reference(kernels, name):
    check(name, kernels[name])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["rope_store", "decode_attention"])
def test_kernel_with_an_fp8_kv_cache_matches_reference(kernels, name, kv_dtype):
    """rollout.kv_cache_dtype = fp8: the kernels write the cache clamped and rounded as the torch
    reference does (same bytes), and decode reads the 8-bit values back as the reference does."""
    check(name, kernels[name], kv_dtype)


def test_self_check_accepts_a_kernel_and_names_why_it_rejects_one(kernels):
    """select_ops' verdict (minirl.kernels.selfcheck): None for a kernel that matches its
    reference; for one that is off, the op and its error; for one that raises, the error."""
    cpu = torch.device("cpu")

    def verdict(fn):
        return self_check(functools.partial(check, "rmsnorm", fn), cpu, "rejected")

    assert verdict(kernels["rmsnorm"]) is None
    off = verdict(lambda x, w, eps: kernels["rmsnorm"](x, w, eps) * 1.01)
    assert off.startswith("disagrees with its torch reference (rmsnorm: relative error"), off
    assert verdict(None) == "rejected (TypeError: 'NoneType' object is not callable)"


def test_sampler_matches_reference(kernels):
    check("fast_sample", kernels["fast_sample"])


def test_sampler_frequencies(kernels):
    """The inverse-transform draw over Triton's Philox stream samples the softmax (chi-square, 4
    tokens; the interpreter runs one program per row, so few rows here and many in the GPU test)."""
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.6]]).repeat(400, 1)
    tokens, _ = sampling.fast_sample_once(logits, 0.8, 77)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = torch.softmax(logits[0] / 0.8, -1).double() * 400
    assert ((counts - expected) ** 2 / expected).sum() < 16.27  # chi-square, 3 dof, p = 0.001


def test_sampler_draws_across_chunks_in_proportion(kernels):
    """The inverse-transform draw picks a vocabulary chunk by its mass, then a column within it:
    over a 12,288 vocabulary (three chunks of 4,096) with uneven mass per chunk and per column,
    and whole runs of -inf logits (never drawn), every sixth of the vocabulary gets its share."""
    vocab = 12288
    logits = torch.zeros(vocab)
    logits[4096:8192] = math.log(3.0)  # chunk 1 holds 3/5 of the mass
    logits[8192:10240] = float("-inf")  # half of chunk 2 is masked out
    logits[10240:] = math.log(2.0)
    tokens, lp = sampling.fast_sample_once(logits.repeat(900, 1), 1.0, 11)
    assert not ((tokens >= 8192) & (tokens < 10240)).any()
    probs = torch.softmax(logits.double(), -1)
    assert torch.allclose(lp.double(), probs[tokens].log(), atol=1e-5)
    counts = torch.bincount(tokens // 2048, minlength=6).double()
    expected = probs.view(6, 2048).sum(1) * 900
    keep = expected > 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert chi2 < 18.47  # chi-square, 4 dof, p = 0.001
    assert len(set(tokens.tolist())) > 800  # about 864 distinct expected of 900 draws


def test_inverse_transform_never_draws_a_lane_without_mass(kernels, monkeypatch):
    """On the GPU tl.cumsum is a parallel scan, so an empty lane's cumulative sum can sit an ulp
    above its neighbour's (the interpreter's sequential scan never does that): a target in that
    ulp must still draw the next lane with mass, as must a lane whose mass is below an ulp of its
    cumulative sum. `loose` is the fallback for a target in a rounding gap between intervals."""
    import triton.language as tl

    @triton.jit
    def probe(cum_ptr, mass_ptr, out_ptr, target, N: tl.constexpr):
        i = tl.arange(0, N)
        exact, loose = _crossing(tl.load(cum_ptr + i), tl.load(mass_ptr + i), target, i)  # noqa: F821
        tl.store(out_ptr, exact)
        tl.store(out_ptr + 1, loose)

    monkeypatch.setitem(globals(), "_crossing", sampling._crossing)  # the interpreter resolves globals

    def crossing(cum, mass, target):
        out = torch.zeros(2, dtype=torch.int32)
        probe[(1,)](torch.tensor(cum), torch.tensor(mass), out, target, N=len(cum))
        return out.tolist()

    bumped = 1.0 + 2**-23  # one ulp above 1.0
    assert crossing([1.0, bumped, 2.0, 3.0], [1.0, 0.0, 1.0, 1.0], 1.0 + 2**-24) == [2, 2]
    assert crossing([1.0, bumped, 2.0, 3.0], [1.0, 1e-9, 1.0, 1.0], 1.0 + 2**-24) == [2, 1]
    assert crossing([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], 2.5) == [2, 2]
    assert crossing([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], 4.0)[0] == 2**31 - 1  # past the end


def test_greedy_sampler_takes_the_first_maximum_across_chunks(kernels):
    """Temperature 0 returns torch.argmax's token (the first maximal one) when the maximum
    repeats within a chunk and across chunks, and its log-prob under the raw logits."""
    logits = torch.randn(3, 9000, generator=torch.Generator().manual_seed(2))
    logits[0, [7000, 100, 5000]] = 9.0
    logits[1, [8999, 4000]] = 9.0
    logits[2, :] = float("-inf")
    logits[2, 6001] = 0.0
    tokens, lp = sampling.fast_sample_once(logits, 0.0, 3)
    assert tokens.tolist() == [100, 4000, 6001]
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1), atol=1e-5)


@pytest.mark.parametrize("kv, quantization", [("auto", "none"), ("fp8", "none"), ("auto", "fp8")])
def test_engine_with_kernels_equals_torch_ops(kernels, monkeypatch, kv, quantization):
    """The whole engine wired to the kernels (strides, views, paging) gives the torch path's
    tokens, with the KV cache in the model's dtype and in fp8 (rollout.kv_cache_dtype), and with
    the layers' GEMMs on e4m3 copies (rollout.quantization, the Triton row kernels)."""
    import types

    from minirl_plugins.engines.native import build_native_engine
    from minirl_plugins.engines.native.engine import engine as engine_mod
    from tests.tiny_models import engine_context, tiny_config, tiny_hf_model

    cfg = tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    hf = tiny_hf_model(cfg, seed=4, std=0.2)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 61))]
    rollout = types.SimpleNamespace(kv_cache_dtype=kv, quantization=quantization)
    ref = build_native_engine(rollout, engine_context(cfg, actor=hf, page_size=4)).generate(prompts, params)
    fp8 = {name: fn for name, (fn, _) in ops_mod.FP8_TRITON.items()} if quantization == "fp8" else {}

    def triton_ops(device, dtype, use_triton=True, kv_dtype=None, quantization="none"):
        return ops_mod.Ops(**kernels, **fp8)

    monkeypatch.setattr(engine_mod, "select_ops", triton_ops)
    for steps in (1, 4):  # the fused sampler's device-side state, one and several steps per round trip
        eng = build_native_engine(rollout, engine_context(cfg, actor=hf, page_size=4, decode_steps=steps))
        assert eng.ops.graphable and eng.runner.kv.dtype.itemsize == (1 if kv == "fp8" else 4)
        assert eng.fp8_matrices == (4 * cfg.num_hidden_layers if quantization == "fp8" else 0)
        got = eng.generate(prompts, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
        for a, b in zip(got, ref):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)
    assert [c.token_ids for c in eng.generate(prompts, sampled)] == [
        c.token_ids for c in eng.generate(prompts, sampled)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ops_mod.FP8_TRITON))
def test_fp8_row_kernels_match_their_references(name, dtype):
    """rollout.quantization = "fp8": the kernels that quantize activations by rows (the norm, SiLU·mul,
    the attention output's), that apply the rows' scales and that rewrite the weights' e4m3 copies
    give their references' values."""
    fn, check = ops_mod.FP8_TRITON[name]
    with interpreter_fixes():
        check(fn, torch.device("cpu"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_quantizer_kernel_writes_the_references_bytes_in_place(dtype):
    """The sync's re-quantization of an fp8 weight (quantize_into's kernel): the same e4m3 bytes and
    scale as the torch reference, across blocks, into the same storage."""
    from minirl_plugins.engines.native.layers import fp8_linear as f

    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(24, 700, generator=gen) * torch.logspace(-4, 1, 700)).to(dtype)  # subnormals too
    copy = f.Fp8Weight(w)
    ptrs = (copy.q.data_ptr(), copy.scale.data_ptr())
    with interpreter_fixes():
        copy.refresh(f.quantize_into_triton)
    q, scale = f.quantize(w)
    assert (copy.q.data_ptr(), copy.scale.data_ptr()) == ptrs
    assert torch.equal(copy.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(copy.scale, scale)


@pytest.mark.parametrize("offsets", ["int32", "int64"])
@pytest.mark.parametrize("kv_dtype, dtype", [(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16)])
def test_fp8_pairs_decode_kernel_matches_reference(kv_dtype, dtype, offsets, monkeypatch):
    """decode_attention_fp8_pairs reads the 8-bit cache as int16 pairs of adjacent head dims and
    splits them into the even and the odd dims in float16 (here by Triton's byte operations, on
    CUDA by a byte permute and native conversions): within the half-precision tolerance of the
    reference at every block size and split count the check covers, for either fp8 format, with
    32-bit slot offsets (a cache of fewer than 2^31 elements) and with 64-bit ones (a larger one)."""
    from minirl_plugins.engines.native.layers import paged_attention

    if offsets == "int64":
        monkeypatch.setattr(paged_attention, "OFF32_LIMIT", 0)
    with interpreter_fixes():
        paged_attention.check_decode_attention_fp8_pairs(
            paged_attention.decode_attention_fp8_pairs, torch.device("cpu"), dtype, kv_dtype
        )


def test_engine_on_the_fp8_pairs_decode_kernel_generates_what_the_dequantizing_one_does(kernels, monkeypatch):
    """The whole bf16 engine over an e4m3 cache with decode_attention_fp8_pairs (as select_ops
    wires it on CUDA) against the same kernels with the dequantizing decode attention: the same
    greedy tokens, the same first log-prob (the prefill does not read the cache), and later
    log-probs no further apart than two bf16 implementations of the same attention are (those
    kernels against the torch ops)."""
    import types

    from minirl_plugins.engines.native import build_native_engine
    from minirl_plugins.engines.native.engine import engine as engine_mod
    from minirl_plugins.engines.native.layers import paged_attention
    from tests.tiny_models import engine_context, tiny_config, tiny_hf_model

    cfg = tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    hf = tiny_hf_model(cfg, seed=4, std=0.2).to(torch.bfloat16)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 71))]
    rollout = types.SimpleNamespace(kv_cache_dtype="fp8")

    def generate(ops):
        monkeypatch.setattr(engine_mod, "select_ops", lambda *args: ops)
        with interpreter_fixes():
            ctx = engine_context(cfg, actor=hf, dtype=torch.bfloat16, page_size=8)
            return build_native_engine(rollout, ctx).generate(prompts, params)

    pairs = ops_mod.Ops(**kernels)
    pairs.decode_attention = paged_attention.decode_attention_fp8_pairs
    torch_ops, dequantizing, got = generate(ops_mod.Ops()), generate(ops_mod.Ops(**kernels)), generate(pairs)
    assert [c.token_ids for c in got] == [c.token_ids for c in dequantizing]

    def drift(xs, ys):
        return max(abs(a - b) for x, y in zip(xs, ys) for a, b in zip(x.logprobs, y.logprobs))

    assert [c.logprobs[0] for c in got] == [c.logprobs[0] for c in dequantizing]
    assert 0 < drift(got, dequantizing) <= drift(dequantizing, torch_ops)


def test_gate_up_silu_kernel_matches_the_gemm_then_silu_mul():
    """The gate/up GEMM with SiLU·mul in its epilogue (ops.gate_up_silu, bf16 engines on Hopper)
    against cuBLAS's GEMM then silu_mul, at row counts from one to GATE_UP_ROWS, odd ones included."""
    fn, check = ops_mod.GATE_UP_SILU
    with interpreter_fixes():
        check(fn, torch.device("cpu"), torch.float32)


def test_gate_up_silu_takes_only_operands_it_was_measured_on_and_its_tiles_divide():
    """The MLP falls back to the GEMM and silu_mul for what the kernel does not take: more rows than
    a decode step where it was measured to pay (a prefill, a decode batch over GATE_UP_ROWS), a bias,
    another dtype, an intermediate size its column tiles do not divide, a hidden size its K tiles do
    not."""
    from minirl_plugins.engines.native.layers.activation import GATE_UP_ROWS, gate_up_silu_fits

    def fits(rows=64, hidden=256, inter=256, dtype=torch.bfloat16, bias=None):
        weight = torch.zeros(2 * inter, hidden, dtype=dtype)
        return gate_up_silu_fits(torch.zeros(rows, hidden, dtype=dtype), weight, bias)

    assert fits() and fits(rows=1) and fits(rows=GATE_UP_ROWS, inter=320) and fits(rows=37)
    assert not fits(rows=GATE_UP_ROWS + 1)
    assert not fits(rows=0)
    assert not fits(bias=torch.zeros(512, dtype=torch.bfloat16))
    assert not fits(dtype=torch.float32)
    assert not fits(inter=96)  # 64-wide column tiles
    assert not fits(hidden=200)  # 64-deep K tiles
