"""The native engine's generation is right, not just plausible.

Greedy output equals transformers' token for token; continuous batching, prompt sharing among
the n samples and preemption do not change greedy output; sampled tokens follow the softmax
(chi-square), with and without top-k/top-p; returned log-probs equal a full recompute; a weight
load changes outputs exactly as building a fresh engine with those weights; the KV cache can be
released and re-acquired.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from minirl.protocols import SamplingParams
from minirl_plugins.engines.native import build_native_engine
from minirl_plugins.engines.native.layers.sampling import filter_top_k_top_p
from minirl_plugins.engines.native.weights import weights_checksum
from tests.tiny_models import (
    PROMPTS,
    assert_greedy_agree_until_parted,
    engine_context,
    greedy,
    hf_greedy,
    tiny_config,
    tiny_hf_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def qwen2():
    cfg = tiny_config("qwen2")
    return cfg, tiny_hf_model(cfg, seed=2, std=0.2)


def _engine(cfg, actor, rollout=None, **extra):
    return build_native_engine(rollout, engine_context(cfg, actor=actor, **extra))


def test_greedy_equals_transformers(qwen2):
    cfg, hf = qwen2
    eng = _engine(cfg, hf, page_size=4)
    got = eng.generate(PROMPTS, greedy(max_new=20))
    for prompt, completion in zip(PROMPTS, got):
        assert completion.token_ids == hf_greedy(hf, prompt, 20)
        assert completion.finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_transformers_other_families(family):
    cfg = tiny_config(family)
    hf = tiny_hf_model(cfg, seed=3, std=0.2)
    got = _engine(cfg, hf).generate(PROMPTS[:2], greedy(max_new=10))
    assert [c.token_ids for c in got] == [hf_greedy(hf, p, 10) for p in PROMPTS[:2]]


def test_stop_on_eos_and_stop_tokens(qwen2):
    cfg, hf = qwen2
    ref = hf_greedy(hf, PROMPTS[0], 12)
    eos = ref[4]
    eng = _engine(cfg, hf, eos=(eos,))
    [c] = eng.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12))
    assert c.token_ids == ref[: ref.index(eos) + 1] and c.finish_reason == "stop"
    [c] = eng.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, stop_token_ids=(ref[2],))
    )
    assert c.token_ids == ref[: ref.index(ref[2]) + 1] and c.finish_reason == "stop"


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_continuous_batching_equals_one_by_one(qwen2, decode_steps):
    """Two slots for 8 prompts that stop at different steps: sequences leave and join (also with
    several decode steps per host round trip, where tokens past a stop are dropped)."""
    cfg, hf = qwen2
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [11] * 5, [200, 201], list(range(250, 290))]
    eng = _engine(cfg, hf, page_size=4)
    free = [eng.generate([p], greedy(max_new=16))[0].token_ids for p in prompts]
    stop = free[0][6]  # a token that ends some sequences early
    params = greedy(max_new=16, stop_token_ids=(stop,))
    one_by_one = [eng.generate([p], params)[0] for p in prompts]
    batched = _engine(cfg, hf, SimpleNamespace(max_num_seqs=2), page_size=4, decode_steps=decode_steps).generate(
        prompts, params
    )
    assert [c.token_ids for c in batched] == [c.token_ids for c in one_by_one]
    assert {c.finish_reason for c in batched} == {"stop", "length"}


def test_n_samples_share_prefill_and_preemption_keeps_output(qwen2):
    """Prompt lengths on and off page boundaries; a cache too small for all forces preemption."""
    cfg, hf = qwen2
    ref = [c.token_ids for c in _engine(cfg, hf, page_size=4).generate(PROMPTS, greedy(max_new=24))]
    for extra, preempts in (
        ({"page_size": 4}, False),
        ({"page_size": 4, "num_kv_pages": 24}, True),
        ({"page_size": 4, "num_kv_pages": 24, "decode_steps": 5}, True),
    ):
        eng = _engine(cfg, hf, **extra)
        got = eng.generate(PROMPTS, greedy(n=3, max_new=24))
        assert [c.token_ids for c in got] == [t for t in ref for _ in range(3)]
        assert (eng.last_stats["preemptions"] > 0) == preempts


def test_cache_is_sized_by_the_rows_of_one_call(qwen2):
    """max_batch_rows caps the cache at what those rows can fill at max_model_len (plus the scratch
    page), below the memory budget; a call of that many rows then never preempts, and a larger
    one runs in waves with the same greedy output."""
    cfg, hf = qwen2
    ref = [c.token_ids for c in _engine(cfg, hf, page_size=4).generate(PROMPTS, greedy(max_new=24))]
    rows = len(PROMPTS) * 3
    eng = _engine(cfg, hf, page_size=4, max_model_len=64, max_batch_rows=rows)
    assert eng.runner.num_pages == rows * (64 // 4 + 1) + 1  # a reserve page per row, the scratch page
    assert eng.runner.num_pages < _engine(cfg, hf, page_size=4, max_model_len=64).runner.num_pages
    got = eng.generate(PROMPTS, greedy(n=3, max_new=24))
    assert [c.token_ids for c in got] == [t for t in ref for _ in range(3)]
    assert eng.last_stats["preemptions"] == 0
    small = _engine(cfg, hf, page_size=4, max_model_len=64, max_batch_rows=2)
    got = small.generate(PROMPTS, greedy(n=3, max_new=24))
    assert [c.token_ids for c in got] == [t for t in ref for _ in range(3)]
    assert small.last_stats["preemptions"] > 0


@pytest.mark.parametrize(("prompt_len", "max_new", "n"), [(60, 3, 1), (20, 8, 2), (20, 8, 4), (30, 2, 16)])
def test_a_cache_sized_for_one_prompt_group_admits_it(qwen2, prompt_len, max_new, n):
    """The trainer's sizing at one prompt per rank (rows = n) and a short budget: the scheduler
    keeps a free page per running row when it admits a group, so the cache must count those."""
    cfg, hf = qwen2
    eng = _engine(cfg, hf, page_size=16, max_model_len=prompt_len + max_new, max_batch_rows=n)
    got = eng.generate([list(range(3, 3 + prompt_len))], greedy(n=n, max_new=max_new))
    assert [len(c.token_ids) for c in got] == [max_new] * n


def test_logprobs_equal_full_recompute(qwen2):
    cfg, hf = qwen2
    eng = _engine(cfg, hf, page_size=4)
    temperature = 0.7
    got = eng.generate(PROMPTS[:2], SamplingParams(n=3, temperature=temperature, max_new_tokens=15, seed=0))
    for i, c in enumerate(got):
        prompt = PROMPTS[i // 3]
        logits = eng.logits(prompt + c.token_ids)[len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=1e-4)
    [g] = eng.generate(PROMPTS[:1], greedy(max_new=5))
    logits = eng.logits(PROMPTS[0] + g.token_ids)[len(PROMPTS[0]) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-4, rtol=1e-4)


def _chi2_critical(df, z=3.09):  # Wilson-Hilferty, p = 0.001
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (6, 1.0), (-1, 0.7), (8, 0.8)])
def test_sampled_frequencies_match_softmax(top_k, top_p):
    cfg = tiny_config("qwen2", vocab_size=16)
    hf = tiny_hf_model(cfg, seed=5, std=0.5)
    eng = _engine(cfg, hf)
    prompt, temperature, n = [1, 2, 3], 0.9, 6000
    out = eng.generate(
        [prompt], SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=11)
    )
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=16).double()
    logits = eng.logits(prompt)[-1:].float() / temperature
    probs = torch.softmax(filter_top_k_top_p(logits, top_k, top_p), -1)[0].double()
    assert counts[probs == 0].sum() == 0, "sampled a filtered token"
    expected = probs[probs > 0] * n
    chi2 = ((counts[probs > 0] - expected) ** 2 / expected).sum().item()
    assert chi2 < _chi2_critical(int((probs > 0).sum()) - 1), (chi2, counts, expected)


def test_seed_makes_sampling_reproducible(qwen2):
    cfg, hf = qwen2
    eng = _engine(cfg, hf)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=123, ignore_eos=True)
    a, b = eng.generate(PROMPTS, params), eng.generate(PROMPTS, params)
    c = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=124, ignore_eos=True))
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]


def test_weight_load_equals_fresh_engine(qwen2):
    cfg, hf = qwen2
    other = tiny_hf_model(cfg, seed=9, std=0.2)
    eng = _engine(cfg, hf)
    before = eng.generate(PROMPTS, greedy())
    assert eng.checksum() == weights_checksum(hf.named_parameters(), torch.float32)
    assert eng.checksum() != weights_checksum(other.named_parameters(), torch.float32)
    eng.load_weights(other.state_dict().items())
    assert eng.checksum() == weights_checksum(other.named_parameters(), torch.float32)
    after = eng.generate(PROMPTS, greedy())
    fresh = _engine(cfg, other).generate(PROMPTS, greedy())
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh] != [c.token_ids for c in before]


def test_checksum_catches_one_changed_element(qwen2):
    cfg, hf = qwen2
    eng = _engine(cfg, hf)
    ref = eng.checksum()
    with torch.no_grad():
        eng.model.model.layers[1].mlp.down_proj.weight[3, 7] += 1e-3
    assert eng.checksum() != ref


def test_release_and_resume_memory(qwen2):
    cfg, hf = qwen2
    eng = _engine(cfg, hf)
    before = eng.generate(PROMPTS, greedy())
    eng.release_memory()
    assert eng.runner.kv is None
    eng.resume_memory()
    assert eng.runner.kv is not None
    assert [c.token_ids for c in eng.generate(PROMPTS, greedy())] == [c.token_ids for c in before]
    eng.release_memory()  # generate re-acquires the cache by itself
    assert [c.token_ids for c in eng.generate(PROMPTS, greedy())] == [c.token_ids for c in before]


def test_last_stats_account_for_the_cache_and_graphs(qwen2, monkeypatch):
    """last_stats (logged as timing_s/gen.* and rollout/*): the seconds spent re-allocating the
    KV cache for this generate (none when it was kept), in releasing it after, and in CUDA-graph
    captures (none on the CPU) with their count."""
    import time

    cfg, hf = qwen2
    eng = _engine(cfg, hf)
    eng.generate(PROMPTS, greedy())
    assert eng.last_stats["kv_resume_s"] == 0.0  # allocated at construction, kept
    assert eng.last_stats["graph_captures"] == 0 and eng.last_stats["graph_capture_s"] == 0.0
    release, allocate = eng.runner.release, eng.runner.allocate_kv

    def slowly(fn):
        def slow():
            time.sleep(0.05)
            fn()

        return slow

    monkeypatch.setattr(eng.runner, "release", slowly(release))
    eng.release_memory()
    assert 0.05 <= eng.last_stats["kv_release_s"] < 5
    monkeypatch.setattr(eng.runner, "allocate_kv", slowly(allocate))
    eng.resume_memory()
    eng.resume_memory()  # a no-op: the cache is there
    eng.generate(PROMPTS, greedy())
    assert 0.05 <= eng.last_stats["kv_resume_s"] < 5
    eng.generate(PROMPTS, greedy())
    assert eng.last_stats["kv_resume_s"] == 0.0
    # what it holds, each storage once (q/k/v and gate/up are views into fused weights)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**30
    assert eng.last_stats["weights_gib"] == pytest.approx(weights * eng.dtype.itemsize / 4, rel=1e-9)
    assert eng.last_stats["kv_cache_gib"] == eng.runner.kv.numel() * eng.runner.kv.element_size() / 2**30


def test_bad_requests_are_clear_errors(qwen2):
    cfg, hf = qwen2
    eng = _engine(cfg, hf)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.generate([[1] * 250], greedy(max_new=10))
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[1, 300]], greedy())


def test_registered_as_native():
    import minirl_plugins.engines.native as native

    assert native.minirl_rollout_engines() == {"native": native.build_native_engine}


def _logprob_drift(engine, exact) -> torch.Tensor:
    """|sampled-token log-prob - full-precision recompute| over a sampled batch."""
    got = engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=1, ignore_eos=True))
    drift = []
    for i, c in enumerate(got):
        prompt = PROMPTS[i // 2]
        logits = exact.logits(prompt + c.token_ids)[len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        drift.append((torch.tensor(c.logprobs) - ref).abs())
    return torch.cat(drift)


def test_fp8_kv_cache_rounds_keys_and_values_to_its_precision_and_nothing_else(qwen2, monkeypatch):
    """rollout.kv_cache_dtype = fp8 (e4m3) / fp8_e5m2: the cache holds 8-bit floats (a quarter of
    float32's bytes per token) and decode reads them back. The log-prob drift against a
    full-precision recompute must come from rounding alone, so it scales with the format's
    mantissa: a bf16 cache (7 bits) drifts 2^4 times less than e4m3 (3 bits), which drifts half
    as much as e5m2 (2 bits). A wrong cache (zeros) drifts about 30 times more than e4m3 here."""
    from minirl_plugins.engines.native import config as native_config

    monkeypatch.setitem(native_config.KV_CACHE_DTYPES, "bfloat16", torch.bfloat16)  # the reference rung
    cfg, hf = qwen2
    exact = _engine(cfg, hf, page_size=4)
    drift = {}
    for kv in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
        eng = _engine(cfg, hf, SimpleNamespace(kv_cache_dtype=kv), page_size=4)
        assert eng.runner.kv_bytes_per_token * 4 == exact.runner.kv_bytes_per_token * eng.runner.kv.dtype.itemsize
        drift[kv] = float(_logprob_drift(eng, exact).mean())
    print({k: round(v, 5) for k, v in drift.items()})  # measured: auto 1e-6, bf16 0.0057, e4m3 0.092, e5m2 0.17
    assert drift["auto"] < 1e-4
    assert 8 < drift["fp8"] / drift["bfloat16"] < 32
    assert 1.3 < drift["fp8_e5m2"] / drift["fp8"] < 3
    assert drift["fp8"] < 0.2


def test_fp8_gemms_drift_by_their_rounding_alone_and_follow_every_load(qwen2, monkeypatch):
    """rollout.quantization = fp8: every layer's qkv, o, gate/up and down GEMM runs on e4m3 copies
    (buffers, in the engine's memory count). The log-prob drift against a full-precision recompute
    comes from the roundings alone, so it scales with the format's mantissa: the same path rounding
    to bf16 (7 bits) drifts about 2^4 times less than e4m3 (3 bits), which drifts about half as much
    as e5m2 (2 bits); measured here 0.0149, 0.190 and 0.469. A load rewrites the copies: the engine
    then generates exactly what a fresh quantized engine over the new weights does, in one turn
    and in a conversation continued over its kept cache (extend attention)."""
    from minirl_plugins.engines.native.layers import fp8_linear
    from minirl_plugins.engines.native.layers.fp8_linear import Fp8Weight

    cfg, hf = qwen2
    exact, rollout = _engine(cfg, hf), SimpleNamespace(quantization="fp8")
    eng = _engine(cfg, hf, rollout)
    copies = [m for m in eng.model.modules() if isinstance(m, Fp8Weight)]
    assert eng.fp8_matrices == len(copies) == 4 * cfg.num_hidden_layers and exact.fp8_matrices == 0
    extra = sum(m.q.numel() + 8 for m in copies) / 2**30  # and two float32 scalars
    assert eng.memory_gib()["weights_gib"] == pytest.approx(exact.memory_gib()["weights_gib"] + extra)
    drift = {"e4m3": float(_logprob_drift(eng, exact).mean())}
    for name, fmt, top in (("bf16", torch.bfloat16, 448.0), ("e5m2", torch.float8_e5m2, 57344.0)):
        monkeypatch.setattr(fp8_linear, "E4M3", fmt)
        monkeypatch.setattr(fp8_linear, "E4M3_MAX", top)
        drift[name] = float(_logprob_drift(_engine(cfg, hf, rollout), exact).mean())
    monkeypatch.undo()
    print({k: round(v, 4) for k, v in drift.items()})
    assert 8 < drift["e4m3"] / drift["bf16"] < 32 and 1.5 < drift["e5m2"] / drift["e4m3"] < 4
    assert drift["e4m3"] < 0.3
    other = tiny_hf_model(cfg, seed=9, std=0.2)
    eng.load_weights(other.state_dict().items())
    fresh = _engine(cfg, other, rollout)
    after, want = (e.generate(PROMPTS, greedy()) for e in (eng, fresh))
    assert [(c.token_ids, c.logprobs) for c in after] == [(c.token_ids, c.logprobs) for c in want]
    assert _two_turns(eng) == _two_turns(fresh)


def test_fp8_cache_through_preemption_and_extend_generates_the_same_twice(qwen2):
    """An 8-bit cache through every writer and reader of it (rotary's store, prefill, extend and
    decode attention, the page copies of prompt sharing, preemption): two fresh engines give
    bit-identical tokens and log-probs."""
    cfg, hf = qwen2
    rollout = SimpleNamespace(kv_cache_dtype="fp8")
    outs = []
    for _ in range(2):
        eng = _engine(cfg, hf, rollout, page_size=4, num_kv_pages=24)
        got = eng.generate(PROMPTS, greedy(n=3, max_new=24))
        assert eng.last_stats["preemptions"] > 0
        outs.append([(c.token_ids, c.logprobs) for c in got] + _two_turns(eng))
    assert outs[0] == outs[1]


def _two_turns(eng) -> list:
    """A conversation continued once: the second turn prefills only its new tokens and attends to
    the first turn's cached ones (extend attention)."""
    turns, ctx = [], list(PROMPTS[0])
    for _ in range(2):
        eng.submit("chat", ctx, greedy(max_new=6))
        while eng.has_work():
            turns += [(t.token_ids, t.logprobs) for t in eng.step()]
        ctx = ctx + turns[-1][0] + [7, 8, 9]
    return turns


def test_greedy_agreement_allows_a_near_tie_to_part_the_runs_and_nothing_else():
    """assert_greedy_agree_until_parted, which the GPU tests put two kernels' greedy runs through:
    a parting at a near tie passes; log-probs apart before the parting, or a parting far from a
    tie (a broken kernel's), fail."""
    Run = SimpleNamespace
    want = Run(token_ids=[4, 9, 2, 7], logprobs=[-0.5, -1.0, -0.70, -0.2])
    near_tie = Run(token_ids=[4, 9, 3, 1], logprobs=[-0.5, -1.1, -0.72, -3.0])  # after the parting: anything
    assert_greedy_agree_until_parted([near_tie], [want], atol=0.25)
    assert_greedy_agree_until_parted([want], [want], atol=0.0)
    drifted = Run(token_ids=[4, 9, 2, 7], logprobs=[-0.5, -1.4, -0.70, -0.2])
    far_parting = Run(token_ids=[4, 9, 3, 7], logprobs=[-0.5, -1.0, -2.50, -0.2])
    for bad in (drifted, far_parting):
        with pytest.raises(AssertionError):
            assert_greedy_agree_until_parted([bad], [want], atol=0.25)
