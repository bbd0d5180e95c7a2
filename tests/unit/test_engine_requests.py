"""The request-level engine API (submit / step / abort / release / pause), native and hf engines.

A continued request gives exactly the tokens of a fresh request over its whole conversation
(greedy), while prefilling only the new tokens; parked KV is evicted under memory pressure
without changing any output; submitting a request's samples one by one equals submitting it
with n; abort, release, pause and the sampler rule behave as minirl.protocols documents.
"""

from types import SimpleNamespace

import pytest
import torch

from minirl.agent.server import request_level
from minirl.protocols import SamplingParams, generate_batch, sample_ids
from minirl_plugins.engines.hf import HFEngine
from minirl_plugins.engines.native import build_native_engine
from tests.tiny_models import PROMPTS, engine_context, greedy, tiny_config, tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def qwen2():
    cfg = tiny_config("qwen2")
    return cfg, tiny_hf_model(cfg, seed=2, std=0.2)


def _native(cfg, actor, rollout=None, **extra):
    return build_native_engine(rollout, engine_context(cfg, actor=actor, **extra))


def _hf(cfg, actor):
    """The hf engine has the batch level only: the request level is GenerateOnly over it."""
    return request_level(HFEngine(SimpleNamespace(max_num_seqs=8), engine_context(cfg, actor=actor)))


def _run(engine):
    """Step until idle; sample id -> TurnOutput."""
    done = {}
    while engine.has_work():
        done.update((t.request_id, t) for t in engine.step())
    return done


TOOL = [7, 8, 9, 10, 11]  # a "tool message" appended between turns


def _three_turns(engine, prompts, max_new=6):
    """Every prompt: turn, append TOOL, turn, append TOOL, turn; all requests interleaved."""
    contexts = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    turns = {rid: [] for rid in contexts}
    for turn in range(3):
        for rid, ctx in contexts.items():
            engine.submit(rid, ctx, greedy(max_new=max_new))
        for rid, out in _run(engine).items():
            turns[rid].append(out)
            contexts[rid] = contexts[rid] + out.token_ids + (TOOL if turn < 2 else [])
    return contexts, turns


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_continuation_equals_a_fresh_request_over_the_whole_conversation(qwen2, decode_steps):
    cfg, hf = qwen2
    eng = _native(cfg, hf, page_size=4, decode_steps=decode_steps)
    contexts, turns = _three_turns(eng, PROMPTS)
    fresh = _native(cfg, hf, page_size=4)
    for i, p in enumerate(PROMPTS):
        rid, ctx = f"r{i}", list(p)
        for turn, out in enumerate(turns[rid]):
            [want] = fresh.generate([ctx], greedy(max_new=6))
            assert out.token_ids == want.token_ids, (rid, turn)
            assert out.logprobs == pytest.approx(want.logprobs, abs=1e-4)
            ctx = ctx + out.token_ids + (TOOL if turn < 2 else [])
        assert contexts[rid] == ctx


def test_continuation_prefills_only_the_new_tokens(qwen2):
    cfg, hf = qwen2
    eng = _native(cfg, hf, page_size=4)
    _, turns = _three_turns(eng, PROMPTS[:2])
    for rid, outs in turns.items():
        assert outs[0].cached_tokens == 0
        for out in outs[1:]:
            # everything but the last sampled token (never fed back) stays cached
            assert out.cached_tokens > 0
        first_ctx = len(PROMPTS[int(rid[1:])]) + len(outs[0].token_ids) - 1
        assert outs[1].cached_tokens == first_ctx


def test_parked_kv_is_evicted_under_pressure_without_changing_outputs(qwen2):
    cfg, hf = qwen2
    roomy = _native(cfg, hf, page_size=4)
    tight = _native(cfg, hf, SimpleNamespace(max_num_seqs=4), page_size=4, num_kv_pages=24)
    _, want = _three_turns(roomy, PROMPTS)
    _, got = _three_turns(tight, PROMPTS)
    assert tight.scheduler.num_evictions > 0
    for rid in want:
        assert [t.token_ids for t in got[rid]] == [t.token_ids for t in want[rid]]
    assert any(t.cached_tokens == 0 for outs in got.values() for t in outs[1:])  # some were recomputed


def test_samples_submitted_one_by_one_equal_one_request_of_n(qwen2):
    cfg, hf = qwen2
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=4)
    eng = _native(cfg, hf)
    want = eng.generate(PROMPTS, params)
    single = SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=4)
    for i, p in enumerate(PROMPTS):
        for sid in sample_ids(f"p{i}", 3):
            eng.submit(sid, p, single)
    done = _run(eng)
    got = [done[sid] for i in range(len(PROMPTS)) for sid in sample_ids(f"p{i}", 3)]
    assert [t.token_ids for t in got] == [c.token_ids for c in want]
    assert [t.logprobs for t in got] == [c.logprobs for c in want]


def test_generate_is_the_request_level_helper(qwen2):
    cfg, hf = qwen2
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=9)
    want = _native(cfg, hf).generate(PROMPTS, params)
    eng = _native(cfg, hf)
    got = generate_batch(eng, PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert not eng.requests  # everything released


def test_abort_returns_the_partial_turn_and_frees_the_request(qwen2):
    cfg, hf = qwen2
    eng = _native(cfg, hf, page_size=4)
    eng.submit("a", PROMPTS[0], greedy(max_new=40))
    eng.submit("b", PROMPTS[1], greedy(max_new=8))
    outs = []
    for _ in range(4):
        outs += eng.step()
    eng.abort("a")
    done = {t.request_id: t for t in outs}
    done.update(_run(eng))
    assert done["a"].finish_reason == "abort" and len(done["a"].token_ids) < 40
    assert done["b"].finish_reason in ("stop", "length")
    # an aborted request can continue: its KV is gone, so it prefills everything again
    ctx = PROMPTS[0] + done["a"].token_ids + TOOL
    eng.submit("a", ctx, greedy(max_new=4))
    [again] = _run(eng).values()
    assert again.cached_tokens == 0
    [want] = _native(cfg, hf, page_size=4).generate([ctx], greedy(max_new=4))
    assert again.token_ids == want.token_ids


def test_pause_keeps_requests_and_weights_apply_after_continue(qwen2):
    cfg, hf = qwen2
    eng = _native(cfg, hf, page_size=4)
    eng.submit("a", PROMPTS[0], greedy(max_new=30))
    first = eng.step() + eng.step()
    eng.pause_generation()
    with pytest.raises(RuntimeError, match="paused"):
        eng.step()
    eng.load_weights(hf.named_parameters())  # the same weights: nothing may change
    eng.continue_generation()
    [out] = first + list(_run(eng).values())
    [want] = _native(cfg, hf, page_size=4).generate([PROMPTS[0]], greedy(max_new=30))
    assert out.token_ids == want.token_ids


def test_bad_submits_are_refused_with_the_reason(qwen2):
    cfg, hf = qwen2
    eng = _native(cfg, hf)
    eng.submit("a", PROMPTS[0], greedy(max_new=5))
    with pytest.raises(ValueError, match="still running"):
        eng.submit("a", PROMPTS[0], greedy(max_new=5))
    with pytest.raises(ValueError, match="temperature"):
        eng.submit("b", PROMPTS[1], SamplingParams(temperature=0.7, max_new_tokens=5))
    out = _run(eng)["a"]
    with pytest.raises(ValueError, match="must start with"):
        eng.submit("a", PROMPTS[1] + out.token_ids, greedy(max_new=5))
    eng.release("a")
    eng.submit("a", PROMPTS[1], greedy(max_new=5))  # a released id is free again
    assert _run(eng)["a"].cached_tokens == 0


def test_release_memory_keeps_held_requests_continuable(qwen2):
    cfg, hf = qwen2
    eng = _native(cfg, hf, page_size=4)
    eng.submit("a", PROMPTS[0], greedy(max_new=5))
    out = _run(eng)["a"]
    eng.release_memory()
    eng.resume_memory()
    ctx = PROMPTS[0] + out.token_ids + TOOL
    eng.submit("a", ctx, greedy(max_new=5))
    again = _run(eng)["a"]
    [want] = _native(cfg, hf, page_size=4).generate([ctx], greedy(max_new=5))
    assert again.token_ids == want.token_ids and again.cached_tokens == 0


def test_a_generate_only_engine_speaks_the_same_protocol(qwen2):
    cfg, hf = qwen2
    eng = _hf(cfg, hf)
    contexts, turns = _three_turns(eng, PROMPTS[:2], max_new=5)
    native = _native(cfg, hf, page_size=4)
    _, want = _three_turns(native, PROMPTS[:2], max_new=5)
    for rid in want:
        assert [t.token_ids for t in turns[rid]] == [t.token_ids for t in want[rid]]
    eng.submit("x", PROMPTS[0], greedy(max_new=5))
    eng.abort("x")
    assert _run(eng)["x"].finish_reason == "abort"


def test_extend_attention_reference_matches_full_attention():
    """The extend path's masked SDPA over cached keys equals causal attention over the whole
    sequence at the new positions."""
    from minirl_plugins.engines.native.layers.attention import extend_attention, prefill_attention
    from minirl_plugins.engines.native.layers.meta import Heads, StepMeta

    torch.manual_seed(0)
    heads, n, cached = Heads(4, 2, 8), 11, 7
    qkv = torch.randn(n, (4 + 2 * 2) * 8, dtype=torch.float64)
    cu = torch.tensor([0, n], dtype=torch.int32)
    full = prefill_attention(qkv, StepMeta(True, cu, None, cu_seqlens_S1=cu, max_seqlen=n), heads, 0.3)
    k = qkv[:, 32:48].view(n, 2, 8)
    v = qkv[:, 48:].view(n, 2, 8)
    slots = torch.randperm(20)[:n]
    k_cache, v_cache = torch.zeros(20, 2, 8, dtype=torch.float64), torch.zeros(20, 2, 8, dtype=torch.float64)
    k_cache[slots], v_cache[slots] = k, v
    meta = StepMeta(True, slots[cached:], None, cu_seqlens_S1=torch.tensor([0, n - cached], dtype=torch.int32))
    meta.ctx_slots_M, meta.cu_ctx_S1, meta.max_ctx_len = slots, torch.tensor([0, n], dtype=torch.int32), n
    got = extend_attention(qkv[cached:], k_cache, v_cache, meta, heads, 0.3)
    torch.testing.assert_close(got, full[cached:], rtol=0, atol=1e-12)
