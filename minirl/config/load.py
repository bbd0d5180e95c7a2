"""TOML configuration -> frozen dataclasses, one per section.

Precedence: dataclass defaults < the file's sections < the file's ``[profiles.<name>]`` tables
< command-line overrides ``section.key=value`` (the value parsed as TOML, bare words as strings).
Every layer is checked on its own, so an error names the layer it came from, the key, what is
wrong, and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from minirl.config.schema import CORE_SECTIONS
from minirl.errors import UserError


class ConfigError(UserError):
    """A user mistake in a config file or an override; the message says where and how to fix it."""


@dataclass(frozen=True)
class LoadError:
    """A key that did not load (unknown, or of the wrong type): `key` (dotted, as written) and
    the line that says where it came from, what is wrong and the fix."""

    key: str
    line: str


@dataclass(frozen=True)
class Config:
    """The resolved configuration: ``cfg.actor``, ``cfg.rollout``, … and plugin sections."""

    sections: dict[str, Any]
    profile: str | None = None
    source: str = "(defaults)"
    origins: dict[str, str] = dataclasses.field(default_factory=dict)  # "actor.optim.lr" -> its layer
    # what load_config(strict=False) left out, one line each (an unknown key, a wrong type): the
    # validation pass reports them with the invalid values, in one error (minirl.validate.core)
    load_errors: tuple[LoadError, ...] = ()

    def origin(self, key: str) -> str:
        """Where `key` (dotted) got its value: a file, a profile table, the command line, or default."""
        return self.origins.get(key, "default")

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"config has no section {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(section) for name, section in self.sections.items()}

    # values derived from several keys, defined here once

    @property
    def rollout_world(self) -> int:
        """The rollout ranks of an asynchronous job, rollout.nnodes x rollout.n_gpus_per_node (0
        without async_training: every rank trains and generates)."""
        r = self.rollout
        return r.nnodes * r.n_gpus_per_node if self.async_training.enable else 0

    def engine_dtype(self, device) -> Any:
        """The rollout engines' torch dtype on `device`: rollout.dtype, "auto" being bfloat16 on
        CUDA and float32 elsewhere."""
        import torch

        if self.rollout.dtype != "auto":
            return getattr(torch, self.rollout.dtype)
        return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def load_config(
    path: str | None,
    overrides: list[str] = (),
    profile: str | None = None,
    extra_sections: dict[str, type] | None = None,
    strict: bool = True,
) -> Config:
    """Read `path` (or nothing), apply its profile table and the overrides, check every key.
    A key that does not load (unknown, wrong type) is left out and listed; strict raises one
    ConfigError naming all of them, else they are kept in cfg.load_errors for the validation
    pass to report along with the invalid values."""
    schema = {**CORE_SECTIONS, **(extra_sections or {})}
    file_data = _read_toml(path) if path else {}
    profiles = file_data.pop("profiles", {})
    layers = [(f"{path}", file_data)]
    if profile is not None:
        if profile not in profiles:
            raise ConfigError(
                f"--profile {profile!r}: {path} has no [profiles.{profile}] table; "
                f"available: {', '.join(sorted(profiles)) or '(none)'}"
            )
        layers.append((f"{path} [profiles.{profile}]", profiles[profile]))
    layers.append(("command line", parse_overrides(overrides)))
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    errors: list[LoadError] = []
    for source, data in layers:
        data = _checked_layer(data, schema, source, errors)
        _deep_merge(merged, data)
        origins.update(dict.fromkeys(flatten(data), source))  # TOML has no null: every key is kept
    if strict and errors:
        raise ConfigError(error_lines([e.line for e in errors], "config keys that do not load"))
    sections = {name: _build(cls, merged.get(name, {}), name, "merged config") for name, cls in schema.items()}
    _derive_defaults(sections, origins)
    return Config(sections, profile, path or "(defaults)", origins, tuple(errors))


def error_lines(lines: list[str], what: str) -> str:
    """One line, or a count and one indented line per problem."""
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} {what}:\n  " + "\n  ".join(lines)


FP8_TIS_CAP = 2.0  # actor.tis_imp_ratio_cap when an fp8 KV cache turns it on (verl's usual cap)


def _derive_defaults(sections: dict[str, Any], origins: dict[str, str]) -> None:
    """Defaults that follow another key: an fp8 KV cache or fp8 GEMMs sample from a policy slightly
    off the trainer's (docs/algorithms.md §5), so truncated importance sampling is on with either
    unless actor.tis_imp_ratio_cap was set (-1 keeps it off) or the rollout keeps no log-probs."""
    actor, rollout = sections.get("actor"), sections.get("rollout")
    if actor is None or rollout is None or "actor.tis_imp_ratio_cap" in origins or not rollout.calculate_log_probs:
        return
    for key, value, off in (
        ("kv_cache_dtype", rollout.kv_cache_dtype, "auto"),
        ("quantization", rollout.quantization, "none"),
    ):
        if value != off:
            sections["actor"] = dataclasses.replace(actor, tis_imp_ratio_cap=FP8_TIS_CAP)
            origins["actor.tis_imp_ratio_cap"] = f"on with rollout.{key} = {value!r}"
            return


def profiles_in(path: str) -> list[str]:
    return sorted(_read_toml(path).get("profiles", {}))


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory; name a TOML file such as bench.toml") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None


def parse_overrides(items: typing.Iterable[str]) -> dict[str, Any]:
    """`actor.optim.lr=1e-5` -> {"actor": {"optim": {"lr": 1e-5}}}; values are TOML, else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"command line: {item!r} is not an override; write section.key=value")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _parse_value(key.strip(), raw.strip())
    return out


def _parse_value(key: str, raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if raw[:1] not in "[{\"'":
            return raw  # a bare word such as grpo or low_var_kl
        # meant as TOML; the shell often ate the quotes: key=["a"] unquoted arrives as key=[a]
        raise ConfigError(
            f"command line: {key}={raw} is not valid TOML; quote the strings in it and the "
            f"whole override, so the shell keeps the quotes: {_quoted_override(key, raw)}"
        ) from None


def _quoted_override(key: str, raw: str) -> str:
    if raw.startswith("[") and raw.endswith("]"):
        raw = "[" + ", ".join(_toml_word(w.strip()) for w in raw[1:-1].split(",") if w.strip()) + "]"
    return f"'{key}={raw}'"


def _toml_word(word: str) -> str:
    try:
        tomllib.loads(f"v = {word}")
        return word
    except tomllib.TOMLDecodeError:
        return '"' + word.strip("\"'") + '"'


def plugin_modules(path: str | None, overrides: typing.Iterable[str], profile: str | None) -> tuple[list[str], str]:
    """[plugins] modules and the layer that set them, read (and checked) before the full config
    because plugins may add sections to it."""
    file_data = _read_toml(path) if path else {}
    layers = [(f"{path}", file_data)]
    if profile is not None:
        layers.append((f"{path} [profiles.{profile}]", file_data.get("profiles", {}).get(profile, {})))
    layers.append(("command line", parse_overrides(overrides)))
    modules, source = [], "default"
    for where, data in layers:
        table = data.get("plugins", {})
        errors: list[LoadError] = []
        _checked_layer({"plugins": table}, {"plugins": CORE_SECTIONS["plugins"]}, where, errors)
        if errors:
            raise ConfigError(error_lines([e.line for e in errors], "config keys that do not load"))
        if "modules" in table:
            modules, source = table["modules"], where
    return modules, source


def _deep_merge(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _checked_layer(data: dict, schema: dict[str, type], source: str, errors: list[LoadError]) -> dict:
    """The layer's tables with every key that does not load left out and added to `errors`."""
    kept = {}
    for name, value in data.items():
        if name not in schema:
            errors.append(LoadError(name, f"{source}: unknown section [{name}]{_suggest(name, schema)}"))
        elif not isinstance(value, dict):
            errors.append(LoadError(name, f"{source}: [{name}] must be a table, got {_tname(value)}"))
        else:
            kept[name] = _checked_table(schema[name], value, name, source, errors)
    return kept


def _checked_table(cls: type, data: dict, where: str, source: str, errors: list[LoadError]) -> dict:
    fields, hints, kept = {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls), {}
    for key, value in data.items():
        full = f"{where}.{key}"
        if key not in fields:
            errors.append(LoadError(full, f"{source}: unknown key {full}{_suggest_key(cls, key, where)}"))
        elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            kept[key] = _checked_table(hints[key], value, full, source, errors)
        else:
            try:
                _coerce(value, hints[key], full, source)
            except ConfigError as exc:
                errors.append(LoadError(full, str(exc)))
            else:
                kept[key] = value
    return kept


def _build(cls: type, data: dict, where: str, source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {where}.{key}{_suggest_key(cls, key, where)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}", source)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a table, got {_tname(value)}")
        return _build(hint, value, key, source)
    if origin is typing.Union:  # Optional[X], or X | list[X] (a list value picks the list)
        inner = [a for a in args if a is not type(None)]
        if value is None:
            return None
        lists = [a for a in inner if typing.get_origin(a) is list]
        pick = lists[0] if isinstance(value, list) and lists else next((a for a in inner if a not in lists), inner[0])
        return _coerce(value, pick, key, source)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(
                f"{source}: {key} must be a list, got {_tname(value)} {value!r}{_list_fix(key, value, source)}"
            )
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    return _scalar(value, hint, key, source)


def _list_fix(key: str, value: Any, source: str) -> str:
    """One rule for every list key: a single value is refused, never split or wrapped, and the
    fix is written for the layer it came from."""
    if isinstance(value, dict):
        return ""
    item = _toml_value(value)
    if source == "command line":
        return f"; write '{key}=[{item}]' (single quotes keep the shell off the double ones)"
    return f"; write {key.rsplit('.', 1)[1]} = [{item}] (a list of one)"


def _scalar(value: Any, hint: type, key: str, source: str) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    is_bool_as_int = hint is int and isinstance(value, bool)  # TOML true is not 1
    if not isinstance(value, hint) or is_bool_as_int:
        raise ConfigError(
            f"{source}: {key} must be {hint.__name__}, got {_tname(value)} {value!r}"
            f"{' (write true or false)' if hint is bool else ''}"
        )
    return value


def _suggest_key(cls: type, key: str, where: str) -> str:
    """Suggest the closest key, also inside nested tables (actor.lr -> actor.optim.lr); never a
    wall of every key: without a close one, point at --print-config."""
    flat = _flat_keys(cls, where)
    by_leaf = {full.rsplit(".", 1)[1]: full for full in reversed(flat)}
    close = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.5)
    if close:
        return f"; did you mean {by_leaf[close[0]]!r}?"
    return f"; [{where}] has no key like it (python -m minirl --print-config shows every key)"


def _flat_keys(cls: type, prefix: str) -> list[str]:
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        full = f"{prefix}.{f.name}"
        keys += _flat_keys(hint, full) if dataclasses.is_dataclass(hint) else [full]
    return keys


def _suggest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(choices))}"


def _tname(value: Any) -> str:
    return type(value).__name__


# ---------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------


def to_toml(cfg: Config, unused: typing.Collection[str] = ()) -> str:
    """The resolved config as TOML (unset optional keys appear as comments). Keys under an
    `unused` prefix ("critic" when no critic is built) appear only where a layer set them: a
    default written out would count as set, and draw an "ignored" notice when the file runs."""

    def keep(key: str) -> bool:
        return key in cfg.origins or not any(key == p or key.startswith(f"{p}.") for p in unused)

    lines = [f"# written only where set (this run does not use them): {', '.join(unused)}", ""] if unused else []
    for name, section in cfg.to_dict().items():
        _emit_table(lines, name, _kept(section, name, keep))
    return "\n".join(lines).strip() + "\n"


def _kept(table: dict, prefix: str, keep: typing.Callable[[str], bool]) -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            value = _kept(value, f"{prefix}.{key}", keep)
            if value:
                out[key] = value
        elif keep(f"{prefix}.{key}"):
            out[key] = value
    return out


def _emit_table(lines: list[str], name: str, table: dict) -> None:
    if not table:
        return
    lines.append(f"[{name}]")
    nested = {k: v for k, v in table.items() if isinstance(v, dict)}
    for key, value in table.items():
        if key in nested:
            continue
        lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
    lines.append("")
    for key, value in nested.items():
        _emit_table(lines, f"{name}.{key}", value)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """{"actor": {"optim": {"lr": 1}}} -> {"actor.optim.lr": 1}; None (an unset key) is left out."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        elif value is not None:  # unset optional keys are absent from the TOML
            out[f"{prefix}{key}"] = value
    return out
