"""Presets have the promised shapes; models load from presets and local directories."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from minirl.config.schema import ModelConfig
from minirl.models.loading import load_model, random_model
from minirl.models.presets import PRESETS, preset_config
from minirl.models.tokenizers import BYTE_EOS_ID, BYTE_VOCAB_SIZE, byte_tokenizer

TINY = ["tiny", "llama3-tiny", "qwen3-tiny"]


def _meta_model(name: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(preset_config(name))


def test_qwen2_1_5b_is_r1_distill_qwen_1_5b():
    """Benchmarks on random weights only mean something if the shape is the real checkpoint's."""
    cfg = preset_config("qwen2-1.5b")
    assert cfg.architectures == ["Qwen2ForCausalLM"] and cfg.model_type == "qwen2"
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert (cfg.hidden_size, cfg.num_hidden_layers, heads) == (1536, 28, (12, 2))
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (8960, 151936, 131072)
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.rope_parameters["rope_type"] == "default"
    assert cfg.rms_norm_eps == 1e-6 and cfg.tie_word_embeddings is False and cfg.hidden_act == "silu"
    assert cfg.use_sliding_window is False and set(cfg.layer_types) == {"full_attention"}
    assert (cfg.bos_token_id, cfg.eos_token_id) == (151643, 151643)  # as in its config.json


def test_qwen2_1_5b_parameter_count_on_meta():
    """1,777,088,000 parameters with the untied lm_head; counted without allocating memory."""
    model = _meta_model("qwen2-1.5b")
    assert sum(p.numel() for p in model.parameters()) == 1_777_088_000
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_fit_the_byte_tokenizer(name):
    """Tiny presets index embeddings with byte-tokenizer ids and stop on its eos."""
    cfg = preset_config(name)
    assert cfg.vocab_size == BYTE_VOCAB_SIZE == len(byte_tokenizer())
    assert cfg.eos_token_id == byte_tokenizer().eos_token_id == BYTE_EOS_ID
    assert cfg.pad_token_id is None  # a padding_idx would freeze the eos embedding row at zero
    assert sum(p.numel() for p in _meta_model(name).parameters()) < 200_000


def test_qwen2_7b_is_qwen2_7b():
    """The LoRA benchmark's shape: Qwen2-7B's config.json and its 7,615,616,512 parameters."""
    cfg = preset_config("qwen2-7b")
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert (cfg.hidden_size, cfg.num_hidden_layers, heads) == (3584, 28, (28, 4))
    assert (cfg.intermediate_size, cfg.vocab_size) == (18944, 152064)
    assert cfg.rope_parameters["rope_theta"] == 1000000.0 and cfg.tie_word_embeddings is False
    assert sum(p.numel() for p in _meta_model("qwen2-7b").parameters()) == 7_615_616_512


def test_the_presets_are_the_six_documented_ones():
    """model.preset offers these (a typo is caught up front: minirl.validate.files); tiny-agent
    is tiny with the agent tokenizer's vocabulary (tests/unit/test_lookup_task.py)."""
    assert set(PRESETS) == {"tiny", "tiny-agent", "llama3-tiny", "qwen3-tiny", "qwen2-1.5b", "qwen2-7b"}


@pytest.mark.parametrize("name", TINY)
def test_random_weights_are_hf_init_and_seeded(name):
    """Random presets use transformers' own init (so they behave like a fresh HF model, RoPE
    buffers included), are reproducible from model.seed, and leave the global RNG alone."""
    rng_before = torch.get_rng_state()
    model, tok = load_model(ModelConfig(preset=name, seed=5), "cpu", "float32")
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert model.config._attn_implementation == "minirl" and not model.training
    again = random_model(preset_config(name), "cpu", torch.float32, seed=5)
    other = random_model(preset_config(name), "cpu", torch.float32, seed=6)
    reference = AutoModelForCausalLM.from_config(preset_config(name))
    for (n, p), p_again, p_other in zip(model.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(p, p_again), n
        if p.ndim == 2:
            assert not torch.equal(p, p_other) and abs(p.std().item() - 0.02) < 0.004, n
        elif "norm" in n:
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            assert torch.equal(p, torch.zeros_like(p)), n  # qkv biases
    for (n, b), b_ref in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, b_ref), n
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(tok) == BYTE_VOCAB_SIZE


def test_dtype_and_attn_implementation_follow_the_config():
    """model.dtype and model.attn_implementation reach the built model; an unknown attention
    names the key (model.dtype is checked up front: minirl.validate.values)."""
    model, _ = load_model(ModelConfig(preset="tiny", attn_implementation="eager"), "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"model\.attn_implementation = 'flash'"):
        load_model(ModelConfig(preset="tiny", attn_implementation="flash"), "cpu", "float32")


def test_local_directory_round_trip(tmp_path):
    """A saved checkpoint (config.json, safetensors, tokenizer files) loads back through
    model.path with the same weights and tokenizer: the path real checkpoints take."""
    model, tok = load_model(ModelConfig(preset="qwen3-tiny", seed=2), "cpu", "float32")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    loaded, loaded_tok = load_model(ModelConfig(path=str(tmp_path), preset="nope"), "cpu", "float32")
    assert loaded.config._attn_implementation == "minirl"
    ids = torch.tensor([tok.encode("round trip")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    assert loaded_tok.encode("héllo") == tok.encode("héllo")


def test_local_directory_errors_name_model_path(tmp_path):
    """A checkpoint directory that does not load gives a message naming model.path and the
    cause, even when nothing checked it up front (minirl.validate.files does, with the fix)."""
    (tmp_path / "empty").mkdir()
    preset_config("tiny").save_pretrained(tmp_path / "no_weights")
    for name in ("missing", "empty", "no_weights"):
        with pytest.raises(ValueError, match=r"model\.path = .*loading the checkpoint failed"):
            load_model(ModelConfig(path=str(tmp_path / name)), "cpu", "float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen2_1_5b_random_build_is_fast_on_cuda():
    """The benchmark preset must build in seconds: meta construction, one init on the GPU."""
    start = time.perf_counter()
    model = random_model(preset_config("qwen2-1.5b"), "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"building qwen2-1.5b took {elapsed:.1f}s"
    assert sum(p.numel() for p in model.parameters()) == 1_777_088_000
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert abs(model.model.layers[0].mlp.up_proj.weight.float().std().item() - 0.02) < 1e-3
