"""The files a config names, checked before anything loads.

Cheap checks only: directory listings, config.json, the safetensors headers against the file
sizes, parquet metadata and the data_source column. What needs the real load (weight shapes,
the tokenizer's vocabulary against the model's) is checked where the model loads
(minirl.models.loading), as a UserError that names the file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from minirl.errors import UserError, describe
from minirl.validate.critic import uses_critic
from minirl.validate.lora import lora_file_problems
from minirl.validate.problem import Problem

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MODEL_DIR_FIX = "point it at a local Hugging Face model directory, or leave it empty to use model.preset"


def file_problems(cfg, pm) -> list[Problem]:
    return [
        *_model(cfg.model),
        *lora_file_problems(cfg),
        *_critic_model(cfg, pm),
        *_data(cfg, pm),
        *_custom_reward(cfg),
        *_tools(cfg, pm),
        *_output(cfg.trainer),
    ]


def _tools(cfg, pm) -> list[Problem]:
    """The tool config file loads: entries, class names, schemas (built here once, and again by the run)."""
    mt = cfg.rollout.multi_turn
    if not (mt.enable and mt.tool_config_path):
        return []
    from minirl.agent.tools import ToolFileError, ToolSet

    key = "rollout.multi_turn.tool_config_path"
    try:
        ToolSet.from_config(mt, pm["tools"]).close()
    except ToolFileError as exc:
        return [Problem(key, mt.tool_config_path, exc.rule, exc.fix)]
    except UserError as exc:  # an entry of the file: the message names it and its fix
        return [Problem(key, mt.tool_config_path, f"in the file, {exc}", "")]
    return []


def _model(m) -> list[Problem]:
    if not m.path:
        from minirl.models.presets import PRESETS

        if m.preset not in PRESETS:
            fix = f"choose one of {', '.join(PRESETS)}, or set model.path to a local Hugging Face directory"
            return [Problem("model.preset", m.preset, "not a preset", fix)]
        return _tokenizer_dir("model.tokenizer", m.tokenizer) if m.tokenizer else []
    problems = _model_dir(m.path, "model.path", MODEL_DIR_FIX)
    if m.tokenizer:
        problems += _tokenizer_dir("model.tokenizer", m.tokenizer)
    elif not problems:
        problems += _tokenizer_dir("model.path", m.path)
    return problems


def _critic_model(cfg, pm) -> list[Problem]:
    """critic.model.path, when a critic trains on a backbone of its own (empty: the actor's model)."""
    path = cfg.critic.model.path
    if not path or not uses_critic(cfg, pm):
        return []
    fix = "point it at a local Hugging Face model directory, or leave it empty for the actor's model"
    return _model_dir(path, "critic.model.path", fix)


def _model_dir(path: str, key: str, fix: str) -> list[Problem]:
    """A directory with a readable config.json of a known model_type and whole weights."""
    p = Path(path).expanduser()
    if not p.exists():
        return [Problem(key, path, "no such directory", fix)]
    if not p.is_dir():
        return [Problem(key, path, "is a file, not a directory", fix)]
    if not (p / "config.json").is_file():
        return [Problem(key, path, "has no config.json", "point it at the directory that holds config.json")]
    problems = _config_json(key, p / "config.json")
    weights = sorted(p.glob("*.safetensors"))
    if not weights and not any(p.glob("pytorch_model*.bin")):
        problems.append(Problem(key, path, "has no weights (*.safetensors)", "copy the checkpoint's weight files in"))
    for f in weights:
        problems += _safetensors(key, f)
    return problems


def _in_model_dir(key: str, f: Path, rule: str, fix: str) -> list[Problem]:
    """The problem of one file of a model directory, reported against the directory's key."""
    return [Problem(key, str(f.parent), f"{f.name} {rule}", fix)]


def _config_json(key: str, f: Path) -> list[Problem]:
    restore = "restore the checkpoint's config.json"
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _in_model_dir(key, f, f"is not valid JSON ({exc})", restore)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not model_type:
        return _in_model_dir(key, f, "has no model_type", restore)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        fix = "fix model_type, or upgrade transformers if the model is newer"
        return _in_model_dir(key, f, f"has model_type {model_type!r}, unknown to transformers", fix)
    return []


def _safetensors(key: str, f: Path) -> list[Problem]:
    """The header says how many bytes the tensors take; a shorter file was cut off mid-copy."""
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as exc:
        return _in_model_dir(key, f, f"is not a safetensors file ({exc})", "copy the weight file again")
    size = f.stat().st_size
    if size < 8 + n + end:
        return _in_model_dir(key, f, f"is truncated ({size} of {8 + n + end} bytes)", "copy the weight file again")
    return []


def _tokenizer_dir(key: str, path: str) -> list[Problem]:
    p = Path(path).expanduser()
    if not p.is_dir():
        return [Problem(key, path, "is not a directory", "point it at a local tokenizer or model directory")]
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        fix = "set model.tokenizer to a directory that has them (README: a tokenizer offline)"
        return [Problem(key, path, f"has no tokenizer files ({', '.join(TOKENIZER_FILES)})", fix)]
    return []


def _data(cfg, pm) -> list[Problem]:
    d, t = cfg.data, cfg.trainer
    rows, problems = 0, []
    registered = None if cfg.custom_reward_function.path else pm["reward_functions"]  # None: one function for all
    for path in d.train_files:
        n, p = _parquet(path, "data.train_files", registered)
        rows, problems = rows + n, problems + p
    if not problems and d.train_files and rows < d.train_batch_size:
        rule = f"larger than the {rows} rows of data.train_files (an epoch would have no step)"
        problems.append(Problem("data.train_batch_size", d.train_batch_size, rule, f"use at most {rows}, or add data"))
    if t.test_freq > 0 or t.val_before_train:
        for path in d.val_files:
            problems += _parquet(path, "data.val_files", registered)[1]
    return problems


def _parquet(path: str, key: str, rewards) -> tuple[int, list[Problem]]:
    """(rows, problems) of one data file; every data_source must have a reward function."""
    if not os.path.isfile(path):
        rule = "is a directory, not a parquet file" if os.path.isdir(path) else "no such file"
        return 0, [Problem(key, path, rule, "list parquet files in verl's schema (make data writes data/*)")]
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["data_source"])
        sources = table.column("data_source").to_pylist()
    except UnicodeDecodeError as exc:
        rule = f"the data_source column holds bytes that are not UTF-8 ({exc.reason})"
        return 0, [Problem(key, path, rule, "re-encode the text as UTF-8 when writing the file")]
    except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError, UnicodeDecodeError, KeyError...
        rule = f"cannot read as parquet with a data_source column ({describe(exc)})"
        return 0, [Problem(key, path, rule, "write it in verl's schema (see scripts/make_data.py)")]
    if not sources:
        return 0, [Problem(key, path, "holds no rows", "point it at a file with data")]
    return len(sources), _unrewarded(sources, path, key, rewards)


def _unrewarded(sources: list[Any], path: str, key: str, rewards) -> list[Problem]:
    if rewards is None:
        return []
    out, seen = [], set()
    for row, src in enumerate(sources):
        if not isinstance(src, str) or src in seen:
            continue  # a non-string data_source is the loader's error, with its row
        seen.add(src)
        if src not in rewards:
            fix = (
                f"registered: {', '.join(sorted(rewards.items))}; fix the column, point custom_reward_function.path "
                "at a Python file with verl's compute_score (it scores every data_source), or register a function "
                "with the minirl_reward_functions hook"
            )
            rule = f"data_source {src!r} (row {row}) has no reward function"
            out.append(Problem(key, path, rule, fix))
    return out


def _custom_reward(cfg) -> list[Problem]:
    """custom_reward_function: the file imports and defines the function with verl's parameters
    (loading runs the file's top level, as the trainer will)."""
    custom = cfg.custom_reward_function
    if not custom.path:
        return []
    from minirl.reward.custom import CustomRewardError, load_custom_function

    try:
        load_custom_function(custom.path, custom.name, batch=cfg.reward.reward_manager == "batch")
    except CustomRewardError as exc:
        return [Problem(exc.key, exc.value, exc.rule, exc.fix)]
    return []


def _output(t) -> list[Problem]:
    """The run directory must be creatable: no regular file on its path, a writable parent."""
    run_dir, key = Path(t.default_local_dir).expanduser() / t.experiment_name, "trainer.default_local_dir"
    existing = next(parent for parent in (run_dir, *run_dir.parents) if parent.exists())  # "/" at least
    if not existing.is_dir():
        return [Problem(key, t.default_local_dir, f"{existing} is a file, not a directory", "choose another directory")]
    if not os.access(existing, os.W_OK):
        return [Problem(key, t.default_local_dir, f"{existing} is not writable", "choose a directory you can write to")]
    return []
