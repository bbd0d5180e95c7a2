"""minirl's packed-sequence attention: equal to running each sequence alone, in values and grads."""

from __future__ import annotations

import pytest
import torch

from minirl.models.attention import ATTN_NAME, minirl_attention_forward, packed_forward_kwargs, register_attention
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.models.tokenizers import byte_tokenizer
from minirl.models.varlen import varlen_attention

PRESETS = ["tiny", "llama3-tiny", "qwen3-tiny"]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(preset: str, attn: str, device="cpu", dtype=torch.float32):
    """A preset with large weights (std 0.2), so attention is sharp and any leak between
    packed sequences shows in the logits instead of vanishing under near-uniform weights."""
    cfg = preset_config(preset)
    cfg.initializer_range = 0.2
    return random_model(cfg, device, dtype, seed=3, attn_implementation=attn)


def _packed_batch(seq_lens, vocab=256, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, sum(seq_lens)), generator=g).to(device)


def _unpacked_logits(model, ids_1N, seq_lens):
    outs, start = [], 0
    for n in seq_lens:
        outs.append(model(input_ids=ids_1N[:, start : start + n], use_cache=False).logits)
        start += n
    return torch.cat(outs, dim=1)


def _dense_causal_reference(q_NHD, k_NKD, v_NKD, seq_lens, scale):
    """Attention written out with matmul and softmax, one sequence at a time."""
    groups = q_NHD.shape[1] // k_NKD.shape[1]
    k_NHD, v_NHD = k_NKD.repeat_interleave(groups, 1), v_NKD.repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in seq_lens:
        q, k, v = (t[start : start + n].transpose(0, 1).float() for t in (q_NHD, k_NHD, v_NHD))
        scores_HQL = q @ k.transpose(1, 2) * scale
        future_QL = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores_HQL = scores_HQL.masked_fill(future_QL, float("-inf"))
        outs.append((scores_HQL.softmax(-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(outs).to(q_NHD.dtype)


def test_packed_forward_kwargs_describe_each_sequence():
    """The kwargs are the contract between the trainer and the attention function."""
    kw = packed_forward_kwargs([3, 1, 4])
    assert kw["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 4, 8] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 4 and isinstance(kw["max_length_q"], int)
    assert kw["use_cache"] is False
    for bad in ([], [3, 0], [[1, 2]]):
        with pytest.raises(ValueError, match="seq_lens"):
            packed_forward_kwargs(bad)


def test_varlen_attention_cpu_matches_written_out_attention():
    """The per-segment SDPA path is the exact reference the GPU kernels are checked against."""
    torch.manual_seed(0)
    seq_lens = [5, 1, 9, 3]
    q, k, v = torch.randn(18, 4, 8), torch.randn(18, 2, 8), torch.randn(18, 2, 8)
    cu = packed_forward_kwargs(seq_lens)["cu_seq_lens_q"]
    out = varlen_attention(q, k, v, cu, max(seq_lens), scale=0.3)
    torch.testing.assert_close(out, _dense_causal_reference(q, k, v, seq_lens, 0.3), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, k, v, cu, 9, backend="nope")


def _fake_kernel(expect_heads_equal: bool):
    """Stand-ins with the signatures of torch's varlen_attn (2.11: window_size; 2.13: window_size +
    enable_gqa) and flash-attn, computing with the exact CPU path."""
    import minirl.models.varlen as attn

    def check(q, k, cu_q, cu_k, max_q, max_k):
        assert cu_q.dtype == torch.int32 and cu_q is cu_k and max_q == max_k
        assert (k.shape[1] == q.shape[1]) == expect_heads_equal

    def torch_211(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        check(q, k, cu_q, cu_k, max_q, max_k)
        assert window_size == (-1, 0)
        return attn._segment_sdpa(q, k, v, cu_q, max_q, scale)

    def torch_213(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert enable_gqa
        return torch_211(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        check(q, k, cu_q, cu_k, max_q, max_k)
        assert causal and dropout_p == 0.0
        return attn._segment_sdpa(q, k, v, cu_q, max_q, softmax_scale)

    return {"torch_211": torch_211, "torch_213": torch_213, "flash": flash}


@pytest.mark.parametrize("kernel", ["torch_211", "torch_213", "flash"])
def test_kernel_adapters_pass_causal_gqa_and_int32_boundaries(kernel, monkeypatch):
    """The CUDA kernels cannot run here, so fakes with their signatures check what minirl passes
    them: causality spelled per torch version, GQA natively or by repeating heads, int32 cu."""
    import minirl.models.varlen as attn

    native_gqa = kernel in ("torch_213", "flash")
    fake = _fake_kernel(expect_heads_equal=not native_gqa)[kernel]
    backend = "flash_attn" if kernel == "flash" else "torch"
    monkeypatch.setattr(attn, "_flash_attn_varlen" if kernel == "flash" else "_torch_varlen", lambda: fake)
    seq_lens = [3, 6, 2]
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    cu = packed_forward_kwargs(seq_lens)["cu_seq_lens_q"].long()  # int64 in: the adapters convert
    out = varlen_attention(q, k, v, cu, 6, 0.5, backend=backend)
    torch.testing.assert_close(out, _dense_causal_reference(q, k, v, seq_lens, 0.5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seq_lens", [[5, 1, 9, 3, 2, 6, 7], [9], [2, 3], [6, 6, 1]])
def test_long_sequences_alone_short_runs_together(seq_lens, monkeypatch):
    """With the cuDNN path on, every sequence of LONG_SEQUENCE tokens or more goes to the dense
    kernel alone and each run of consecutive shorter ones to the varlen kernel in one call, with
    boundaries rebased to the run; the outputs come back in packed order, exactly."""
    import minirl.models.varlen as attn

    calls = []

    def dense(q, k, v, scale):
        calls.append(("long", q.shape[0]))
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return attn._segment_sdpa(q, k, v, cu, q.shape[0], scale)

    def varlen(q, k, v, cu, max_seqlen, scale):
        calls.append(("short", cu.tolist(), max_seqlen))
        return attn._segment_sdpa(q, k, v, cu, max_seqlen, scale)

    monkeypatch.setattr(attn, "LONG_SEQUENCE", 6)
    monkeypatch.setattr(attn, "_cudnn_usable", lambda q, k: True)
    monkeypatch.setattr(attn, "_cudnn_causal", dense)
    monkeypatch.setitem(attn._BACKENDS, "torch", varlen)
    torch.manual_seed(0)
    n = sum(seq_lens)
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    cu = packed_forward_kwargs(seq_lens)["cu_seq_lens_q"]
    out = varlen_attention(q, k, v, cu, max(seq_lens), 0.3, backend="torch")
    torch.testing.assert_close(out, _dense_causal_reference(q, k, v, seq_lens, 0.3), atol=1e-6, rtol=1e-5)
    expected, run = [], [0]
    for length in seq_lens:
        if length >= 6:
            if len(run) > 1:
                expected.append(("short", run, max(b - a for a, b in zip(run, run[1:]))))
            expected.append(("long", length))
            run = [0]
        else:
            run = run + [run[-1] + length]
    if len(run) > 1:
        expected.append(("short", run, max(b - a for a, b in zip(run, run[1:]))))
    if max(seq_lens) < 6:
        expected = [("short", cu.tolist(), max(seq_lens))]
    assert calls == expected


@pytest.mark.parametrize("isolate", [True, False])
def test_a_check_inside_a_checkpointed_forward_leaves_recomputation_intact(isolate):
    """The cuDNN self-check runs a small backward the first time a long sequence is seen, which
    may be inside a layer under activation checkpointing (a run without a reference pass).
    Isolated, the checkpoint's backward works; run plainly, what the check saved counts as the
    layer's and the recomputed forward (no check then) does not match (the control)."""
    import torch.utils.checkpoint as ckpt

    import minirl.models.varlen as attn

    checked = []

    def check():
        x = torch.randn(4, requires_grad=True)
        torch.autograd.grad((x * x).sum(), x)
        return True

    def layer(h):
        if not checked:
            checked.append(attn.isolated(check) if isolate else check())
        return (h * h).sin()

    h = torch.randn(8, requires_grad=True)
    out = ckpt.checkpoint(layer, h, use_reentrant=False)
    if isolate:
        out.sum().backward()
        torch.testing.assert_close(h.grad, (2 * h * (h * h).cos()).detach())
    else:
        with pytest.raises(Exception, match="checkpoint"):
            out.sum().backward()


@pytest.mark.parametrize("reference_attn", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_logits_and_grads_equal_unpacked(preset, reference_attn):
    """One packed row with cu_seq_lens must give each sequence exactly its own forward and
    backward: the log-probs and the policy gradient of training depend on it."""
    seq_lens = [7, 1, 12, 4, 9]
    ids = _packed_batch(seq_lens)
    packed, reference = _model(preset, ATTN_NAME), _model(preset, reference_attn)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(1, sum(seq_lens), packed.config.vocab_size, generator=g)

    logits = packed(input_ids=ids, **packed_forward_kwargs(seq_lens, stand_in_mask=True)).logits
    expected = _unpacked_logits(reference, ids, seq_lens)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)

    (logits * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), (_, p_ref) in zip(packed.named_parameters(), reference.named_parameters()):
        scale = p_ref.grad.abs().max().item()  # grads reach ~300: compare relative to each tensor
        assert (p.grad - p_ref.grad).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("preset", PRESETS)
def test_a_packed_forward_skips_transformers_packing_detection(preset, monkeypatch):
    """With minirl's attention, transformers neither builds a mask nor looks for packed
    sequences (that look reads a value back from the device: a host sync per forward), and the
    logits are still each sequence's own. Without the stand-in mask it does look."""
    import transformers.masking_utils as masking

    seq_lens = [5, 9, 2]
    ids = _packed_batch(seq_lens)
    model = _model(preset, ATTN_NAME)
    expected = _unpacked_logits(model, ids, seq_lens)
    looked = []
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: looked.append(1))
    kwargs = packed_forward_kwargs(seq_lens, stand_in_mask=True)
    assert kwargs["attention_mask"].shape == (1, 1, 0, 0)
    torch.testing.assert_close(model(input_ids=ids, **kwargs).logits, expected, atol=2e-5, rtol=1e-5)
    assert looked == []
    model(input_ids=ids, **packed_forward_kwargs(seq_lens))  # without the stand-in transformers looks
    assert looked


def test_other_attentions_get_no_stand_in_mask_and_refuse_it():
    """sdpa builds its packed mask from the position_ids, so the packed forward gives it no
    stand-in; handed one anyway, it fails on the empty shape rather than attending across
    sequences."""
    from minirl.forward.packed import _reads_no_mask

    seq_lens = [6, 3]
    ids = _packed_batch(seq_lens)
    model = _model("tiny", "sdpa")
    assert not _reads_no_mask(model) and _reads_no_mask(_model("tiny", ATTN_NAME))
    logits = model(input_ids=ids, **packed_forward_kwargs(seq_lens)).logits
    torch.testing.assert_close(logits, _unpacked_logits(model, ids, seq_lens), atol=2e-5, rtol=1e-5)
    with pytest.raises(RuntimeError):
        model(input_ids=ids, **packed_forward_kwargs(seq_lens, stand_in_mask=True))


def test_packing_without_boundaries_is_detected_by_the_test():
    """Negative control: treating the row as one sequence must change the logits, else the
    equality test above could pass without the boundaries doing anything."""
    seq_lens = [6, 6]
    ids = _packed_batch(seq_lens)
    model = _model("tiny", ATTN_NAME)
    leaky = model(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(leaky, _unpacked_logits(model, ids, seq_lens), atol=1e-3)


def test_restarting_position_ids_alone_also_separate_sequences():
    """A caller that passes only position_ids (as transformers' own packing does) still gets
    per-sequence attention, never silent leakage across sequences."""
    seq_lens = [4, 8, 3]
    ids = _packed_batch(seq_lens)
    model = _model("qwen3-tiny", ATTN_NAME)
    position_ids = packed_forward_kwargs(seq_lens)["position_ids"]
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(logits, _unpacked_logits(model, ids, seq_lens), atol=2e-5, rtol=1e-5)


def test_no_dense_mask_is_built_for_packed_rows():
    """transformers must not materialise an N x N mask for "minirl": it is what varlen saves."""
    from transformers.masking_utils import create_causal_mask

    register_attention()
    cfg = preset_config("tiny")
    cfg._attn_implementation = ATTN_NAME
    kw = packed_forward_kwargs([300, 200])
    embeds = torch.zeros(1, 500, cfg.hidden_size)
    assert create_causal_mask(cfg, embeds, None, None, position_ids=kw["position_ids"]) is None
    padding = torch.ones(2, 500, dtype=torch.long)
    padding[0, :10] = 0
    mask = create_causal_mask(cfg, embeds.expand(2, -1, -1), padding, None, position_ids=None)
    assert mask.shape == (2, 500)  # only the 2-D padding mask reaches the attention function


def test_padded_batch_and_generate_match_eager():
    """generate and padded batches (the hf rollout engine, evaluation) work with "minirl"."""
    tok = byte_tokenizer()
    tok.padding_side = "left"
    batch = tok(["hello there", "hi", "a longer prompt than both"], return_tensors="pt", padding=True)
    model, reference = _model("tiny", ATTN_NAME), _model("tiny", "eager")
    real = batch["attention_mask"].bool()
    logits, expected = model(**batch).logits[real], reference(**batch).logits[real]
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(model.generate(**batch, **kw), reference.generate(**batch, **kw))


def test_register_is_idempotent_and_unsupported_options_are_errors():
    """The loader registers on every call; options "minirl" cannot honour fail loudly."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register_attention()
    register_attention()
    assert AttentionInterface._global_mapping[ATTN_NAME] is minirl_attention_forward
    assert ATTN_NAME in AttentionMaskInterface._global_mapping
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="sliding"):
        minirl_attention_forward(None, q, q, q, None, sliding_window=2)
    with pytest.raises(ValueError, match="attention_dropout"):
        minirl_attention_forward(None, q, q, q, None, dropout=0.1)


# ---------------------------------------------------------------------------------------------
# CUDA (run by the lead on an H200)
# ---------------------------------------------------------------------------------------------


def _cuda_backends():
    from minirl.models.varlen import _flash_attn_varlen

    return ["torch"] + (["flash_attn"] if _flash_attn_varlen() is not None else [])


def _max_err(x, ref):
    return (x.float() - ref.float()).abs().max().item()


@gpu
@needs_cuda
@pytest.mark.parametrize("long_sequence", [0, 64])
@pytest.mark.parametrize("backend", _cuda_backends())
def test_cuda_varlen_kernels_match_segment_sdpa_bf16(backend, long_sequence, monkeypatch):
    """Each CUDA varlen kernel is as close to exact float32 attention as bf16 per-segment SDPA
    is, forward and backward (bf16 rounding alone makes direct comparisons flaky); at
    long_sequence 64 the sequences of 64 tokens or more go through cuDNN, the others through the
    varlen kernel."""
    import minirl.models.varlen as attn

    monkeypatch.setattr(attn, "LONG_SEQUENCE", long_sequence)
    torch.manual_seed(0)
    seq_lens = [100, 1, 257, 64, 33]
    n, cu = sum(seq_lens), packed_forward_kwargs(seq_lens, device="cuda")["cu_seq_lens_q"]
    base = [torch.randn(n, h, 128, device="cuda") for h in (12, 2, 2)]
    grad = torch.randn(n, 12, 128, device="cuda")
    results = {}
    for name, dtype in ((backend, torch.bfloat16), ("sdpa", torch.bfloat16), ("sdpa", torch.float32)):
        inputs = [t.to(dtype).requires_grad_() for t in base]
        out = varlen_attention(*inputs, cu, max(seq_lens), 128**-0.5, backend=name)
        out.backward(grad.to(dtype))
        results[(name, dtype)] = [out.detach()] + [t.grad for t in inputs]
    if long_sequence:  # the path under test ran: cuDNN passed its self-check here
        assert attn._cudnn_usable(base[0].bfloat16(), base[1].bfloat16())
    exact = results[("sdpa", torch.float32)]
    bf16 = results[("sdpa", torch.bfloat16)]
    for got, bf16_sdpa, ref in zip(results[(backend, torch.bfloat16)], bf16, exact):
        assert _max_err(got, ref) <= 2 * _max_err(bf16_sdpa, ref) + 1e-2 * ref.abs().max().item()


@gpu
@needs_cuda
def test_cuda_torch_varlen_gqa_equals_repeated_heads():
    """Where torch's varlen_attn has no enable_gqa (torch 2.11), minirl calls its flash kernel
    with the grouped keys and values: the output equals that of the heads repeated (the same
    kernel on the same values) and the gradients agree to bf16 rounding of the group sums."""
    import minirl.models.varlen as attn

    torch.manual_seed(0)
    seq_lens = [100, 1, 257, 64, 33]
    n, cu = sum(seq_lens), packed_forward_kwargs(seq_lens, device="cuda")["cu_seq_lens_q"]
    base = [torch.randn(n, h, 128, device="cuda", dtype=torch.bfloat16) for h in (12, 2, 2)]
    grad = torch.randn(n, 12, 128, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in base]
        q, k, v = leaves
        if not grouped:
            k, v = attn.repeat_kv(k, 12), attn.repeat_kv(v, 12)
        out = attn._aten_flash_gqa(q, k, v, cu.int(), max(seq_lens), 128**-0.5)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    assert torch.equal(results[0][0], results[1][0])
    for got, ref in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
def test_cuda_packed_model_forward_matches_unpacked_sdpa_bf16():
    """The whole packed path on CUDA (kernel dispatch, kwargs plumbing): its bf16 logits are as
    close to the float32 per-sequence logits as bf16 sdpa per sequence is."""
    seq_lens = [50, 3, 120, 17]
    ids = _packed_batch(seq_lens, device="cuda")
    # Same seed on the same device gives the same weights; cast after init so all three agree.
    exact = _model("tiny", "sdpa", "cuda", torch.float32)
    packed = _model("tiny", ATTN_NAME, "cuda", torch.float32).to(torch.bfloat16)
    bf16_sdpa = _model("tiny", "sdpa", "cuda", torch.float32).to(torch.bfloat16)
    with torch.no_grad():
        ref = _unpacked_logits(exact, ids, seq_lens)
        got = packed(input_ids=ids, **packed_forward_kwargs(seq_lens, device="cuda")).logits
        baseline = _unpacked_logits(bf16_sdpa, ids, seq_lens)
    assert _max_err(got, ref) <= 2 * _max_err(baseline, ref) + 1e-2
