"""The native engine on CUDA: kernels pass their self-checks, CUDA-graph decode gives the eager
and transformers' greedy tokens, the fused sampler samples the softmax, a weight load keeps the
captured graphs valid, and release_memory() returns the KV cache to the device.
"""

from types import SimpleNamespace

import pytest
import torch

from minirl_plugins.engines.native import build_native_engine
from minirl_plugins.engines.native.layers import sampling
from minirl_plugins.engines.native.layers.activation import GATE_UP_ROWS
from minirl_plugins.engines.native.layers.ops import select_ops
from minirl_plugins.engines.native.layers.paged_attention import decode_attention_triton, decode_block_n
from tests.tiny_models import (
    PROMPTS,
    assert_greedy_agree_until_parted,
    engine_context,
    greedy,
    hf_greedy,
    tiny_config,
    tiny_hf_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_kernels_pass_self_checks(dtype):
    ops = select_ops(CUDA, dtype)
    print(dtype, ops.chosen)
    expected = {"rmsnorm", "add_rmsnorm", "silu_mul", "rope_store", "decode_attention", "fast_sample"}
    if dtype == torch.bfloat16:
        expected |= {"prefill_attention", "extend_attention"}
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0):
        expected |= {"gate_up_silu"}
    assert expected <= set(ops.chosen), ops.chosen


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_graph_decode_equals_eager_and_transformers(family):
    cfg = tiny_config(
        family,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=256,
        **({"head_dim": 64} if family == "qwen3" else {}),
    )
    hf = tiny_hf_model(cfg, seed=2, std=0.2, device="cuda")
    graphs = build_native_engine(None, engine_context(cfg, actor=hf, device="cuda", num_kv_pages=512))
    eager = build_native_engine(
        SimpleNamespace(enforce_eager=True), engine_context(cfg, actor=hf, device="cuda", num_kv_pages=512)
    )
    assert graphs.runner.use_graphs
    got = graphs.generate(PROMPTS, greedy(n=2, max_new=24))
    assert graphs.runner.graphs, "no CUDA graph was captured"
    assert [c.token_ids for c in got] == [c.token_ids for c in eager.generate(PROMPTS, greedy(n=2, max_new=24))]
    for i, prompt in enumerate(PROMPTS):
        assert got[2 * i].token_ids == hf_greedy(hf, prompt, 24)


def test_bf16_logits_close_to_transformers():
    cfg = tiny_config("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    hf = tiny_hf_model(cfg, seed=1, std=0.05, dtype=torch.bfloat16, device="cuda")
    eng = build_native_engine(None, engine_context(cfg, actor=hf, device="cuda", dtype=torch.bfloat16, num_kv_pages=64))
    tokens = list(range(3, 200))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens], device="cuda")).logits[0].float()
    assert ((eng.logits(tokens).float() - ref).norm() / ref.norm()).item() < 2e-2


def test_fused_sampler_frequencies():
    logits = (torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 2).cuda().repeat(200_000, 1)
    tokens, logprobs = sampling.fast_sample_once(logits.to(torch.bfloat16), 0.9, 1234)
    probs = torch.softmax(logits[0].to(torch.bfloat16).float() / 0.9, -1).double()
    counts = torch.bincount(tokens, minlength=50).double()
    keep = probs * 200_000 > 5
    chi2 = ((counts[keep] - probs[keep] * 200_000) ** 2 / (probs[keep] * 200_000)).sum().item()
    df = int(keep.sum()) - 1
    assert chi2 < df + 4.5 * (2 * df) ** 0.5, chi2


def test_fused_sampler_frequencies_over_a_full_vocabulary():
    """At Qwen2's vocabulary (30 chunks of 5,120 columns) the draw follows the softmax: counts per
    64th of the vocabulary against their probabilities, over 8,192 rows of one bf16 logit row."""
    row = torch.randn(151936, generator=torch.Generator().manual_seed(1)) * 3
    row[:20000] -= 2.0  # uneven mass across chunks
    logits = row.to(torch.bfloat16).cuda().repeat(8192, 1)
    tokens, logprobs = sampling.fast_sample_once(logits, 1.0, 99)
    probs = torch.softmax(row.to(torch.bfloat16).double(), -1).cuda()
    assert torch.allclose(logprobs.double(), probs[tokens].log(), atol=1e-4)
    bins = torch.arange(151936, device="cuda") * 64 // 151936
    expected = torch.zeros(64, dtype=torch.float64, device="cuda").index_add_(0, bins, probs) * 8192
    counts = torch.bincount(bins[tokens], minlength=64).double()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 63 + 4.5 * (2 * 63) ** 0.5, chi2


def test_load_weights_keeps_graphs_valid():
    cfg = tiny_config("qwen2", hidden_size=256)
    a, b = (tiny_hf_model(cfg, seed=s, std=0.2, device="cuda") for s in (1, 2))
    eng = build_native_engine(None, engine_context(cfg, actor=a, device="cuda", num_kv_pages=512))
    eng.generate(PROMPTS, greedy(max_new=24))  # captures graphs over a's weights
    captured = {bs: id(g) for bs, (g, _) in eng.runner.graphs.items()}
    eng.load_weights(b.named_parameters())
    got = eng.generate(PROMPTS, greedy(max_new=24))
    assert {bs: id(g) for bs, (g, _) in eng.runner.graphs.items()} == captured, "graphs were re-captured"
    fresh = build_native_engine(None, engine_context(cfg, actor=b, device="cuda", num_kv_pages=512))
    assert [c.token_ids for c in got] == [c.token_ids for c in fresh.generate(PROMPTS, greedy(max_new=24))]


def test_release_memory_is_visible_in_reserved_memory():
    cfg = tiny_config("qwen2", hidden_size=256)
    eng = build_native_engine(None, engine_context(cfg, device="cuda", num_kv_pages=50_000))
    eng.generate(PROMPTS, greedy(max_new=24))
    kv_bytes = eng.runner.kv.numel() * eng.runner.kv.element_size()
    before = torch.cuda.memory_reserved()
    eng.release_memory()
    after = torch.cuda.memory_reserved()
    assert before - after >= kv_bytes, (before, after, kv_bytes)
    eng.resume_memory()
    assert torch.cuda.memory_reserved() >= after + kv_bytes


def test_decode_attention_block_follows_the_sweep():
    """64-key blocks for 3 to 6 programs per multiprocessor (batch 256 at 2 KV heads on an H200),
    128-key blocks for fewer or more (docs/benchmarks.md, the decode attention sweep)."""
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    assert [decode_block_n(p, CUDA) for p in (2 * sms, 3 * sms, 6 * sms - 1, 6 * sms)] == [128, 64, 64, 128]
    assert decode_block_n(3 * sms, torch.device("cpu")) == 128


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernels_pass_self_checks_with_an_fp8_kv_cache(kv_dtype):
    """rollout.kv_cache_dtype = fp8: the cache-writing and cache-reading kernels agree with the
    torch reference on an 8-bit cache, so the engine keeps them (and its CUDA graphs)."""
    ops = select_ops(CUDA, torch.bfloat16, kv_dtype=kv_dtype)
    assert {"rope_store", "decode_attention"} <= set(ops.chosen), ops.chosen
    assert ops.graphable


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_decodes_through_the_pairs_kernel(kv_dtype):
    """rollout.kv_cache_dtype = fp8 / fp8_e5m2 in bf16: decode_attention_fp8_pairs passes its
    self-check and is chosen, and an engine decoding with it (CUDA graphs) generates what the same
    engine does with the dequantizing decode kernel over the same cache: the same first log-prob
    (the prefill reads no cache), then the same greedy tokens until a near tie parts them, with
    log-probs within 0.25 (e4m3) or 0.5 (e5m2) up to and at the parting step (there each run took
    its own argmax, so both tokens were at the top). The two kernels round differently (the pairs
    kernel folds the scale into its float16 query and sums in log2 units), and the std-0.2 model
    feeds each step's rounding into the next: a new token's keys and values differ in their last
    bf16 bits, and where that moves a stored element across an fp8 rounding boundary it moves by
    the format's step, twice as large in e5m2 (2 mantissa bits) as in e4m3 (3). On one H100 an
    e5m2 run differed by 0.28 twelve tokens in. A broken kernel parts at once and far. Their
    distances from the torch reference engine: dev/check_fp8_drift.py, docs/benchmarks.md."""
    fmt = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.float8_e5m2
    ops = select_ops(CUDA, torch.bfloat16, kv_dtype=fmt)
    assert ops.chosen["decode_attention"] == "triton_fp8_pairs", ops.chosen
    cfg = tiny_config("qwen2", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    hf = tiny_hf_model(cfg, seed=2, std=0.2, device="cuda", dtype=torch.bfloat16)
    rollout = SimpleNamespace(kv_cache_dtype=kv_dtype)
    ctx = dict(actor=hf, device="cuda", dtype=torch.bfloat16, num_kv_pages=512)
    fast, dequantizing = (build_native_engine(rollout, engine_context(cfg, **ctx)) for _ in range(2))
    assert fast.ops.chosen["decode_attention"] == "triton_fp8_pairs"
    dequantizing.ops.decode_attention = decode_attention_triton
    got, want = (e.generate(PROMPTS, greedy(n=2, max_new=32)) for e in (fast, dequantizing))
    assert fast.runner.graphs and dequantizing.runner.graphs
    assert [c.logprobs[0] for c in got] == [c.logprobs[0] for c in want]
    assert_greedy_agree_until_parted(got, want, atol=0.25 if fmt == torch.float8_e4m3fn else 0.5)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs TMA (sm90)"
)
def test_gate_up_silu_in_one_kernel_decodes_as_the_gemm_then_silu_mul():
    """A bf16 engine on Hopper runs its MLPs' gate/up GEMM with SiLU·mul in the epilogue
    (ops.gate_up_silu) in steps of up to GATE_UP_ROWS rows (captured decode steps, and prefills of
    that few tokens), and generates what the same engine does with cuBLAS's GEMM and the silu_mul kernel: the
    same greedy tokens until a near tie parts them (the two GEMMs sum in different orders, so an
    element of g or u may round the other way), log-probs within 0.05 up to it."""
    cfg = tiny_config("qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    hf = tiny_hf_model(cfg, seed=2, std=0.02, device="cuda", dtype=torch.bfloat16)
    ctx = dict(actor=hf, device="cuda", dtype=torch.bfloat16, num_kv_pages=512)
    fused, unfused = (build_native_engine(None, engine_context(cfg, **ctx)) for _ in range(2))
    assert fused.ops.chosen["gate_up_silu"] == "triton", fused.ops.chosen
    unfused.ops.gate_up_silu = None
    calls = []
    kernel = fused.ops.gate_up_silu
    fused.ops.gate_up_silu = lambda x, w: calls.append(x.shape[0]) or kernel(x, w)
    got, want = (e.generate(PROMPTS, greedy(n=2, max_new=32)) for e in (fused, unfused))
    assert fused.runner.graphs and unfused.runner.graphs
    assert len(calls) >= 2 * cfg.num_hidden_layers, calls  # the layers of two steps at least
    assert max(calls) <= GATE_UP_ROWS, calls
    assert_greedy_agree_until_parted(got, want, atol=0.05)


def test_fp8_gemms_run_on_the_tensor_cores_under_cuda_graphs():
    """rollout.quantization = fp8 in bf16: the fp8 GEMM (cuBLASLt) and the Triton kernels that
    quantize by rows and apply the row scales (rotary's, for qkv) pass their self-checks and are
    chosen. An engine decoding with them (CUDA graphs) generates what the same engine does with the torch
    references (e4m3 values multiplied in float32 by torch, rounded to bf16): the same greedy
    tokens until a near tie parts them, log-probs within
    0.1 up to it. The two sum in different orders, so a bf16 output may round the other way, and
    the next layer's quantizer can turn that last-bit difference into a whole e4m3 step: a std-0.2
    model, which amplifies every difference, parted after two tokens 0.49 apart on an H100, so
    this one has std 0.02. After a load, the captured graphs multiply with the new copies: the
    engine generates what a fresh one over the new weights does."""
    from minirl_plugins.engines.native.layers import ops as ops_mod

    ops = select_ops(CUDA, torch.bfloat16, quantization="fp8")
    assert ops.chosen["scaled_mm"] == "cublaslt", ops.chosen
    assert all(ops.chosen[name] == "triton" for name in ops_mod.FP8_TRITON), ops.chosen
    cfg = tiny_config("qwen2", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    hf = tiny_hf_model(cfg, seed=2, std=0.02, device="cuda", dtype=torch.bfloat16)
    rollout = SimpleNamespace(quantization="fp8")
    ctx = dict(device="cuda", dtype=torch.bfloat16, num_kv_pages=512)
    fast, torch_ops = (build_native_engine(rollout, engine_context(cfg, actor=hf, **ctx)) for _ in range(2))
    assert fast.fp8_matrices == 4 * cfg.num_hidden_layers
    for name in ("scaled_mm", "rope_store", *ops_mod.FP8_TRITON):  # rope_store applies qkv's row scales
        setattr(torch_ops.ops, name, getattr(ops_mod.Ops, name))  # the class's defaults: the references
    got, want = (e.generate(PROMPTS, greedy(n=2, max_new=32)) for e in (fast, torch_ops))
    assert fast.runner.graphs
    assert_greedy_agree_until_parted(got, want, atol=0.1)
    other = tiny_hf_model(cfg, seed=9, std=0.02, device="cuda", dtype=torch.bfloat16)
    fast.load_weights(other.state_dict().items())
    fresh = build_native_engine(rollout, engine_context(cfg, actor=other, **ctx))
    after, again = (e.generate(PROMPTS, greedy(max_new=16)) for e in (fast, fresh))
    assert [c.token_ids for c in after] == [c.token_ids for c in again]


def test_fp8_weight_copies_from_the_kernel_are_the_references_bytes_on_cuda():
    """The sync's re-quantization (quantize_into's kernel: an inf-norm reduction, then one fused
    scale-round-store) writes the torch reference's e4m3 bytes and scale on the device too, at the
    1.5B model's shapes and at many scales (448 / amax and amax / 448 correctly rounded on both
    sides: a reciprocal times 448 differs in the last bit for some amax and flips a rounding)."""
    from minirl_plugins.engines.native.layers.fp8_linear import Fp8Weight, quantize, quantize_into_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2560, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] + [(48, 272)] * 40
    for i, shape in enumerate(shapes):
        w = torch.randn(shape, device=CUDA, generator=gen).to(torch.bfloat16) * 10.0 ** (i % 9 - 5)
        copy = Fp8Weight(w)
        copy.refresh(quantize_into_triton)
        q, scale = quantize(w)
        assert torch.equal(copy.q.view(torch.uint8), q.view(torch.uint8)), (i, shape)
        assert torch.equal(copy.scale, scale), (i, float(copy.scale), float(scale))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pairs_decode_kernel_on_cuda(kv_dtype):
    """decode_attention_fp8_pairs compiled, its pairs split by inline PTX (a byte permute and the
    native fp8 -> f16x2 conversions), computes the reference's attention over either format."""
    from minirl_plugins.engines.native.layers import paged_attention as pa

    pa.check_decode_attention_fp8_pairs(pa.decode_attention_fp8_pairs, CUDA, torch.bfloat16, kv_dtype)


@pytest.mark.parametrize("rows, ctx, splits", [(64, 5000, 4), (3, 700, 16), (200, 300, 2)])
def test_fp8_pairs_rows_merged_by_their_last_program_are_whole_every_launch(rows, ctx, splits):
    """The pairs kernel's splits merged by each row's last program (merge "last"):
    its arithmetic is fixed whichever program comes last, so 300 launches under one CUDA graph
    give the same bits, a merge that read a partial before it was written would not, and
    every launch leaves the rows' counts at 0; within the reference's tolerance of the merge
    kernel's result."""
    from minirl_plugins.engines.native.layers import paged_attention as pa

    qkv, kc, vc, meta = pa.random_paged_case(CUDA, torch.bfloat16, rows, max_len=ctx, kv_dtype=torch.float8_e4m3fn)
    meta.num_splits = splits
    args = (qkv, kc, vc, meta, pa.CHECK_HEADS, 128**-0.5)
    last = {"merge": "last"}
    first = pa.decode_attention_fp8_pairs(*args, config=last)
    outs = torch.empty(300, *first.shape, dtype=first.dtype, device=CUDA)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(outs.shape[0]):
            outs[i].copy_(pa.decode_attention_fp8_pairs(*args, config=last))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs, first.expand_as(outs))
    assert not meta.split_counts.any()
    by_kernel = pa.decode_attention_fp8_pairs(*args, config={"merge": "kernel"})
    torch.testing.assert_close(first, by_kernel, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continued_requests_equal_fresh_ones_on_cuda(dtype):
    """A request continued over its kept KV cache (extend attention: the flash kernel in bf16, the
    reference in float32) samples the tokens a fresh request over the whole conversation does.
    In bf16 the two paths round differently, so greedy ties may flip: at least 95% agree."""
    cfg = tiny_config("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    hf = tiny_hf_model(cfg, seed=2, std=0.2, device="cuda", dtype=dtype)
    ctx = dict(actor=hf, device="cuda", dtype=dtype, num_kv_pages=256, page_size=16)
    eng, fresh = (build_native_engine(None, engine_context(cfg, **ctx)) for _ in range(2))
    tool = list(range(40, 60))
    contexts = {f"r{i}": list(p) for i, p in enumerate(PROMPTS)}
    agree = total = 0
    restarted = set()
    for turn in range(3):
        for rid, c in contexts.items():
            eng.submit(rid, c, greedy(max_new=12))
        done = {}
        while eng.has_work():
            done.update((t.request_id, t) for t in eng.step())
        for rid, out in done.items():
            [want] = fresh.generate([contexts[rid]], greedy(max_new=12))
            agree += sum(a == b for a, b in zip(out.token_ids, want.token_ids))
            total += len(want.token_ids)
            assert turn == 0 or rid in restarted or out.cached_tokens > 0
            contexts[rid] += want.token_ids + tool  # continue from the fresh tokens: the same conversation
            if out.token_ids != want.token_ids:  # a flipped tie: start this conversation anew
                eng.release(rid)
                restarted.add(rid)
    assert agree / total >= (1.0 if dtype == torch.float32 else 0.95), (agree, total)
