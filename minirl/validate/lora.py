"""The LoRA keys of [model] (lora_rank, lora_alpha, target_modules, exclude_modules, lora_dropout,
lora_adapter_path, lora_save_merged): their values, the combinations minirl refuses, and (with
the files) the modules they name and the adapter directory they point at.

The module names are checked against the model's structure, built on the meta device from the
preset or model.path's config.json (no weights read): milliseconds even for a 7B shape.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from minirl.config.load import Config
from minirl.validate.problem import Problem

LORA_KEYS = ("lora_alpha", "target_modules", "exclude_modules", "lora_dropout", "lora_save_merged")
ALL_LINEAR = "all-linear"
# what the log-prob head and the embedding read as plain tensors: an adapter there would be ignored
REFUSED_TARGETS = {
    "lm_head": "the log-prob head (and its fused kernel) multiplies by lm_head's weight directly",
    "embed_tokens": "minirl's LoRA adapts linear layers; the embedding is a lookup table",
}


def on(m) -> bool:
    return m.lora_rank > 0 or bool(m.lora_adapter_path)


def lora_problems(cfg: Config, pm) -> list[Problem]:
    """The values of the LoRA keys, before any file is read."""
    m, out = cfg.model, []
    if m.lora_rank < 0:
        out.append(Problem("model.lora_rank", m.lora_rank, "must be >= 0 (0: LoRA off)", "use e.g. 64, or 0"))
    elif not on(m):
        return _set_while_off(cfg)
    if m.lora_alpha <= 0:
        rule = "must be > 0 (the adapters are scaled by lora_alpha / lora_rank)"
        out.append(Problem("model.lora_alpha", m.lora_alpha, rule, "use e.g. 2 x lora_rank, or lora_rank"))
    if not 0.0 <= m.lora_dropout < 1.0:
        out.append(
            Problem("model.lora_dropout", m.lora_dropout, "must lie in [0, 1)", "use 0.0 (RL's usual), or e.g. 0.05")
        )
    if isinstance(m.target_modules, str) and m.target_modules != ALL_LINEAR:
        out += _regex_problems("model.target_modules", m.target_modules)
    if isinstance(m.exclude_modules, str) and m.exclude_modules:
        out += _regex_problems("model.exclude_modules", m.exclude_modules)
    if isinstance(m.target_modules, list) and not m.target_modules:
        out.append(
            Problem("model.target_modules", [], "names no module", f"use {ALL_LINEAR!r} or e.g. ['q_proj', 'v_proj']")
        )
    return out


def _set_while_off(cfg: Config) -> list[Problem]:
    """Each LoRA key given a value other than its default while LoRA is off: it would have no
    effect. A key written at its default (what --print-config writes) is no mistake."""
    m, default = cfg.model, type(cfg.model)()
    out = []
    for key in LORA_KEYS:
        if f"model.{key}" in cfg.origins and getattr(m, key) != getattr(default, key):
            rule = "has no effect: LoRA is off (model.lora_rank = 0)"
            fix = f"set model.lora_rank > 0 (e.g. 64) to train adapters, or remove model.{key}"
            out.append(Problem(f"model.{key}", getattr(m, key), rule, fix))
    return out


def _regex_problems(key: str, pattern: str) -> list[Problem]:
    try:
        re.compile(pattern)
    except re.error as exc:
        return [
            Problem(
                key,
                pattern,
                f"a string is a regular expression (peft), and this one is invalid ({exc})",
                "fix it, or give a list of module names",
            )
        ]
    return []


# ------------------------------------------------------------------------------------------ files


def lora_file_problems(cfg: Config) -> list[Problem]:
    """The modules target_modules and exclude_modules name, and the adapter directory."""
    m = cfg.model
    if not on(m):
        return []
    linears = _linear_names(m)
    if linears is None:  # the model itself does not load: its own key reports that
        return []
    out = _target_problems(m, linears)
    if m.lora_adapter_path:
        out += _adapter_problems(m, linears)
    return out


def _linear_names(m) -> dict[str, tuple[int, int]] | None:
    """{module name: (out_features, in_features)} of the model's nn.Linear layers, from a model
    built on the meta device; None when the config does not load."""
    import torch

    from minirl.models.loading import meta_model
    from minirl.models.presets import PRESETS, preset_config

    try:
        if m.path:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(Path(m.path).expanduser()), local_files_only=True)
        elif m.preset in PRESETS:
            config = preset_config(m.preset)
        else:
            return None
        model = meta_model(config, torch.float32, "eager")
    except Exception:  # reported by model.path's own checks
        return None
    return {
        n: (mod.out_features, mod.in_features) for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
    }


def _matches(name: str, entry: str) -> bool:
    """peft's rule for a list entry: the module's full name, or its name ends with '.' + entry."""
    return name == entry or name.endswith("." + entry)


def _target_problems(m, linears: dict) -> list[Problem]:
    if m.lora_adapter_path:
        return []  # the adapter's own config names its modules
    out = []
    for key in ("model.target_modules", "model.exclude_modules"):
        spec = getattr(m, key.split(".")[1])
        if isinstance(spec, list):
            for entry in spec:
                refused = next((why for leaf, why in REFUSED_TARGETS.items() if _matches(f"x.{leaf}", entry)), None)
                if refused and key.endswith("target_modules"):
                    out.append(Problem(key, spec, f"{entry!r} cannot carry an adapter: {refused}", "leave it out"))
                elif not any(_matches(n, entry) for n in linears):
                    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears} - set(REFUSED_TARGETS))
                    fix = f"choose among {leaves}, or use {ALL_LINEAR!r}"
                    out.append(Problem(key, spec, f"{entry!r} names no linear layer of the model", fix))
        elif key.endswith("target_modules") and spec != ALL_LINEAR and not _regex_problems(key, spec):
            hit = [n for n in linears if re.fullmatch(spec, n)]
            if not hit:
                fix = f"write a regex that matches full names such as {next(iter(linears))!r}, or use a list"
                out.append(Problem(key, spec, "matches no linear layer of the model", fix))
            refused = [n for n in hit if n.rsplit(".", 1)[-1] in REFUSED_TARGETS]
            if refused:
                why = REFUSED_TARGETS[refused[0].rsplit(".", 1)[-1]]
                out.append(
                    Problem(key, spec, f"matches {refused[0]!r}, which cannot carry an adapter: {why}", "exclude it")
                )
    return out


def _adapter_problems(m, linears: dict) -> list[Problem]:
    """A peft LoRA directory whose base model is this one: its config's base_model_name_or_path
    (where it names a preset or a directory) and every adapter tensor's shape."""
    key, path = "model.lora_adapter_path", m.lora_adapter_path
    p = Path(path).expanduser()
    fix = (
        "point it at a peft adapter directory (adapter_config.json, adapter_model.safetensors; "
        "minirl writes one at save_hf_freq)"
    )
    if not p.is_dir():
        return [Problem(key, path, "no such directory", fix)]
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (p / f).is_file()]
    if missing:
        return [Problem(key, path, f"has no {missing[0]}", fix)]
    try:
        config = json.loads((p / "adapter_config.json").read_text())
        header = _safetensors_header(p / "adapter_model.safetensors")
    except (OSError, ValueError, struct.error) as exc:
        return [Problem(key, path, f"does not read ({exc})", fix)]
    if config.get("peft_type", "LORA") != "LORA":
        return [Problem(key, path, f"holds a {config.get('peft_type')} adapter, not LoRA", fix)]
    out = []
    base, ours = config.get("base_model_name_or_path") or "", m.path or m.preset
    if base and not _same_base(base, ours):
        rule = f"the adapter was trained on {base!r}, and this run's model is {ours!r}"
        out.append(
            Problem(key, path, rule, "use an adapter of this base model, or set model.path / model.preset to its base")
        )
        return out
    if m.lora_rank > 0 and config.get("r") not in (None, m.lora_rank):
        rule = f"the adapter has rank {config.get('r')}, and model.lora_rank = {m.lora_rank}"
        out.append(Problem(key, path, rule, "set model.lora_rank = 0 (the adapter's rank is used) or to its rank"))
    for name, info in header.items():
        problem = _tensor_problem(name, info.get("shape", []), linears)
        if problem:
            out.append(
                Problem(
                    key,
                    path,
                    f"{problem}: the adapter belongs to another base model",
                    "use an adapter trained on this model",
                )
            )
            break
    return out


def _same_base(recorded: str, ours: str) -> bool:
    from minirl.models.presets import PRESETS

    if recorded == ours:
        return True
    if recorded in PRESETS or ours in PRESETS:
        return False
    a, b = Path(recorded).expanduser(), Path(ours).expanduser()
    if a.is_dir() and b.is_dir():
        return os.path.realpath(a) == os.path.realpath(b)
    return True  # a hub name against a local copy: the tensor shapes decide


def _tensor_problem(name: str, shape: list[int], linears: dict) -> str | None:
    """Why one adapter tensor (peft's file name: base_model.model.<module>.lora_A.weight) does
    not fit the model, or None."""
    module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
    if module not in linears:
        return f"{name} adapts {module!r}, which this model does not have"
    out_f, in_f = linears[module]
    if kind.startswith("A") and (len(shape) != 2 or shape[1] != in_f):
        return f"{name} has shape {shape}, and {module} takes {in_f} inputs"
    if kind.startswith("B") and (len(shape) != 2 or shape[0] != out_f):
        return f"{name} has shape {shape}, and {module} has {out_f} outputs"
    return None


def _safetensors_header(f: Path) -> dict:
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header
