"""Prompt data: verl-schema parquet files (docs/algorithms.md §8) -> tokenized prompts -> batches.

Every malformed row is a DataError that names the file, the row, the field and the fix: a bad
data file should never surface as a bare traceback from deep inside the trainer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from minirl.config.schema import DataConfig
from minirl.errors import UserError

log = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right", "middle")  # data.truncation (_fit_length); validation allows only these
REQUIRED_COLUMNS = ("data_source", "reward_model")
REENCODE = "re-encode the text as UTF-8 when writing the file"


class DataError(UserError):
    """A data file or one of its rows is unusable; the message names file, row, field and fix."""


@dataclass
class PromptRecord:
    """One prompt, ready for rollout. source is "file:row" (for error messages); index is the
    record's position in the loaded list (stable across epochs)."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict
    source: str
    index: int
    ability: str = ""
    agent_name: str = ""  # the row's agent_name column: its agent loop ("": rollout.agent.default_agent_loop)
    messages: list = field(default_factory=list)  # the prompt's chat messages, for agent loops


# ---------------------------------------------------------------------------------------------
# reading and validating rows
# ---------------------------------------------------------------------------------------------


def _read_columns(path: str, prompt_key: str) -> dict[str, list]:
    """Read one parquet file into column -> python list; a missing required column is an error."""
    import pyarrow.parquet as pq  # deferred: only data loading needs pyarrow

    try:
        table = pq.read_table(path)
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no such file; fix data.train_files / data.val_files") from exc
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for non-parquet input
        raise DataError(
            f"{path}: cannot read as parquet ({type(exc).__name__}: {exc}); the data files must "
            f"be parquet in verl's schema (see scripts/make_data.py)"
        ) from exc
    for name in (*REQUIRED_COLUMNS, prompt_key):
        if name not in table.column_names:
            hint = " (set data.prompt_key to the prompt column)" if name == prompt_key else ""
            raise DataError(f"{path}: missing column {name!r}{hint}; columns present: {table.column_names}")
    cols = {c: _column(table, c, path) for c in (*REQUIRED_COLUMNS, prompt_key)}
    for optional in ("ability", "extra_info", "agent_name"):
        present = optional in table.column_names
        cols[optional] = _column(table, optional, path) if present else [None] * table.num_rows
    return cols


def _column(table, name: str, path: str) -> list:
    """One column as python values; bytes that are not UTF-8 in a string column name the row."""
    try:
        return table.column(name).to_pylist()
    except UnicodeDecodeError:
        pass
    for row, chunk_value in enumerate(table.column(name)):
        try:
            chunk_value.as_py()
        except UnicodeDecodeError as exc:
            rule = f"holds bytes that are not UTF-8 ({exc.reason} at byte {exc.start})"
            raise _bad_field(f"{path}:{row}", name, f"{rule}; {REENCODE}") from None
    raise DataError(f"{path}: column {name!r} holds bytes that are not UTF-8; {REENCODE}")


def _bad_field(where: str, name: str, problem: str) -> DataError:
    """`file:row: field 'name' <what is wrong>; <the fix>`."""
    return DataError(f"{where}: field {name!r} {problem}")


def _check_messages(messages: Any, where: str, key: str) -> list[dict]:
    """The prompt must be a non-empty list of {role: str, content: str} dicts."""
    if not isinstance(messages, list):
        got = f"{type(messages).__name__} {str(messages)[:60]!r}"
        fix = "rewrite the column as [{'role': 'user', 'content': ...}]"
        raise _bad_field(where, key, f"must be a list of chat messages {{role, content}}, got {got}; {fix}")
    if not messages:
        raise _bad_field(where, key, "is an empty list; every prompt needs a message")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise _bad_field(where, key, f"message {i} must have string 'role' and 'content', got {str(msg)[:80]!r}")
    return messages


def _check_row(cols: dict[str, list], row: int, where: str, key: str) -> tuple[list, str, Any, dict, str, str]:
    """Validate one row; returns (messages, data_source, ground_truth, extra_info, ability, agent_name)."""
    source = cols["data_source"][row]
    if not isinstance(source, str) or not source:
        rule = f"must be a non-empty string (it picks the reward function), got {source!r}"
        raise _bad_field(where, "data_source", rule)
    messages = _check_messages(cols[key][row], where, key)
    reward_model = cols["reward_model"][row]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        rule = f"is missing (reward_model = {str(reward_model)[:80]!r})"
        fix = "every row needs reward_model = {style, ground_truth}"
        raise _bad_field(where, "reward_model.ground_truth", f"{rule}; {fix}")
    extra = cols["extra_info"][row]
    if extra is not None and not isinstance(extra, dict):
        raise _bad_field(where, "extra_info", f"must be a struct/dict or null, got {type(extra).__name__}")
    ability = cols["ability"][row]
    if ability is not None and not isinstance(ability, str):
        raise _bad_field(where, "ability", f"must be a string, got {type(ability).__name__}")
    agent = cols["agent_name"][row]
    if agent is not None and not isinstance(agent, str):
        raise _bad_field(where, "agent_name", f"must be a string naming an agent loop, got {type(agent).__name__}")
    return messages, source, reward_model["ground_truth"], extra or {}, ability or "", agent or ""


# ---------------------------------------------------------------------------------------------
# tokenizing and length handling
# ---------------------------------------------------------------------------------------------


def render_prompt(tokenizer: Any, messages: list[dict], where: str, tools: list[dict] | None = None) -> list[int]:
    """Chat template -> text -> ids. Rendering to text first sidesteps transformers 5, whose
    apply_chat_template(tokenize=True) returns a BatchEncoding instead of a list of ids; the
    template already holds the special tokens, so encode() must not add them again. tools: the
    tool schemas the template shows the model (multi-turn rows), None for none."""
    try:
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:
        raise DataError(
            f"{where}: the tokenizer's chat template failed ({type(exc).__name__}: {exc}); use a "
            f"tokenizer with a chat template (model.tokenizer)"
        ) from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fit_length(ids: list[int], limit: int, mode: str, where: str) -> list[int]:
    """Truncate an overlong prompt as data.truncation says (verl's meanings)."""
    if mode == "left":  # keep the end, where the question usually is
        return ids[-limit:]
    if mode == "right":
        return ids[:limit]
    if mode == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head) :]
    raise DataError(
        f"{where}: the prompt is {len(ids)} tokens, longer than data.max_prompt_length = {limit}; "
        f"raise data.max_prompt_length, or set data.filter_overlong_prompts = true to drop such "
        f"prompts (or data.truncation = 'left' | 'right' | 'middle' to cut them)"
    )


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def load_prompts(
    files: list[str], tokenizer: Any, cfg: DataConfig, tools_for: Callable[[str], list[dict]] | None = None
) -> list[PromptRecord]:
    """Read verl-schema parquet files into tokenized prompts, in file and row order; a prompt
    longer than data.max_prompt_length is dropped or cut as docs/algorithms.md §8 says.
    tools_for(agent_name): the tool schemas a row's prompt shows (None: no tools)."""
    assert files, "the validation pass refuses an empty data.train_files (or data.val_files when used)"
    key = cfg.prompt_key
    records, dropped, n_rows, n_cut = [], [], 0, 0
    for path in files:
        cols = _read_columns(str(path), key)
        for row in range(len(cols["data_source"])):
            where = f"{path}:{row}"
            messages, source, truth, extra, ability, agent = _check_row(cols, row, where, key)
            ids = render_prompt(tokenizer, messages, where, tools_for(agent) if tools_for else None)
            if not ids:
                raise _bad_field(where, key, "renders to zero tokens; check the messages")
            n_rows += 1
            if len(ids) > cfg.max_prompt_length:
                if cfg.filter_overlong_prompts:
                    dropped.append(where)
                    continue
                ids = _fit_length(ids, cfg.max_prompt_length, cfg.truncation, where)
                n_cut += 1
            records.append(PromptRecord(ids, source, truth, extra, where, len(records), ability, agent, messages))
    _report(n_rows, dropped, n_cut, files, cfg)
    return records


def _report(n_rows: int, dropped: list[str], n_cut: int, files: list[str], cfg: DataConfig) -> None:
    """Never drop or cut prompts silently: say how many, and fail when nothing is left."""
    limit = f"data.max_prompt_length = {cfg.max_prompt_length}"
    if cfg.filter_overlong_prompts and cfg.truncation != "error":
        log.warning(
            "data.truncation = %r has no effect: data.filter_overlong_prompts = true drops "
            "overlong prompts before any truncation",
            cfg.truncation,
        )
    if dropped:
        log.warning(
            "dropped %d of %d prompts longer than %s (data.filter_overlong_prompts = true); first: %s",
            len(dropped),
            n_rows,
            limit,
            dropped[0],
        )
    if n_cut:
        log.warning("truncated %d of %d prompts to %s (data.truncation = %r)", n_cut, n_rows, limit, cfg.truncation)
    names = ", ".join(map(str, files))
    if n_rows == 0:
        raise DataError(f"{names}: the files hold no rows; point data.train_files at real data")
    if n_rows == len(dropped):
        raise DataError(
            f"{names}: no prompts left: all {n_rows} rows are longer than {limit}; raise data.max_prompt_length"
        )


class PromptLoader:
    """Batches of prompts, epoch after epoch.

    Each epoch visits the records in an order seeded with seed + epoch (so any epoch can be
    replayed after resuming), in batches of exactly batch_size prompts: the last partial batch
    is dropped, so every step sees as many prompts. A shard (rank, world) yields its contiguous
    slice of each global batch: all ranks walk the same order without communicating.

    `drawn` counts the batches next_batch() handed out (the data position a checkpoint saves):
    dynamic sampling may draw several a step, so it is not derived from the step.
    """

    def __init__(
        self,
        records: list[PromptRecord],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        *,
        rank: int = 0,
        world: int = 1,
    ):
        # the validation pass refuses a batch that does not split into whole prompts per rank
        assert batch_size >= 1 and batch_size % world == 0, f"{batch_size} prompts over {world} ranks"
        assert 0 <= rank < world, f"rank {rank} in a world of {world}"
        if len(records) < batch_size:  # the files have enough rows (validated), but filtering may drop some
            raise DataError(
                f"data.train_batch_size = {batch_size} is larger than the {len(records)} prompts "
                f"loaded, so an epoch would have no step; lower data.train_batch_size or add data"
            )
        self.records, self.batch_size, self.shuffle, self.seed = records, batch_size, shuffle, seed
        self.rank, self.world = rank, world
        self.drawn = 0  # batches handed out by next_batch, over all epochs
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order), drawn once per epoch

    @property
    def steps_per_epoch(self) -> int:
        return len(self.records) // self.batch_size

    def shard(self, rank: int, world: int) -> "PromptLoader":
        """The same loader, yielding only rank's contiguous batch_size / world prompts of each batch."""
        return PromptLoader(self.records, self.batch_size, self.shuffle, self.seed, rank=rank, world=world)

    def order(self, epoch: int) -> list[int]:
        """The record indices of one epoch, in visiting order (the same on every rank)."""
        if not self.shuffle:
            return list(range(len(self.records)))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.records), generator=gen).tolist()

    def _batch(self, order: list[int], i: int) -> list[PromptRecord]:
        """This shard's prompts of batch i of an epoch visited in `order`."""
        per_rank = self.batch_size // self.world
        start = i * self.batch_size + self.rank * per_rank
        return [self.records[j] for j in order[start : start + per_rank]]

    @property
    def epoch(self) -> float:
        """Epochs drawn so far, fractional: drawn / steps_per_epoch."""
        return self.drawn / self.steps_per_epoch

    def next_batch(self) -> list[PromptRecord]:
        """The batch after the last one handed out (into the next epoch after an epoch's last)."""
        epoch, i = divmod(self.drawn, self.steps_per_epoch)
        if self._order[0] != epoch:
            self._order = (epoch, self.order(epoch))
        self.drawn += 1
        return self._batch(self._order[1], i)


def expand_groups(records: list[PromptRecord], n: int, first_uid: int) -> tuple[list[PromptRecord], list[int]]:
    """Repeat each prompt n times under one group uid, prompt-major: the n samples of prompt i
    are at [i*n, (i+1)*n) with uid first_uid + i, matching the rollout engines' output order."""
    assert n >= 1, f"rollout.n = {n} (the validation pass refuses it)"
    repeated = [rec for rec in records for _ in range(n)]
    uids = [first_uid + i for i in range(len(records)) for _ in range(n)]
    return repeated, uids
