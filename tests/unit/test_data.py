"""Tests of minirl.data.prompts: parquet validation, length handling, batching, sharding, groups."""

from __future__ import annotations

import dataclasses
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from minirl.config.schema import DataConfig
from minirl.data.prompts import (
    DataError,
    PromptLoader,
    PromptRecord,
    expand_groups,
    load_prompts,
)


class StubTokenizer:
    """One token per character (id = code point) and a plain-text chat template: lengths are
    easy to reason about and nothing is downloaded."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) for c in text]


TOK = StubTokenizer()
OVERHEAD = len("<user>\n<assistant>")  # template tokens around one user message


def row(content="What is 2+2?", truth="4", source="gsm8k", **overrides):
    base = {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0},
    }
    base.update(overrides)
    return base


def write(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def cfg(**kw):
    return dataclasses.replace(DataConfig(), **kw)


def records(n):
    return [PromptRecord([i], "copy", str(i), {}, f"f:{i}", i) for i in range(n)]


def epoch_batches(loader, epoch):
    """This shard's batches of one epoch, sliced from loader.order(epoch) here: the reference
    that next_batch must follow."""
    order, per_rank = loader.order(epoch), loader.batch_size // loader.world
    starts = range(loader.rank * per_rank, loader.steps_per_epoch * loader.batch_size, loader.batch_size)
    return [[loader.records[j] for j in order[start : start + per_rank]] for start in starts]


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def test_loads_rows_with_chat_template_and_sources(tmp_path):
    """The happy path: every field lands in the record, ids are the rendered template, and
    source / index point back at the file row for later error messages."""
    a = write(tmp_path, [row("hi", "1"), row("yo", "2", extra_info={"split": "x", "index": 7})], "a.parquet")
    b = write(tmp_path, [row("ok", {"target": 3, "numbers": [1, 2]}, source="countdown")], "b.parquet")
    recs = load_prompts([a, b], TOK, cfg())
    assert [r.prompt_ids for r in recs[:1]] == [TOK.encode("<user>hi\n<assistant>", add_special_tokens=False)]
    assert [r.source for r in recs] == [f"{a}:0", f"{a}:1", f"{b}:0"]
    assert [r.index for r in recs] == [0, 1, 2]
    assert recs[1].ground_truth == "2" and recs[1].extra_info == {"split": "x", "index": 7}
    assert recs[2].ground_truth == {"target": 3, "numbers": [1, 2]} and recs[2].data_source == "countdown"
    assert recs[0].ability == "math"


def test_optional_columns_may_be_absent_and_prompt_key_is_configurable(tmp_path):
    """ability and extra_info are optional in verl's schema; data.prompt_key renames the prompt."""
    r = row()
    r["question"] = r.pop("prompt")
    del r["ability"], r["extra_info"]
    path = write(tmp_path, [r])
    recs = load_prompts([path], TOK, cfg(prompt_key="question"))
    assert len(recs) == 1 and recs[0].extra_info == {} and recs[0].ability == ""


def test_real_transformers_tokenizer(tmp_path):
    """transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding; loading must
    go through text and produce a plain list of ints with the template's special tokens once."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<|im_start|>": len(vocab), "<|im_end|>": len(vocab) + 1})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    recs = load_prompts([write(tmp_path, [row("hi")])], tok, cfg())
    ids = recs[0].prompt_ids
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# malformed input: every error names the file, the row and the field
# ---------------------------------------------------------------------------------------------

# Arrow columns have one type, so a wrongly typed column is written alone (the error is at
# row 0); a missing or empty value can follow a good row (the error is at row 1).
BAD_ROWS = {
    "non-list messages": (row(prompt="just a string"), True, ["'prompt'", "list of chat messages"]),
    "empty prompt": (row(prompt=[]), False, ["'prompt'", "empty"]),
    "message without content": (row(prompt=[{"role": "user"}]), False, ["'prompt'", "message 0", "'content'"]),
    "message without role": (row(prompt=[{"content": "x"}]), False, ["'prompt'", "'role'"]),
    "null prompt": (row(prompt=None), False, ["'prompt'", "NoneType"]),
    "missing ground_truth": (row(reward_model={"style": "rule"}), False, ["reward_model.ground_truth"]),
    "data_source not a string": (row(source=3), True, ["'data_source'", "non-empty string"]),
    "empty data_source": (row(source=""), False, ["'data_source'"]),
    "extra_info not a struct": (row(extra_info="oops"), True, ["'extra_info'", "str"]),
    "ability not a string": (row(ability=5), True, ["'ability'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_malformed_row_names_file_row_and_field(tmp_path, case):
    """A bad row must be pinpointed (file:row, field) when loading, not crash somewhere later."""
    bad, alone, fragments = BAD_ROWS[case]
    path = write(tmp_path, [bad] if alone else [row(), bad])
    with pytest.raises(DataError) as err:
        load_prompts([path], TOK, cfg())
    assert f"{path}:{0 if alone else 1}" in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("column", ["data_source", "reward_model", "prompt"])
def test_missing_column_names_file_and_column(tmp_path, column):
    """A file without a required column fails up front, naming it (and data.prompt_key for the prompt)."""
    r = row()
    del r[column]
    path = write(tmp_path, [r])
    with pytest.raises(DataError, match=column) as err:
        load_prompts([path], TOK, cfg())
    assert path in str(err.value)
    if column == "prompt":
        assert "data.prompt_key" in str(err.value)


def test_unreadable_missing_and_empty_files(tmp_path):
    """Non-parquet, absent and zero-row files are DataErrors that name the path or the key to fix
    (an empty data.train_files is the validation pass's to refuse: test_bad_inputs)."""
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet")
    with pytest.raises(DataError, match="cannot read as parquet") as err:
        load_prompts([str(text)], TOK, cfg())
    assert str(text) in str(err.value)
    with pytest.raises(DataError, match="no such file"):
        load_prompts([str(tmp_path / "absent.parquet")], TOK, cfg())
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([row()]).slice(0, 0), empty)
    with pytest.raises(DataError, match="no rows") as err:
        load_prompts([str(empty)], TOK, cfg())
    assert str(empty) in str(err.value)


def test_chat_template_failure_is_a_data_error(tmp_path):
    """A tokenizer without a chat template must say which key to fix, not raise deep inside."""

    class NoTemplate(StubTokenizer):
        def apply_chat_template(self, *a, **k):
            raise ValueError("tokenizer.chat_template is not set")

    with pytest.raises(DataError, match="model.tokenizer"):
        load_prompts([write(tmp_path, [row()])], NoTemplate(), cfg())


# ---------------------------------------------------------------------------------------------
# overlong prompts
# ---------------------------------------------------------------------------------------------


def test_filter_overlong_counts_and_logs(tmp_path, caplog):
    """Filtering is never silent: the count is logged with the first dropped row."""
    path = write(tmp_path, [row("a" * 5), row("b" * 50), row("c" * 5), row("d" * 60)])
    with caplog.at_level(logging.WARNING, logger="minirl.data.prompts"):
        recs = load_prompts([path], TOK, cfg(max_prompt_length=OVERHEAD + 10))
    assert [r.source for r in recs] == [f"{path}:0", f"{path}:2"]
    assert [r.index for r in recs] == [0, 1]
    assert "dropped 2 of 4 prompts" in caplog.text and f"{path}:1" in caplog.text
    assert "truncated" not in caplog.text


def test_everything_filtered_is_an_error(tmp_path):
    """A run with zero prompts left would fail obscurely later; fail here, naming the key."""
    path = write(tmp_path, [row("x" * 50)])
    with pytest.raises(DataError, match="no prompts left.*data.max_prompt_length"):
        load_prompts([path], TOK, cfg(max_prompt_length=10))


def test_truncation_error_names_row_length_and_both_keys(tmp_path):
    """The default (truncation = error) stops on the first overlong row and says how to fix it."""
    path = write(tmp_path, [row("short"), row("y" * 40)])
    with pytest.raises(DataError) as err:
        load_prompts([path], TOK, cfg(max_prompt_length=30, filter_overlong_prompts=False))
    msg = str(err.value)
    assert f"{path}:1" in msg and f"{OVERHEAD + 40} tokens" in msg and "= 30" in msg
    assert "data.max_prompt_length" in msg and "data.filter_overlong_prompts" in msg


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes_keep_the_right_tokens(tmp_path, mode, caplog):
    """left keeps the end, right the start, middle both ends (verl's meanings), counted."""
    path = write(tmp_path, [row("0123456789")])
    full = TOK.encode(
        TOK.apply_chat_template(row("0123456789")["prompt"], add_generation_prompt=True), add_special_tokens=False
    )
    limit = 9
    with caplog.at_level(logging.WARNING, logger="minirl.data.prompts"):
        recs = load_prompts([path], TOK, cfg(max_prompt_length=limit, filter_overlong_prompts=False, truncation=mode))
    expected = {"left": full[-9:], "right": full[:9], "middle": full[:4] + full[-5:]}[mode]
    assert recs[0].prompt_ids == expected
    assert "truncated 1 of 1" in caplog.text


def test_truncation_ignored_under_filter_warns(tmp_path, caplog):
    """A configured option without effect gets a warning (house style)."""
    with caplog.at_level(logging.WARNING, logger="minirl.data.prompts"):
        load_prompts([write(tmp_path, [row()])], TOK, cfg(truncation="left"))
    assert "has no effect" in caplog.text


# ---------------------------------------------------------------------------------------------
# batching, shuffling, sharding, groups
# ---------------------------------------------------------------------------------------------


def test_batches_are_full_and_last_partial_is_dropped():
    """Every step sees exactly batch_size prompts; 10 records at 4 per batch give 2 steps."""
    loader = PromptLoader(records(10), batch_size=4, shuffle=True, seed=0)
    batches = [loader.next_batch() for _ in range(loader.steps_per_epoch)]
    assert loader.steps_per_epoch == 2
    assert [len(b) for b in batches] == [4, 4]
    assert len({r.index for b in batches for r in b}) == 8


def test_shuffle_is_deterministic_per_seed_and_epoch():
    """Same (seed, epoch) -> same order (resumable); epochs and seeds differ; no shuffle = file order."""
    order = lambda seed, epoch: [
        r.index for b in epoch_batches(PromptLoader(records(32), 8, True, seed), epoch) for r in b
    ]
    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(3, 1) and order(3, 0) != order(4, 0)
    assert sorted(order(3, 1)) == list(range(32))
    plain = [r.index for b in epoch_batches(PromptLoader(records(32), 8, False, 3), 5) for r in b]
    assert plain == list(range(32))


def test_shards_partition_each_global_batch_contiguously():
    """Ranks take contiguous, whole-prompt slices that concatenate (in rank order) to the batch."""
    loader = PromptLoader(records(24), 6, True, 1)
    shards = [loader.shard(rank, 3) for rank in range(3)]
    for batch in [loader.next_batch() for _ in range(3 * loader.steps_per_epoch)]:  # three epochs
        parts = [s.next_batch() for s in shards]
        assert [len(p) for p in parts] == [2, 2, 2]
        assert [r.index for p in parts for r in p] == [r.index for r in batch]


def test_shard_asserts_a_divisible_batch():
    """An uneven split would give ranks different prompt counts. The validation pass refuses such
    a config (test_bad_inputs: test_batches_that_do_not_divide_over_ranks), so here it is a bug."""
    with pytest.raises(AssertionError, match="6 prompts over 4 ranks"):
        PromptLoader(records(24), 6, True, 1).shard(0, 4)
    with pytest.raises(AssertionError, match="rank 3"):
        PromptLoader(records(24), 6, True, 1).shard(3, 3)


def test_batch_larger_than_dataset_is_an_error():
    """Zero steps per epoch would loop forever or silently train nothing."""
    with pytest.raises(ValueError, match="data.train_batch_size = 8.*5 prompts"):
        PromptLoader(records(5), 8)


def test_expand_groups_is_prompt_major():
    """The n samples of a prompt are adjacent and share one uid, matching the engines' output order."""
    recs = records(3)
    repeated, uids = expand_groups(recs, 2, first_uid=10)
    assert [r.index for r in repeated] == [0, 0, 1, 1, 2, 2]
    assert uids == [10, 10, 11, 11, 12, 12]
    with pytest.raises(AssertionError, match="rollout.n = 0"):  # refused by the validation pass
        expand_groups(recs, 0, 0)


def test_next_batch_walks_the_epochs_and_counts_the_position():
    """next_batch hands out the batches of epoch 0, then of epoch 1, ...; `drawn` counts them (the
    data position a checkpoint saves), and a loader set to a position continues from there."""
    loader = PromptLoader(records(20), 8, True, seed=2).shard(1, 2)
    want = [[r.index for r in b] for e in range(3) for b in epoch_batches(loader, e)]
    assert [[r.index for r in loader.next_batch()] for _ in range(5)] == want[:5] and loader.drawn == 5
    resumed = PromptLoader(records(20), 8, True, seed=2).shard(1, 2)
    resumed.drawn = 3
    assert [r.index for r in resumed.next_batch()] == want[3] and resumed.epoch == 4 / 2
