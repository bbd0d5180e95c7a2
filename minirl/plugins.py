"""The plugin manager and the component registries it builds.

Plugins come from three places, in this order: the built-ins in ``minirl_plugins``, installed
distributions that declare the entry-point group ``minirl``, and modules named in the config
(``[plugins] modules = [...]``). Built-ins register exactly as a third-party plugin would.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable

import pluggy
import torch

from minirl import hookspecs
from minirl.errors import UserError, reraise_if_debug, wrapped

BUILTIN_MODULES = (
    "minirl_plugins.algorithms.advantage",
    "minirl_plugins.algorithms.kl",
    "minirl_plugins.algorithms.policy_loss",
    "minirl_plugins.rewards",
    "minirl_plugins.engines.hf",
    "minirl_plugins.engines.native",
    "minirl_plugins.engines.sglang",
    "minirl_plugins.observe.loggers",
    "minirl_plugins.algorithms.optim",
    "minirl_plugins.parallel.checkpointing",
    "minirl_plugins.parallel.ulysses",
    "minirl_plugins.parallel.fsdp2",
    "minirl_plugins.launchers",
    "minirl_plugins.launchers.ray",
    "minirl_plugins.agents",
    "minirl_plugins.tools",
)

ENTRY_POINT_GROUP = "minirl"
BUILTIN_PREFIX = "minirl_plugins."

# kind -> (what one component is called, the config key that selects one), for error messages;
# the registration hook of each kind is minirl_<kind>
KINDS = {
    "advantage_estimators": ("advantage estimator", "algorithm.adv_estimator"),
    "kl_estimators": ("KL estimator", "actor.kl_loss_type / algorithm.kl_penalty"),
    "policy_losses": ("policy loss", "actor.policy_loss"),
    "reward_functions": ("reward function", "the data_source column of the data"),
    "rollout_engines": ("rollout engine", "rollout.name"),
    "loggers": ("logger", "trainer.logger"),
    "config_sections": ("config section", "a [section] of the config file"),
    "launchers": ("launcher", "trainer.launcher"),
    "agent_loops": ("agent loop", "rollout.agent.default_agent_loop / the agent_name column of the data"),
    "tools": ("tool", "the class_name of an entry of rollout.multi_turn.tool_config_path"),
}


class PluginError(UserError):
    """A plugin is broken, missing, or two plugins claim the same name."""


@dataclass
class Registry:
    """name -> component for one kind, remembering which plugin gave each name."""

    kind: str
    items: dict[str, Any] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, component: Any, provider: str) -> None:
        if name in self.items:
            raise PluginError(
                f"{self.kind}: the name {name!r} is registered twice, by {self.providers[name]} "
                f"and by {provider}; rename one of them or drop one plugin"
            )
        third_party = BUILTIN_PREFIX not in provider and self.kind != "config_sections"
        what = f"{KINDS[self.kind][0]} {name!r} of {provider}"
        self.items[name] = guarded(component, what, RESULT_CHECKS.get(self.kind)) if third_party else component
        self.providers[name] = provider

    def get(self, name: str) -> Any:
        if name not in self.items:
            raise PluginError(self.unknown(name))
        return self.items[name]

    def unknown(self, name: str) -> str:
        """The message for a name nobody registered: the closest name, then the registered ones."""
        rule, fix = self.unknown_rule_fix(name)
        return f"{KINDS[self.kind][1]} = {name!r}: {rule}; {fix}"

    def unknown_rule_fix(self, name: str) -> tuple[str, str]:
        """`unknown`'s rule and fix, for the validation pass, which names the key itself."""
        hint = difflib.get_close_matches(name, list(self.items), n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        registered = ", ".join(sorted(self.items)) or "(none)"
        return f"no such {KINDS[self.kind][0]}{did_you_mean}", f"registered: {registered}"

    def __contains__(self, name: str) -> bool:
        return name in self.items


def _plugin_label(pm: pluggy.PluginManager, plugin: object) -> str:
    name = pm.get_name(plugin) or repr(plugin)
    return f"plugin {name!r}"


class PluginManager:
    """Loads the plugins and builds every registry from their answers."""

    def __init__(
        self, modules: Iterable[str] = (), *, entry_points: bool = True, source: str = "config [plugins] modules"
    ):
        self.pm = pluggy.PluginManager("minirl")
        self.pm.add_hookspecs(hookspecs)
        for name in BUILTIN_MODULES:
            self._register_module(name, "built-in")
        if entry_points:
            self._load_entry_points()
        for name in modules:
            self._register_module(name, source)
        self._check_hook_names()
        self.pm.check_pending()  # anything our own check does not cover
        self.hook = self.pm.hook
        self.registries = {kind: self._collect(kind, f"minirl_{kind}") for kind in KINDS}

    def _register_module(self, name: str, source: str) -> None:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise self._import_failed(name, source, exc) from exc  # the module imports something missing
            raise PluginError(
                f"cannot import plugin module {name!r} ({source}): no such module; check the name "
                "and that its directory is on PYTHONPATH"
            ) from exc
        except Exception as exc:  # a SyntaxError, or anything the module raises while importing
            reraise_if_debug()
            raise self._import_failed(name, source, exc) from exc
        if self.pm.is_registered(module):
            return
        try:
            self.pm.register(module, name=name)
        except pluggy.PluginValidationError as exc:  # e.g. an argument the hook does not pass
            detail = " ".join(str(exc).split())
            raise PluginError(f"plugin module {name!r} ({source}): {detail}; see minirl/hookspecs.py") from exc

    @staticmethod
    def _import_failed(name: str, source: str, exc: BaseException) -> PluginError:
        return PluginError(str(wrapped(f"importing plugin module {name!r} ({source})", exc)))

    def _check_hook_names(self) -> None:
        """pluggy's check_pending, with the plugin named and the closest hook suggested."""
        specs = [n for n in dir(hookspecs) if n.startswith("minirl_")]
        for hook_name, caller in vars(self.pm.hook).items():
            if hook_name.startswith("_") or caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                hint = difflib.get_close_matches(hook_name, specs, n=1)
                fix = f"did you mean {hint[0]!r}?" if hint else "see minirl/hookspecs.py for the hook names"
                raise PluginError(
                    f"{_plugin_label(self.pm, impl.plugin)} implements {hook_name!r}, which is not a minirl hook; {fix}"
                )

    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must name itself
                reraise_if_debug()
                raise PluginError(
                    f"entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}) failed to load: {exc}"
                ) from exc
            if not self.pm.is_registered(plugin):
                self.pm.register(plugin, name=f"{ep.value}")

    def _collect(self, kind: str, hook_name: str) -> Registry:
        registry = Registry(kind)
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():  # registration order
            label = _plugin_label(self.pm, impl.plugin)
            try:
                answer = impl.function()
            except Exception as exc:
                reraise_if_debug()
                raise PluginError(str(wrapped(f"{label}: {hook_name}()", exc))) from exc
            if not answer:
                continue
            if not isinstance(answer, dict):
                raise PluginError(f"{label}: {hook_name}() must return a dict, got {type(answer).__name__}")
            for name, component in answer.items():
                registry.add(name, component, label)
        return registry

    def __getitem__(self, kind: str) -> Registry:
        return self.registries[kind]

    def describe(self) -> str:
        """What `python -m minirl plugins` prints: every plugin, then every component by kind
        (a kind nothing registered, such as config_sections without a plugin's own section, is
        left out rather than printed as an empty heading)."""
        lines = ["plugins:"]
        lines += [f"  {name}" for name, _ in self.pm.list_name_plugin()]
        for kind, registry in self.registries.items():
            if not registry.items:
                continue
            lines.append(f"{kind}:")
            for name in sorted(registry.items):
                lines.append(f"  {name:32s} {registry.providers[name]}")
        return "\n".join(lines)


def _advantage_result(result: Any, args: tuple, kwargs: dict) -> str:
    """What is wrong with an estimator's answer ("" if nothing): (advantages_BT, returns_BT)."""
    inputs = args[0] if args else kwargs.get("inputs")
    shape = tuple(inputs.mask_BT.shape)
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        return f"must return (advantages_BT, returns_BT), two tensors; got {type(result).__name__}"
    got = [tuple(t.shape) for t in result]
    return "" if all(g == shape for g in got) else f"returned shapes {got[0]} and {got[1]}, expected [B, T] = {shape}"


RESULT_CHECKS = {"advantage_estimators": _advantage_result}


def guarded(component: Any, what: str, check_result=None) -> Any:
    """A third-party component whose exceptions name it (a UserError gets its name as prefix).

    Classes and other non-callables are returned unchanged; attributes such as `needs_logits`
    are copied onto the wrapper. MINIRL_DEBUG=1 lets the original exception through.
    """
    if isinstance(component, type) or not callable(component):
        return component

    @functools.wraps(component)
    def call(*args, **kwargs):
        try:
            result = component(*args, **kwargs)
        except UserError as exc:
            raise PluginError(f"{what}: {exc}") from exc
        except Exception as exc:
            reraise_if_debug()
            raise PluginError(str(wrapped(what, exc))) from exc
        problem = check_result(result, args, kwargs) if check_result else ""
        if problem:
            raise PluginError(f"{what} {problem}; fix the plugin")
        return result

    return call
