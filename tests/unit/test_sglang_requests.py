"""The sglang plugin's request level (submit / step / abort / release / pause) on every SGLang version.

Each test runs against the fake SGLang (tests/fakes/sglang) playing 0.4.10, 0.5.14 and 0.5.23. The
plugin maps the protocol onto one Engine.generate(input_ids=[...]) call per step, so the tests
check what reaches that call (one call, the right prompts, per-request sampling dicts) and what
comes back (token ids equal to transformers' greedy continuation, the protocol's ids and finish
reasons, cached_tokens from SGLang's radix cache); and that generate(), now generate_batch over
the request level, makes the very call the batch path made before, with the same results.
"""

import pytest
import torch

from minirl.errors import UserError
from minirl.protocols import SamplingParams
from tests.fakes import SGLANG_PROFILES, drop_fake_sglang, use_fake_sglang
from tests.tiny_models import engine_context, greedy, hf_greedy, tiny_config, tiny_hf_model

PROMPT = [5, 17, 42, 8]
TOOL = [3, 1, 4, 1, 5]  # tokens a tool message appends between two assistant turns

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _Rollout:
    def __init__(self, **kw):
        self.free_cache_engine = True
        self.gpu_memory_utilization = 0.5
        self.update_weights_bucket_megabytes = 512
        self.max_num_seqs = 64
        self.enforce_eager = False
        self.__dict__.update(kw)


@pytest.fixture(params=SGLANG_PROFILES)
def fake(request, monkeypatch):
    yield use_fake_sglang(monkeypatch, request.param)
    drop_fake_sglang()


@pytest.fixture(scope="module")
def qwen2():
    cfg = tiny_config("qwen2")
    return cfg, tiny_hf_model(cfg, seed=2, std=0.2)


def _engine(qwen2, eos=()):
    from minirl_plugins.engines.sglang import build_sglang_engine

    cfg, hf = qwen2
    return build_sglang_engine(_Rollout(), engine_context(cfg, actor=hf, eos=eos))


def _generate_calls(eng) -> list:
    return [detail for name, detail in eng.engine.calls if name == "generate"]


def test_submit_step_round_trip_in_one_generate_call(fake, qwen2):
    """Two requests with different max_new_tokens and stop ids go out in one Engine.generate call
    with a sampling dict each, and come back finished, in submit order, as transformers decodes."""
    eng, hf = _engine(qwen2), qwen2[1]
    other = [9, 8, 7, 6, 5, 4]
    want_a, want_b = hf_greedy(hf, PROMPT, 6), hf_greedy(hf, other, 3)
    eng.submit("a", PROMPT, greedy(max_new=6, stop_token_ids=(want_a[3],)))
    eng.submit("b", other, greedy(max_new=3))
    assert eng.has_work()
    turns = eng.step()
    assert not eng.has_work() and eng.step() == []
    assert [t.request_id for t in turns] == ["a", "b"]
    assert turns[0].token_ids == want_a[:4] and turns[0].finish_reason == "stop"
    assert turns[1].token_ids == want_b and turns[1].finish_reason == "length"
    assert [len(t.logprobs) for t in turns] == [4, 3] and [t.cached_tokens for t in turns] == [0, 0]
    assert _generate_calls(eng) == [2]
    input_ids, sampling = eng.engine.generate_args[-1]
    assert input_ids == [PROMPT, other]
    assert [s["max_new_tokens"] for s in sampling] == [6, 3] and sampling[0]["stop_token_ids"] == [want_a[3]]


def test_n_samples_come_back_under_their_sample_ids(fake, qwen2):
    eng = _engine(qwen2)
    eng.submit("r", PROMPT, greedy(n=3, max_new=4))
    turns = eng.step()
    assert [t.request_id for t in turns] == ["r/0", "r/1", "r/2"]
    assert {tuple(t.token_ids) for t in turns} == {tuple(hf_greedy(qwen2[1], PROMPT, 4))}
    assert eng.engine.generate_args[-1][0] == [PROMPT] * 3


def test_a_continuation_reuses_the_cached_prefix(fake, qwen2):
    """The next turn sends the whole conversation; SGLang's radix cache matches the earlier turn's
    tokens (all but the last sampled one, whose KV was never computed), and the turn decodes as a
    fresh greedy run on the whole context would. A first turn reports 0 even when SGLang matched
    an earlier request's prefix; after the weight sync's flush nothing is cached."""
    eng, hf = _engine(qwen2), qwen2[1]
    eng.submit("s", PROMPT, greedy(max_new=5))
    first = eng.step()[0]
    context = PROMPT + first.token_ids + TOOL
    eng.submit("s", context, greedy(max_new=4))
    second = eng.step()[0]
    assert second.token_ids == hf_greedy(hf, context, 4)
    assert second.cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    eng.submit("fresh", PROMPT + [1, 2], greedy(max_new=2))
    assert eng.step()[0].cached_tokens == 0  # SGLang matched PROMPT, but not from fresh's own turns
    eng.load_weights(hf.named_parameters())  # ends with flush_cache
    longer = context + second.token_ids
    eng.submit("s", longer, greedy(max_new=2))
    assert eng.step()[0].cached_tokens == 0


def test_a_continuation_must_extend_the_held_context(fake, qwen2):
    eng = _engine(qwen2)
    eng.submit("s", PROMPT, greedy(max_new=3))
    tokens = eng.step()[0].token_ids
    with pytest.raises(ValueError, match=r"request 's' continues a held request.*first at 4"):
        eng.submit("s", PROMPT + [tokens[0] + 1] + TOOL, greedy(max_new=2))
    with pytest.raises(ValueError, match="'s'.*first at 4"):
        eng.submit("s", PROMPT, greedy(max_new=2))  # the prompt alone drops the sampled tokens
    with pytest.raises(ValueError, match="n=2.*still held"):
        eng.submit("s", PROMPT + tokens, greedy(n=2, max_new=2))
    assert not eng.has_work()
    eng.submit("s", PROMPT + tokens, greedy(max_new=2))
    with pytest.raises(ValueError, match="'s' is still running"):
        eng.submit("s", PROMPT + tokens, greedy(max_new=2))


def test_abort_returns_the_queued_turn_without_tokens(fake, qwen2):
    eng = _engine(qwen2)
    eng.submit("a", PROMPT, greedy(max_new=3))
    eng.submit("b", [9, 8, 7], greedy(max_new=3))
    eng.abort("a")
    eng.abort("nobody")  # unknown ids are ignored
    a, b = eng.step()
    assert (a.request_id, a.token_ids, a.logprobs, a.finish_reason) == ("a", [], [], "abort")
    assert len(b.token_ids) == 3 and b.finish_reason == "length"
    assert eng.engine.generate_args[-1][0] == [[9, 8, 7]]  # the aborted prompt never went out
    eng.abort("b")  # finished: ignored
    eng.submit("c", PROMPT, greedy(max_new=3))
    eng.abort("c")
    assert [t.finish_reason for t in eng.step()] == ["abort"] and _generate_calls(eng) == [1]
    eng.submit("a", PROMPT + TOOL, greedy(max_new=2))  # an aborted request is held with its prompt
    assert eng.step()[0].finish_reason == "length"


def test_pause_refuses_step_until_continue(fake, qwen2):
    """Between steps nothing runs in SGLang; a paused engine queues but does not step, and the
    weights may be synced meanwhile."""
    eng = _engine(qwen2)
    eng.pause_generation()
    eng.submit("a", PROMPT, greedy(max_new=2))
    with pytest.raises(RuntimeError, match="paused; call continue_generation"):
        eng.step()
    eng.load_weights(qwen2[1].named_parameters())
    assert eng.has_work() and not _generate_calls(eng)
    eng.continue_generation()
    assert eng.step()[0].token_ids == hf_greedy(qwen2[1], PROMPT, 2)
    assert "pause_generation" not in {name for name, _ in eng.engine.calls}


def test_release_forgets_the_context(fake, qwen2):
    eng = _engine(qwen2)
    eng.submit("s", PROMPT, greedy(max_new=3))
    eng.step()
    eng.release("s")
    eng.release("s")  # twice, or an unknown id: nothing to forget
    eng.submit("s", [9, 8, 7], greedy(max_new=3))  # a new request under the old id
    with pytest.raises(ValueError, match="still running"):
        eng.release("s")
    turn = eng.step()[0]
    assert turn.token_ids == hf_greedy(qwen2[1], [9, 8, 7], 3) and turn.cached_tokens == 0


def test_requests_in_flight_share_one_sampler(fake, qwen2):
    eng = _engine(qwen2)
    eng.submit("a", PROMPT, SamplingParams(temperature=0.7, top_k=0, max_new_tokens=2))
    eng.submit("b", PROMPT, SamplingParams(temperature=0.7, top_k=-1, max_new_tokens=5))  # both "off"
    with pytest.raises(ValueError, match=r"request 'c': temperature/top_k/top_p = \(1.0, -1, 1.0\).*\(0.7, -1, 1.0\)"):
        eng.submit("c", PROMPT, SamplingParams(temperature=1.0, max_new_tokens=2))
    with pytest.raises(ValueError, match="top_k"):
        eng.submit("c", PROMPT, SamplingParams(temperature=0.7, top_k=5, max_new_tokens=2))
    assert [len(t.token_ids) for t in eng.step()] == [2, 5]
    eng.submit("c", PROMPT, SamplingParams(temperature=1.0, max_new_tokens=2))  # a new busy period
    assert len(eng.step()) == 1


def _old_generate(eng, prompts, params):
    """The batch path as it was before the request level: each prompt n times, one shared dict."""
    from minirl_plugins.engines.sglang.sampling import sampling_dict, to_turn

    outputs = eng.engine.generate(
        input_ids=[list(p) for p in prompts for _ in range(params.n)],
        sampling_params=sampling_dict(params, eng.eos_ids),
        return_logprob=True,
    )
    return [to_turn(out, str(i), 0) for i, out in enumerate(outputs)]


@pytest.mark.parametrize("params", [SamplingParams(n=2, temperature=0.8, top_k=20, max_new_tokens=6), greedy(n=1)])
def test_generate_equals_the_old_batch_path(fake, qwen2, params):
    """Same Engine.generate call, same tokens, log-probs and finish reasons, bit for bit."""
    prompts = [PROMPT, [7] * 9, [9, 8, 7, 6, 5, 4, 3]]
    old_eng, new_eng = _engine(qwen2, eos=(11,)), _engine(qwen2, eos=(11,))
    old = _old_generate(old_eng, prompts, params)
    new = new_eng.generate(prompts, params)
    assert old_eng.engine.generate_args == new_eng.engine.generate_args
    assert [t.token_ids for t in old] == [c.token_ids for c in new]
    assert [t.logprobs for t in old] == [c.logprobs for c in new]
    assert [t.finish_reason for t in old] == [c.finish_reason for c in new]
    assert not new_eng.has_work() and not new_eng.requests.held  # generate leaves nothing behind


def test_generate_refuses_to_swallow_queued_turns(fake, qwen2):
    """generate_batch steps whatever is queued and keeps only its own turns; a refused generate
    leaves nothing queued."""
    eng = _engine(qwen2)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.generate([PROMPT, []], greedy())
    assert not eng.has_work()
    eng.submit("agent", PROMPT, greedy(max_new=2))
    with pytest.raises(RuntimeError, match="1 submitted requests wait for step"):
        eng.generate([PROMPT], greedy())
    assert [t.request_id for t in eng.step()] == ["agent"]


def test_an_engine_without_per_request_sampling_is_refused(fake, monkeypatch):
    """step() sends a list of sampling dicts; an SGLang whose generate takes one dict only is
    named unsupported up front instead of failing at the first mixed step."""
    from sglang.srt.entrypoints.engine import Engine

    from minirl_plugins.engines.sglang.api import detect

    def generate(self, prompt=None, sampling_params: dict | None = None, input_ids=None, return_logprob=False):
        raise AssertionError("not called")

    monkeypatch.setattr(Engine, "generate", generate)
    with pytest.raises(UserError, match="sampling_params is annotated"):
        detect()


def test_the_radix_cache_matches_never_the_whole_prompt(fake):
    """The fake's cached_tokens follow SGLang's rule: at most len(prompt) - 1, emptied by a flush."""
    from sglang.srt.managers.scheduler import Scheduler

    sched = Scheduler.__new__(Scheduler)
    sched.radix = {(1, 2, 3, 4)}
    assert [sched.cached_prefix(p) for p in ([1, 2, 3, 4], [1, 2, 9], [5], [1, 2, 3, 4, 5, 6])] == [3, 2, 0, 4]
    sched.flush()
    assert sched.cached_prefix([1, 2, 3, 4, 5]) == 0


def test_logprobs_of_a_continuation_are_of_the_new_tokens(fake, qwen2):
    """A turn's log-probs belong to the tokens sampled in that turn, at the sampling temperature."""
    eng, hf, temp = _engine(qwen2), qwen2[1], 0.9
    params = SamplingParams(temperature=temp, max_new_tokens=4)
    eng.submit("s", PROMPT, params)
    context = PROMPT + eng.step()[0].token_ids + TOOL
    eng.submit("s", context, params)
    turn = eng.step()[0]
    with torch.no_grad():
        logits_TV = hf(torch.tensor([context + turn.token_ids])).logits[0, len(context) - 1 : -1].float()
    want = torch.log_softmax(logits_TV / temp, -1).gather(1, torch.tensor(turn.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(turn.logprobs), want, atol=1e-4)
