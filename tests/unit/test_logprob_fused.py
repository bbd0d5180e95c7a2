"""The fused Triton log-prob/entropy path (minirl/kernels/logprob.py) equals the float64 computation.

Values (log-probs, entropies) and gradients (to the logits; through chunked_logprobs, to the
hidden states and the head weight) for random upstream gradients on both outputs. Without a GPU
the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
anything imports triton) at small vocabularies and block sizes, so a row spans several blocks and
the online max rescales; with one they run compiled, and the gpu-marked test checks the real
vocabulary against the plain path.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_interpreter import interpreter_fixes, require_interpreter

CUDA = torch.cuda.is_available()
if not CUDA:
    require_interpreter()

from minirl.forward import logprob  # noqa: E402
from minirl.forward.logprob import chunked_logprobs  # noqa: E402
from minirl.kernels import logprob as lt  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with contextlib.nullcontext() if CUDA else interpreter_fixes():
        yield


@contextlib.contextmanager
def blocks(fwd: int, bwd: int):
    saved = lt.FWD_BLOCK, lt.BWD_BLOCK
    lt.FWD_BLOCK, lt.BWD_BLOCK = fwd, bwd
    try:
        yield
    finally:
        lt.FWD_BLOCK, lt.BWD_BLOCK = saved


def reference64(z_nV, labels_n, temperature, g_logp_n, g_ent_n):
    """float64 log_softmax(z / T)[y], −Σ p log p, and the gradient of Σ g_l·logp + Σ g_H·H to z."""
    z = z_nV.detach().double().requires_grad_()
    logp_nV = torch.log_softmax(z / temperature, dim=-1)
    logp_n = logp_nV.gather(-1, labels_n[:, None]).squeeze(-1)
    ent_n = -(logp_nV.exp() * logp_nV).sum(-1)
    loss = 0.0
    if g_logp_n is not None:
        loss = loss + (g_logp_n.double() * logp_n).sum()
    if g_ent_n is not None:
        loss = loss + (g_ent_n.double() * ent_n).sum()
    grad = torch.autograd.grad(loss, [z])[0] if torch.is_tensor(loss) else None
    return logp_n.detach(), ent_n.detach(), grad


def _logits(gen, n, vocab, scale, spike, labels_n):
    z = scale * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
    if spike == "label":  # near-one-hot on the label
        z[torch.arange(n), labels_n] += 40.0 + scale
    elif spike == "other":  # near-one-hot elsewhere: the label's probability underflows
        z[:, vocab // 3] += 40.0 + scale
    return z


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    vocab=st.sampled_from([1000, 1537, 3001]),
    block=st.sampled_from([256, 1024, 4096]),
    temperature=st.sampled_from([1.0, 0.6, 1.3, 0.25]),
    scale=st.sampled_from([0.1, 3.0, 30.0, 300.0]),
    spike=st.sampled_from(["none", "label", "other"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_entropy=st.booleans(),
    upstream=st.sampled_from(["both", "logp", "entropy"]),
)
def test_kernels_equal_float64(seed, n, vocab, block, temperature, scale, spike, dtype, with_entropy, upstream):
    """Forward and backward of the fused Function on logits z in fp32 or bf16 equal the float64
    log-softmax/entropy of those very values, for labels anywhere (edges included), logits from
    near-uniform to near-one-hot, rows of one or many blocks, and either upstream gradient absent."""
    gen = torch.Generator().manual_seed(seed)
    labels_n = torch.randint(0, vocab, (n,), generator=gen)
    labels_n[0] = 0
    labels_n[-1] = vocab - 1
    z_nV = _logits(gen, n, vocab, scale, spike, labels_n).to(dtype).to(DEVICE).requires_grad_()
    labels_n = labels_n.to(DEVICE)
    g_logp_n = torch.randn(n, generator=gen).to(DEVICE) if upstream != "entropy" else None
    g_ent_n = torch.randn(n, generator=gen).to(DEVICE) if upstream != "logp" and with_entropy else None
    ref_logp, ref_ent, ref_grad = reference64(z_nV, labels_n, temperature, g_logp_n, g_ent_n)

    with blocks(block, block):
        logp_n, ent_n = lt.fused_logprob_entropy(z_nV, labels_n, temperature, with_entropy)
        outputs = [(logp_n, g_logp_n), (ent_n, g_ent_n)]
        outputs = [(o, g) for o, g in outputs if g is not None]
        grad = None
        if outputs:
            (grad,) = torch.autograd.grad([o for o, _ in outputs], [z_nV], [g for _, g in outputs])

    assert logp_n.dtype == ent_n.dtype == torch.float32
    s_max = float(z_nV.detach().double().abs().max()) / temperature  # float32 errors scale with |z / T|
    tol = 2e-6 * (1.0 + s_max)
    torch.testing.assert_close(logp_n.double(), ref_logp, rtol=1e-6, atol=tol)
    if with_entropy:
        torch.testing.assert_close(ent_n.double(), ref_ent, rtol=1e-5, atol=tol)
    else:
        assert not ent_n.requires_grad and bool((ent_n == 0).all())
    if grad is None:
        return
    assert grad.dtype == dtype
    # bf16 rounds every gradient element: one bf16 ulp (2^-8 relative) plus the fp32 error
    rtol = 8e-3 if dtype == torch.bfloat16 else 1e-5
    g_max = float(ref_grad.abs().max())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=rtol, atol=1e-6 * (1.0 + s_max) * (1.0 + g_max))


@pytest.mark.parametrize("slope", [0.004, 0.02, -0.02])
@pytest.mark.parametrize("block", [128, 512])
def test_online_max_rescaling(slope, block):
    """Rows whose maximum moves block after block (rising ramps: every block rescales the running
    sums; falling ramps: none does) plus noise, several blocks a row: entropy, log-prob and
    gradient equal float64. This is where a wrong rescale of Σ exp·(s − m) would show."""
    gen = torch.Generator().manual_seed(11)
    vocab = 1537
    ramp = slope * torch.arange(vocab, dtype=torch.float64)
    z_nV = (ramp + 0.5 * torch.randn(4, vocab, generator=gen, dtype=torch.float64)).float().to(DEVICE)
    z_nV.requires_grad_()
    labels_n = torch.tensor([0, vocab - 1, 700, 1300], device=DEVICE)
    g_logp_n, g_ent_n = torch.randn(2, 4, generator=gen).to(DEVICE)
    ref_logp, ref_ent, ref_grad = reference64(z_nV, labels_n, 0.7, g_logp_n, g_ent_n)
    with blocks(block, block):
        logp_n, ent_n = lt.fused_logprob_entropy(z_nV, labels_n, 0.7, True)
        (grad,) = torch.autograd.grad([logp_n, ent_n], [z_nV], [g_logp_n, g_ent_n])
    torch.testing.assert_close(logp_n.double(), ref_logp, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(ent_n.double(), ref_ent, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


@settings(max_examples=12, deadline=None)  # each example runs two autograd passes
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 10),
    chunk=st.integers(1, 7),
    temperature=st.sampled_from([1.0, 0.6, 1.3]),
    recompute=st.booleans(),
    with_entropy=st.booleans(),
)
def test_chunked_fused_gradients_to_hidden_and_head_equal_float64(seed, n, chunk, temperature, recompute, with_entropy):
    """chunked_logprobs(impl="fused") through an nn.Linear head, chunked and checkpointed: values
    and the gradients to the hidden states and to the head weight equal the float64 computation,
    for random upstream gradients on both outputs."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = 8, 1000
    head = torch.nn.Linear(hidden, vocab, bias=False).to(DEVICE)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen))
    h_NH = torch.randn(n, hidden, generator=gen).to(DEVICE).requires_grad_()
    y_N = torch.randint(0, vocab, (n,), generator=gen).to(DEVICE)
    g_logp, g_ent = torch.randn(2, n, generator=gen).to(DEVICE)

    w64, h64 = head.weight.detach().double().requires_grad_(), h_NH.detach().double().requires_grad_()
    logp_nV = torch.log_softmax((h64 @ w64.T) / temperature, -1)
    ref_logp = logp_nV.gather(-1, y_N[:, None]).squeeze(-1)
    ref_ent = -(logp_nV.exp() * logp_nV).sum(-1)
    ref_loss = (g_logp.double() * ref_logp).sum() + ((g_ent.double() * ref_ent).sum() if with_entropy else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, [h64, w64])

    with blocks(256, 512):
        logp, ent = chunked_logprobs(
            h_NH, head, y_N, temperature, chunk_size=chunk, with_entropy=with_entropy, recompute=recompute, impl="fused"
        )
        loss = (g_logp * logp).sum() + ((g_ent * ent).sum() if with_entropy else 0.0)
        grads = torch.autograd.grad(loss, [h_NH, head.weight])

    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    assert (ent is None) == (not with_entropy)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_fused_keeps_no_float32_vocabulary_tensor():
    """With a bf16 head and recompute=False, the fused path keeps each chunk's bf16 logits and
    16 bytes a row for backward, never a float32 [n, V] tensor; the plain path keeps several."""
    gen = torch.Generator().manual_seed(3)
    n, hidden, vocab = 12, 4, 1000
    head = torch.nn.Linear(hidden, vocab, bias=False).to(DEVICE, torch.bfloat16)
    h_NH = torch.randn(n, hidden, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    y_N = torch.randint(0, vocab, (n,), generator=gen).to(DEVICE)
    for impl, expect_fp32_vocab in (("fused", False), ("plain", True)):
        big_fp32: list[torch.Tensor] = []

        def pack(t, big_fp32=big_fp32):
            if t.dtype == torch.float32 and t.numel() >= 4 * vocab:
                big_fp32.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), blocks(512, 512):
            logp, ent = chunked_logprobs(
                h_NH, head, y_N, 0.8, chunk_size=4, with_entropy=True, recompute=False, impl=impl
            )
        assert bool(big_fp32) == expect_fp32_vocab, impl
        (logp.sum() + ent.sum()).backward()
        assert torch.isfinite(h_NH.grad).all()
        h_NH.grad = None


def test_out_of_range_label_is_nan_and_no_grad_path_matches():
    """A label outside [0, V) reads nothing out of bounds and gives NaN; under no_grad the fused
    path returns the plain path's values and saves nothing."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(3, 1000, generator=gen).to(DEVICE)
    logp, _ = lt.fused_logprob_entropy(z, torch.tensor([5, 1000, -1], device=DEVICE), 1.0, False)
    assert bool(torch.isfinite(logp[0])) and bool(torch.isnan(logp[1:]).all())
    head = torch.nn.Linear(6, 1000, bias=False).to(DEVICE)
    h, y = torch.randn(7, 6, generator=gen).to(DEVICE), torch.randint(0, 1000, (7,), generator=gen).to(DEVICE)
    with torch.no_grad(), blocks(512, 512):
        fused = chunked_logprobs(h, head, y, 0.7, chunk_size=3, with_entropy=True, impl="fused")
        plain = chunked_logprobs(h, head, y, 0.7, chunk_size=3, with_entropy=True, impl="plain")
    for got, ref in zip(fused, plain, strict=True):
        assert not got.requires_grad
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_impl_switch(monkeypatch):
    """auto picks the fused kernels exactly on CUDA where they check out; fused/plain force
    either; anything else names the variable and the choices."""
    monkeypatch.setattr(logprob, "fused_works", lambda device: True)
    assert logprob.use_fused(torch.device("cpu"), "auto") is False
    assert logprob.use_fused(torch.device("cuda"), "auto") is True
    monkeypatch.setattr(logprob, "fused_works", lambda device: False)
    assert logprob.use_fused(torch.device("cuda"), "auto") is False
    assert logprob.use_fused(torch.device("cpu"), "fused") is True
    assert logprob.use_fused(torch.device("cuda"), "plain") is False
    with pytest.raises(ValueError, match="MINIRL_LOGPROB_IMPL.*auto, fused, plain"):
        logprob.use_fused(torch.device("cpu"), "triton")


def test_self_check_passes_and_rejects_a_wrong_kernel(monkeypatch):
    """The once-per-device check accepts the real kernels and turns a kernel that is off (here by
    a shifted log-prob) or raises into a warning and the plain path."""
    logprob.fused_works.cache_clear()
    try:
        with torch.inference_mode():  # the first caller's mode does not matter
            assert logprob.fused_works(str(DEVICE)) is True
        logprob.fused_works.cache_clear()
        real = lt.fused_logprob_entropy

        def shifted(z, labels, temperature, with_entropy):
            logp, ent = real(z, labels, temperature, with_entropy)
            return logp + 1e-2, ent

        monkeypatch.setattr(lt, "fused_logprob_entropy", shifted)
        with pytest.warns(UserWarning, match="disagree with the plain path"):
            assert logprob.fused_works(str(DEVICE)) is False
        logprob.fused_works.cache_clear()
        monkeypatch.setattr(lt, "fused_logprob_entropy", None)
        with pytest.warns(UserWarning, match="failed .TypeError"):
            assert logprob.fused_works(str(DEVICE)) is False
    finally:
        logprob.fused_works.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_equals_plain_at_real_vocabulary(with_entropy):
    """On CUDA at Qwen2's vocabulary (151,936) under bf16 autocast over fp32 weights, as the actor
    runs: auto picks the fused kernels (they pass their self-check), their log-probs/entropies
    equal float64 ones of the same bf16 logits, and their gradients to the hidden states and the
    head equal the plain path's (both round grad_z to bf16)."""
    assert logprob.use_fused(torch.device("cuda"), "auto"), "the kernels failed their self-check"
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab, temperature = 3000, 1536, 151_936, 0.6
    head = torch.nn.Linear(hidden, vocab, bias=False, device="cuda")
    with torch.no_grad():
        head.weight.normal_(0.0, 0.05, generator=gen)
    h_NH = torch.randn(n, hidden, device="cuda", generator=gen).requires_grad_()
    y_N = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    y_N[:2] = torch.tensor([0, vocab - 1])
    g_logp, g_ent = torch.randn(2, n, device="cuda", generator=gen)
    results = {}
    for impl in ("fused", "plain"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = chunked_logprobs(
                h_NH, head, y_N, temperature, chunk_size=1024, with_entropy=with_entropy, impl=impl
            )
        loss = (g_logp * logp).sum() + ((g_ent * ent).sum() if with_entropy else 0.0)
        results[impl] = (logp, ent, *torch.autograd.grad(loss, [h_NH, head.weight]))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        z_nV = head(h_NH)
    ref_logp, ref_ent, _ = reference64(z_nV, y_N, temperature, None, None)
    logp, ent, g_h, g_w = results["fused"]
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=2e-5)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-5)
    for got, ref in ((g_h, results["plain"][2]), (g_w, results["plain"][3])):
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 5e-3, rel
