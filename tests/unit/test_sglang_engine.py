"""The sglang rollout plugin keeps the RolloutEngine contract on every SGLang version we support.

Each test runs against the fake SGLang (tests/fakes/sglang) playing 0.4.10, 0.5.14 and 0.5.23:
greedy output equals transformers' (so the weights arrived and the order is ours), n samples are
prompt-major, log-probs are at the sampling temperature, stop ids and EOS follow our protocol,
weight sync uses each version's format and session and fails loudly, release/resume ask for
exactly the tags the version knows.
"""

import math

import pytest
import torch

from minirl.errors import UserError
from minirl.protocols import SamplingParams
from minirl_plugins.engines.native.weights import weights_checksum
from tests.fakes import SGLANG_PROFILES, drop_fake_sglang, use_fake_sglang
from tests.tiny_models import engine_context, tiny_config, tiny_hf_model

PROMPTS = [[5, 17, 42], [7] * 9, [9, 8, 7, 6, 5, 4, 3]]


class _Rollout:
    def __init__(self, **kw):
        self.free_cache_engine = True
        self.gpu_memory_utilization = 0.5
        self.update_weights_bucket_megabytes = 512
        self.max_num_seqs = 64
        self.enforce_eager = False
        self.__dict__.update(kw)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(params=SGLANG_PROFILES)
def fake(request, monkeypatch):
    yield use_fake_sglang(monkeypatch, request.param)
    drop_fake_sglang()


@pytest.fixture(scope="module")
def qwen2():
    cfg = tiny_config("qwen2")
    return cfg, tiny_hf_model(cfg, seed=2, std=0.2)


def _engine(qwen2, eos=(), **rollout):
    from minirl_plugins.engines.sglang import build_sglang_engine

    cfg, hf = qwen2
    return build_sglang_engine(_Rollout(**rollout), engine_context(cfg, actor=hf, eos=eos))


def _hf_greedy(hf, prompt, max_new):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _fake_model(eng):
    return eng.engine.scheduler.model


def test_weights_arrive_and_greedy_equals_transformers(fake, qwen2):
    eng = _engine(qwen2)
    assert weights_checksum(_fake_model(eng).named_parameters()) == weights_checksum(qwen2[1].named_parameters())
    got = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    for prompt, completion in zip(PROMPTS, got):
        assert completion.token_ids == _hf_greedy(qwen2[1], prompt, 10)
        assert completion.finish_reason == "length" and len(completion.logprobs) == 10


def test_n_samples_are_prompt_major(fake, qwen2):
    eng = _engine(qwen2)
    got = eng.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_new_tokens=4))
    assert len(got) == len(PROMPTS) * 3
    for i, prompt in enumerate(PROMPTS):
        assert {tuple(c.token_ids) for c in got[3 * i : 3 * i + 3]} == {tuple(_hf_greedy(qwen2[1], prompt, 4))}


def test_logprobs_are_at_the_sampling_temperature(fake, qwen2):
    """Log-probs of sampled tokens equal log_softmax(logits / T) of a full recompute, even with
    top-k / top-p on (SGLang returns them before the filters' renormalisation)."""
    eng, hf, temp = _engine(qwen2), qwen2[1], 0.7
    got = eng.generate(PROMPTS, SamplingParams(n=2, temperature=temp, top_k=50, top_p=0.9, max_new_tokens=6))
    for i, completion in enumerate(got):
        seq = PROMPTS[i // 2] + completion.token_ids
        with torch.no_grad():
            logits_TV = hf(torch.tensor([seq])).logits[0, len(PROMPTS[i // 2]) - 1 : -1].float()
        want = torch.log_softmax(logits_TV / temp, -1).gather(1, torch.tensor(completion.token_ids)[:, None])
        assert torch.allclose(torch.tensor(completion.logprobs), want.squeeze(1), atol=1e-4)


def test_eos_and_stop_ids_follow_our_protocol(fake, qwen2):
    """EOS ends a response and is kept; ignore_eos drops EOS but keeps explicit stop ids (SGLang's
    own ignore_eos would drop both, so the plugin sends the stop set itself)."""
    first = _hf_greedy(qwen2[1], PROMPTS[0], 6)
    eng = _engine(qwen2, eos=(first[2],))
    greedy = dict(n=1, temperature=0.0, max_new_tokens=6)
    stopped = eng.generate(PROMPTS[:1], SamplingParams(**greedy))[0]
    assert stopped.token_ids == first[:3] and stopped.finish_reason == "stop"
    ignored = eng.generate(PROMPTS[:1], SamplingParams(**greedy, ignore_eos=True))[0]
    assert ignored.token_ids == first and ignored.finish_reason == "length"
    by_stop = eng.generate(PROMPTS[:1], SamplingParams(**greedy, ignore_eos=True, stop_token_ids=(first[1],)))[0]
    assert by_stop.token_ids == first[:2] and by_stop.finish_reason == "stop"


def test_disabled_top_k_is_sent_as_minus_one(fake, qwen2):
    """Our top_k <= 0 means "off"; SGLang rejects 0, so the plugin must send -1."""
    from minirl_plugins.engines.sglang.sampling import sampling_dict

    assert sampling_dict(SamplingParams(top_k=0), ())["top_k"] == -1
    eng = _engine(qwen2)
    with pytest.raises(ValueError, match="top_k"):
        eng.engine.generate(input_ids=PROMPTS, sampling_params={"top_k": 0, "max_new_tokens": 2})
    assert len(eng.generate(PROMPTS, SamplingParams(top_k=0, max_new_tokens=2))) == len(PROMPTS)


def test_weight_sync_uses_the_versions_format_and_session(fake, qwen2):
    """Small buckets: several update calls, each in the version's format, inside a session where
    the version requires one, one flush at the end; afterwards the engine holds the new weights."""
    eng = _engine(qwen2)
    eng.sync.budget = 40_000  # bytes: the tiny model then needs several buckets
    new = tiny_hf_model(qwen2[0], seed=7, std=0.2)
    eng.engine.calls.clear()
    eng.load_weights(new.named_parameters())
    calls = [name for name, _ in eng.engine.calls]
    formats = {detail for name, detail in eng.engine.calls if name == "update_weights_from_tensor"}
    assert eng.sync.last_num_buckets > 1 and calls.count("update_weights_from_tensor") == eng.sync.last_num_buckets
    assert formats == ({None} if fake.__version__ == "0.4.10" else {"flattened_bucket"})
    session = ["begin_weight_update"] if fake.__version__ == "0.5.23" else []
    assert calls[: len(session) + 1] == session + ["update_weights_from_tensor"]
    assert calls[-1] == "flush_cache" and calls.count("flush_cache") == 1
    assert weights_checksum(_fake_model(eng).named_parameters()) == weights_checksum(new.named_parameters())


def test_a_refused_sync_raises(fake, qwen2, monkeypatch):
    """SGLang reports a refused update as (False, message); the plugin must never pass it over,
    and a failed sync must not leave a session open that blocks the next one."""
    import dataclasses

    eng = _engine(qwen2)
    with pytest.raises(RuntimeError, match="not found"):
        eng.load_weights([("model.no_such.weight", torch.zeros(3))])
    eng.load_weights(qwen2[1].named_parameters())  # the next sync works
    if fake.__version__ == "0.5.23":  # without begin/end, 0.5.21+ refuse every update
        monkeypatch.setattr(eng.sync, "api", dataclasses.replace(eng.sync.api, weight_session=False))
        with pytest.raises(RuntimeError, match="begin_weight_update"):
            eng.load_weights(qwen2[1].named_parameters())


def test_custom_classes_are_refused_by_0_5_x(fake):
    """0.5.14 unpickles payloads by module prefix, 0.5.23 by an exact allow-list, 0.4.10 takes
    anything: a class of ours is refused from 0.5.14 on, a stray standard class by 0.5.23. The
    plugin's payloads hold only tensors, str and SGLang's own bucket metadata (the other tests
    here prove they load on every version)."""
    import collections

    from sglang.srt.utils import MultiprocessingSerializer

    ours = MultiprocessingSerializer.serialize([("w", _Rollout())])
    stray = MultiprocessingSerializer.serialize([("w", collections.ChainMap())])
    for payload, refused in ((ours, fake.__version__ != "0.4.10"), (stray, fake.__version__ == "0.5.23")):
        if refused:
            with pytest.raises(RuntimeError, match="Blocked"):
                MultiprocessingSerializer.deserialize(payload)
        else:
            MultiprocessingSerializer.deserialize(payload)


def test_release_and_resume_ask_for_the_same_supported_tags(fake, qwen2):
    eng = _engine(qwen2)
    want = ("kv_cache",) if fake.__version__ == "0.4.10" else ("kv_cache", "cuda_graph")
    eng.release_memory()
    eng.release_memory()  # idempotent: the second does not pause again
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    eng.resume_memory()
    eng.resume_memory()  # nothing released: resume asks for nothing (0.5.x would raise KeyError)
    memory = [(n, d) for n, d in eng.engine.calls if n.endswith("memory_occupation")]
    assert memory == [("release_memory_occupation", want), ("resume_memory_occupation", want)]
    assert len(eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == len(PROMPTS)


def test_weights_sync_while_the_cache_is_released(fake, qwen2):
    """The trainer syncs after the update phase, with the KV cache released: weights stay resident."""
    eng = _engine(qwen2)
    eng.release_memory()
    new = tiny_hf_model(qwen2[0], seed=9, std=0.2)
    eng.load_weights(new.named_parameters())
    assert weights_checksum(_fake_model(eng).named_parameters()) == weights_checksum(new.named_parameters())


def test_no_memory_saver_without_free_cache_engine(fake, qwen2):
    eng = _engine(qwen2, free_cache_engine=False)
    eng.release_memory()
    eng.resume_memory()
    assert eng.engine.server_args.enable_memory_saver is False
    assert not [n for n, _ in eng.engine.calls if n.endswith("memory_occupation")]


def test_engine_arguments(fake, qwen2):
    """One engine per rank on its own GPU, tensor parallel 1, no tokenizer, dummy weights; the
    memory fraction is gpu_memory_utilization; the model directory has no eos_token_id."""
    from transformers import AutoConfig

    from minirl_plugins.engines.sglang.api import detect
    from minirl_plugins.engines.sglang.engine import server_kwargs, write_model_dir

    ctx = engine_context(qwen2[0], device="cuda:3", dtype=torch.bfloat16, eos=(4,))
    path = write_model_dir(ctx.model_config)
    kwargs = server_kwargs(_Rollout(gpu_memory_utilization=0.35), ctx, detect(), path, True)
    assert kwargs["base_gpu_id"] == 3 and kwargs["tp_size"] == 1 and kwargs["mem_fraction_static"] == 0.35
    assert kwargs["skip_tokenizer_init"] is True and kwargs["load_format"] == "dummy"
    assert kwargs["dtype"] == "bfloat16" and kwargs["enable_memory_saver"] is True
    assert kwargs["port"] != kwargs["nccl_port"]
    config = AutoConfig.from_pretrained(path)
    assert config.eos_token_id is None and config.architectures == ["Qwen2ForCausalLM"]
    assert "kv_cache_dtype" not in kwargs  # "auto": SGLang's own default
    for ours, theirs in (("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")):
        kwargs = server_kwargs(_Rollout(kv_cache_dtype=ours), ctx, detect(), path, True)
        assert kwargs["kv_cache_dtype"] == theirs
    assert "quantization" not in kwargs  # rollout.quantization = "none"
    assert server_kwargs(_Rollout(quantization="fp8"), ctx, detect(), path, True)["quantization"] == "fp8"


def test_producer_patches_torch_reductions(fake, qwen2):
    """CUDA tensors must pickle by GPU UUID before the plugin serializes them."""
    from sglang.srt._reductions import CALLS

    before = CALLS[0]
    _engine(qwen2)
    assert CALLS[0] > before


def test_missing_sglang_names_the_extra(monkeypatch, qwen2):
    import sys

    from minirl_plugins.engines.sglang import build_sglang_engine

    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(UserError, match=r"pip install 'minirl\[sglang\]'"):
        build_sglang_engine(_Rollout(), engine_context(qwen2[0]))


def test_memory_saver_needs_its_package(fake, qwen2, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch_memory_saver" else real(n, *a))
    with pytest.raises(UserError, match="torch_memory_saver"):
        _engine(qwen2)


def test_registered_as_a_builtin():
    from minirl.plugins import PluginManager

    assert "sglang" in PluginManager(entry_points=False)["rollout_engines"]


def test_buckets_respect_the_budget_and_dtypes():
    from minirl_plugins.engines.sglang.weights import buckets

    named = [(f"w{i}", torch.zeros(100, dtype=torch.float32 if i < 3 else torch.bfloat16)) for i in range(5)]
    sizes = [[n for n, _ in b] for b in buckets(named, budget_bytes=800, split_dtypes=False)]
    assert sizes == [["w0", "w1"], ["w2", "w3", "w4"]]
    by_dtype = [[n for n, _ in b] for b in buckets(named, budget_bytes=10_000, split_dtypes=True)]
    assert by_dtype == [["w0", "w1", "w2"], ["w3", "w4"]]
    assert [len(b) for b in buckets([("big", torch.zeros(1000))], 10, False)] == [1]
    assert math.isclose(sum(t.numel() for b in buckets(named, 800, False) for _, t in b), 500)


def test_every_engine_call_is_in_the_checked_api(fake, qwen2):
    """scripts/check_sglang_api.py checks what api.py lists; a call the plugin makes must be listed."""
    from minirl_plugins.engines.sglang.api import USED_METHODS

    eng = _engine(qwen2)
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    eng.release_memory()
    eng.resume_memory()
    fake_engine = eng.engine
    eng.shutdown()
    listed = {method for module, cls, method, _, _ in USED_METHODS if cls == "Engine"}
    assert {name for name, _ in fake_engine.calls} <= listed
    assert ("shutdown", None) in fake_engine.calls


def test_replies_that_do_not_say_success_raise():
    """A refused or unreadable reply is an error, never a silent pass."""
    from minirl_plugins.engines.sglang.weights import check

    check((True, "Success"), "x")
    for reply in [(False, "refused"), None, "ok", type("Out", (), {"success": False})()]:
        with pytest.raises(RuntimeError, match="sglang x"):
            check(reply, "x")


def test_lora_actor_syncs_its_merged_adapters(fake, qwen2):
    """A LoRA actor (minirl.models.lora): SGLang is built with the merged weights under plain
    names and, after an update, receives only the targeted matrices, merged; it then holds exactly
    the trainer's merged weights and generates as the LoRA model does."""
    import copy

    from minirl.config.load import load_config
    from minirl.models import assembly, lora
    from minirl_plugins.engines.sglang import build_sglang_engine

    cfg, hf = qwen2
    model_cfg = load_config(
        None, ["model.lora_rank=4", "model.lora_alpha=8", 'model.target_modules=["q_proj", "up_proj"]']
    ).model
    actor = lora.apply_lora(copy.deepcopy(hf), model_cfg, "tiny")
    eng = build_sglang_engine(_Rollout(), engine_context(cfg, actor=actor))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if lora.is_adapter_param(name):
                p.add_(torch.full_like(p, 0.03))
    want = weights_checksum(assembly.full_weights(actor))
    assert weights_checksum(_fake_model(eng).named_parameters()) != want
    eng.load_weights(assembly.full_weights(actor, adapted_only=True))
    assert weights_checksum(_fake_model(eng).named_parameters()) == want
    merged = lora.unload(copy.deepcopy(actor))
    got = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    assert [c.token_ids for c in got] == [_hf_greedy(merged, p, 6) for p in PROMPTS]
