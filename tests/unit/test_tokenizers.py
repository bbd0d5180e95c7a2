"""The built-in tokenizers behave like Hugging Face ones, and the Qwen2 conversion is exact."""

from __future__ import annotations

import functools
import random
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import minirl.models.tokenizers as toks
from minirl.config.schema import ModelConfig
from minirl.models.loading import load_tokenizer
from minirl.models.tokenizers import (
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    R1_DISTILL_ADDED_TOKENS,
    byte_tokenizer,
    load_tiktoken_ranks,
    qwen2_tokenizer,
)

FIXED_TEXTS = [
    "Hello world",
    "The quick brown fox.\n\n  def f(x):\n\treturn x**2  # comment\r\n",
    "你好，世界！这是一个测试。日本語のテキスト。한국어 텍스트.",
    "emoji 😀🎉👍🏽 mixed with ascii",
    "12345678901234567890 3.14159 1e-10 -42",
    "it's we'll they'RE I'M you'd",
    "   leading, trailing and  multiple   spaces   ",
    "Ünïcödé çàñ bé trïckÿ ß Ωμέγα",
    "$\\frac{a}{b}$ and \\boxed{42}",
    "a" * 60 + " " + "=" * 30 + "\n" * 5,
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    alphabet = "abcdefgxyz ABZ \n\t\r0123456789.,;:!?()[]{}<>'\"-_=+*/\\|@#$%^&~`éàü中文日本語한국어😀\u00a0"
    rng = random.Random(seed)
    return [
        unicodedata.normalize("NFC", "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))) for _ in range(n)
    ]


# ---------------------------------------------------------------------------------------------
# byte tokenizer
# ---------------------------------------------------------------------------------------------


def test_byte_tokenizer_ids_are_utf8_bytes_and_round_trip():
    """Tiny runs rely on id == byte value (readable token ids) and a lossless round trip."""
    tok = byte_tokenizer()
    assert len(tok) == BYTE_VOCAB_SIZE == 259
    for text in FIXED_TEXTS + _random_texts(50):
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == BYTE_EOS_ID == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_token_id is None


def test_byte_tokenizer_chat_template_is_chatml():
    """The data pipeline renders prompts with apply_chat_template exactly as for a real model."""
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == 257 and ids.count(258) == 2  # <|im_start|> and <|im_end|> are single tokens
    assert tok.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\n2+2?\nassistant\n"


def test_byte_tokenizer_saves_and_loads_with_auto_tokenizer(tmp_path):
    """A tiny checkpoint directory carries its tokenizer like any Hugging Face model."""
    byte_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.encode("héllo<|im_end|>") == byte_tokenizer().encode("héllo<|im_end|>")
    assert loaded.eos_token_id == BYTE_EOS_ID and loaded.chat_template == byte_tokenizer().chat_template


# ---------------------------------------------------------------------------------------------
# Qwen2 / DeepSeek-R1-Distill tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    return qwen2_tokenizer()  # converted once per machine, then read from ~/.cache/minirl


@pytest.fixture(scope="module")
def tiktoken_qwen():
    import tiktoken

    ranks = load_tiktoken_ranks(toks._qwen_tiktoken_path())
    pattern = toks.QWEN2_SPLIT_PATTERN
    return tiktoken.Encoding("qwen", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def test_qwen2_encoding_matches_tiktoken(qwen, tiktoken_qwen):
    """The converted BPE must split text exactly as the original tiktoken ranks do, or
    benchmarks on the qwen2 preset would see other sequence lengths than the real model."""
    for text in FIXED_TEXTS + _random_texts(300):
        assert qwen.encode(text, add_special_tokens=False) == tiktoken_qwen.encode(text), text


def test_qwen2_round_trip(qwen):
    """decode(encode(text)) is the text (NFC-normalised, as Qwen2's normaliser does)."""
    for text in FIXED_TEXTS + _random_texts(100, seed=1):
        assert qwen.decode(qwen.encode(text), skip_special_tokens=True) == text


def test_qwen2_special_tokens_have_r1_distill_ids(qwen):
    """Token ids must match DeepSeek-R1-Distill-Qwen's checkpoints, or real weights would read
    the wrong embedding rows."""
    assert len(qwen) == 151665
    for token_id, content, _ in R1_DISTILL_ADDED_TOKENS:
        assert qwen.convert_tokens_to_ids(content) == token_id
        assert qwen.encode(content, add_special_tokens=False) == [token_id]
    assert (qwen.bos_token_id, qwen.eos_token_id, qwen.pad_token_id) == (151646, 151643, 151643)
    assert qwen.encode("Hello world") == [151646, 9707, 1879]  # BOS first, as the original adds


def test_qwen2_chat_template_is_r1_distill(qwen):
    """Prompts render like DeepSeek-R1-Distill's: system first, <｜User｜>, and a generation
    prompt that opens <think>; past assistant turns drop their reasoning."""
    messages = [
        {"role": "system", "content": "S."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\n2"},
        {"role": "user", "content": "2+2?"},
    ]
    text = qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜>S.<｜User｜>1+1?"
        "<｜Assistant｜>\n\n2<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜><think>\n"
    )
    # transformers 5 returns a BatchEncoding from tokenize=True unless return_dict=False.
    ids = qwen.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 151646 and ids.count(151646) == 1 and ids[-2:] == [151648, 198]


def test_qwen2_conversion_is_cached(tmp_path, monkeypatch):
    """Conversion takes seconds: it runs once, later calls read the cache."""
    calls = []
    monkeypatch.setenv("MINIRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(toks, "convert_qwen2_tokenizer", lambda path: calls.append(path) or byte_tokenizer())
    first, second = qwen2_tokenizer(), qwen2_tokenizer()
    assert len(calls) == 1 and first.encode("hi") == second.encode("hi")
    assert list(tmp_path.glob("tokenizers/qwen2-r1-distill-*/tokenizer.json"))
    assert not list(tmp_path.glob("tokenizers/*.tmp*"))


# ---------------------------------------------------------------------------------------------
# load_tokenizer
# ---------------------------------------------------------------------------------------------


def test_load_tokenizer_prefers_tokenizer_then_path_then_preset(tmp_path):
    """model.tokenizer overrides model.path, which overrides the preset's built-in tokenizer."""
    assert len(load_tokenizer(ModelConfig(preset="tiny"))) == BYTE_VOCAB_SIZE
    special = byte_tokenizer()
    special.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    special.save_pretrained(tmp_path / "tok")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    assert len(load_tokenizer(ModelConfig(path=str(tmp_path / "model")))) == BYTE_VOCAB_SIZE
    both = ModelConfig(path=str(tmp_path / "model"), tokenizer=str(tmp_path / "tok"))
    assert len(load_tokenizer(both)) == BYTE_VOCAB_SIZE + 1


def test_load_tokenizer_errors_name_the_key(tmp_path):
    """A tokenizer that does not load is a user mistake: the message names the key and the value
    (the directories are checked up front, with the fix: minirl.validate.files)."""
    with pytest.raises(ValueError, match=r"model\.tokenizer = .*does not load"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"model\.path = .*does not load"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "empty")))


# ---------------------------------------------------------------------------------------------
# decode_batch: the reward's decode
# ---------------------------------------------------------------------------------------------

ID_LISTS = st.lists(st.lists(st.integers(0, 151_664), max_size=64), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(ID_LISTS, st.booleans())
def test_decode_batch_is_batch_decode_for_qwen2(ids, skip):
    """Any ids (specials, partial UTF-8 byte tokens and empty responses included) decode to the
    same strings as transformers' batch_decode, with and without the special tokens."""
    qwen = _QWEN()
    assert toks.decode_batch(qwen, ids, skip_special_tokens=skip) == qwen.batch_decode(ids, skip_special_tokens=skip)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=40), min_size=1, max_size=4))
def test_decode_batch_is_batch_decode_for_the_byte_tokenizer(ids):
    tok = _BYTE()
    assert toks.decode_batch(tok, ids) == tok.batch_decode(ids, skip_special_tokens=True)


def test_decode_batch_defers_to_a_tokenizer_with_its_own_decode():
    """A subclass's _decode or cleaned-up spaces are transformers' to apply: decode_batch gives
    what batch_decode gives, not the backend's raw text."""

    class Shouting(type(byte_tokenizer())):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=byte_tokenizer().backend_tokenizer)
    ids = [list(b"hello"), list(b"x")]
    assert toks.decode_batch(shouting, ids) == ["HELLO", "X"]
    cleaning = byte_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    calls = []
    cleaning.batch_decode = lambda ids, **kw: calls.append(ids) or ["cleaned"] * len(ids)
    assert toks.decode_batch(cleaning, ids) == ["cleaned", "cleaned"] and calls == [ids]


_QWEN = functools.cache(qwen2_tokenizer)
_BYTE = functools.cache(byte_tokenizer)
