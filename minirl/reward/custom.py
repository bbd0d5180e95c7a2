"""custom_reward_function: one function in a Python file, scoring every data_source (verl's keys).

The file is loaded by path, without packaging or PYTHONPATH. Its function has verl's signature,
called with keywords:

    naive: compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
    batch: compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list

Every way the file can be wrong (missing, unimportable, no such function, not callable, other
parameter names) is a CustomRewardError: one line naming the key, the file (and line) and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from typing import Any, Callable

from minirl.errors import UserError, describe

PATH_KEY, NAME_KEY = "custom_reward_function.path", "custom_reward_function.name"
NAIVE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class CustomRewardError(UserError):
    """A broken custom reward file; key/value/rule/fix become one line of the validation report."""

    def __init__(self, key: str, value: Any, rule: str, fix: str):
        super().__init__(f"{key} = {value!r}: {rule}; {fix}")
        self.key, self.value, self.rule, self.fix = key, value, rule, fix


def load_custom_function(path: str, name: str, batch: bool = False) -> Callable:
    """The function `name` of the file at `path`, checked to accept verl's keyword arguments."""
    module = _import_file(path)
    fn = getattr(module, name, None)
    if fn is None:
        found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        hint = difflib.get_close_matches(name, found, n=1)
        rule = f"{path} defines no {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        raise CustomRewardError(NAME_KEY, name, rule, "set it to the name of the reward function in the file")
    if not callable(fn):
        rule = f"{path}: {name!r} is a {type(fn).__name__}, not a function"
        raise CustomRewardError(NAME_KEY, name, rule, "point it at a function")
    _check_signature(fn, name, path, BATCH_ARGS if batch else NAIVE_ARGS)
    return fn


def _import_file(path: str):
    if not os.path.exists(path):
        raise CustomRewardError(PATH_KEY, path, "no such file", "point it at a Python file with the reward function")
    if not os.path.isfile(path):
        raise CustomRewardError(PATH_KEY, path, "is a directory, not a Python file", "point it at a .py file")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    module_name = f"minirl_custom_reward_{digest}"  # one module per file; pickling finds it here
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CustomRewardError(PATH_KEY, path, "cannot be loaded as a Python module", "give it a .py name")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - SyntaxError, ImportError, anything raised at import, SystemExit
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        rule = f"importing it failed at {_where(exc, path)}"
        fix = "fix the file (python FILE shows the full traceback)"
        if isinstance(exc, ModuleNotFoundError):
            fix = "install the missing package, or remove the import"
        raise CustomRewardError(PATH_KEY, path, rule, fix) from exc
    return module


def _where(exc: BaseException, path: str) -> str:
    """ "file:line: TypeName: message" of the failure: the offending line of a SyntaxError, else
    the last line of the user's file in the traceback."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
    target = os.path.abspath(path)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == target]
    line = f"{path}:{frames[-1].lineno}" if frames else path
    return f"{line}: {describe(exc)}"


def _check_signature(fn: Callable, name: str, path: str, args: tuple[str, ...]) -> None:
    """verl calls the function with keywords, so other parameter names would fail every call."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    try:
        sig.bind(**dict.fromkeys(args))
    except TypeError as exc:
        rule = f"{path}: {name}{sig} cannot be called with the keywords {', '.join(args)} ({exc})"
        raise CustomRewardError(NAME_KEY, name, rule, f"give it verl's parameters: {name}({', '.join(args)})") from None
