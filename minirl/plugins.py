"""The plugin manager and the component registries it builds.

Plugins come from three places, in this order: the built-ins in ``minirl_plugins``, installed
distributions that declare the entry-point group ``minirl``, and modules named in the config
(``[plugins] modules = [...]``). Built-ins register exactly as a third-party plugin would.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable

import pluggy

from minirl import hookspecs
from minirl.errors import UserError

BUILTIN_MODULES = (
    "minirl_plugins.advantage",
    "minirl_plugins.kl",
    "minirl_plugins.policy_loss",
    "minirl_plugins.rewards",
    "minirl_plugins.hf_rollout",
    "minirl_plugins.native",
    "minirl_plugins.loggers",
    "minirl_plugins.optim",
    "minirl_plugins.checkpointing",
    "minirl_plugins.ulysses",
    "minirl_plugins.fsdp2",
)

ENTRY_POINT_GROUP = "minirl"

REGISTRIES = {
    "advantage_estimators": "minirl_advantage_estimators",
    "kl_estimators": "minirl_kl_estimators",
    "policy_losses": "minirl_policy_losses",
    "reward_functions": "minirl_reward_functions",
    "rollout_engines": "minirl_rollout_engines",
    "loggers": "minirl_loggers",
    "config_sections": "minirl_config_sections",
}

# The config key that selects from each registry, for error messages.
SELECTED_BY = {
    "advantage_estimators": "algorithm.adv_estimator",
    "kl_estimators": "actor.kl_loss_type / algorithm.kl_penalty",
    "policy_losses": "actor.policy_loss",
    "reward_functions": "the data_source column of the data",
    "rollout_engines": "rollout.name",
    "loggers": "trainer.logger",
    "config_sections": "a [section] of the config file",
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
        self.items[name] = component
        self.providers[name] = provider

    def get(self, name: str) -> Any:
        if name not in self.items:
            hint = difflib.get_close_matches(name, list(self.items), n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise PluginError(
                f"{SELECTED_BY[self.kind]} = {name!r}: no such {self.kind[:-1].replace('_', ' ')}"
                f"{did_you_mean} Registered: {', '.join(sorted(self.items)) or '(none)'}"
            )
        return self.items[name]

    def __contains__(self, name: str) -> bool:
        return name in self.items


def _plugin_label(pm: pluggy.PluginManager, plugin: object) -> str:
    name = pm.get_name(plugin) or repr(plugin)
    return f"plugin {name!r}"


class PluginManager:
    """Loads the plugins and builds every registry from their answers."""

    def __init__(self, modules: Iterable[str] = (), *, entry_points: bool = True):
        self.pm = pluggy.PluginManager("minirl")
        self.pm.add_hookspecs(hookspecs)
        for name in BUILTIN_MODULES:
            self._register_module(name, "built-in")
        if entry_points:
            self._load_entry_points()
        for name in modules:
            self._register_module(name, "config [plugins] modules")
        self.pm.check_pending()
        self.hook = self.pm.hook
        self.registries = {kind: self._collect(kind, hook) for kind, hook in REGISTRIES.items()}

    def _register_module(self, name: str, source: str) -> None:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(f"cannot import plugin module {name!r} ({source}): {exc}") from exc
        if self.pm.is_registered(module):
            return
        self.pm.register(module, name=name)

    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must name itself
                raise PluginError(
                    f"entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}) failed to load: {exc}"
                ) from exc
            if not self.pm.is_registered(plugin):
                self.pm.register(plugin, name=f"{ep.value}")

    def _collect(self, kind: str, hook_name: str) -> Registry:
        registry = Registry(kind)
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():  # registration order
            answer = impl.function()
            if not answer:
                continue
            label = _plugin_label(self.pm, impl.plugin)
            if not isinstance(answer, dict):
                raise PluginError(f"{label}: {hook_name}() must return a dict, got {type(answer).__name__}")
            for name, component in answer.items():
                registry.add(name, component, label)
        return registry

    def __getitem__(self, kind: str) -> Registry:
        return self.registries[kind]

    def plugin_names(self) -> list[str]:
        return [name for name, _ in self.pm.list_name_plugin()]

    def describe(self) -> str:
        """What `python -m minirl plugins` prints: every plugin, then every component by kind."""
        lines = ["plugins:"]
        lines += [f"  {name}" for name in self.plugin_names()]
        for kind, registry in self.registries.items():
            lines.append(f"{kind}:")
            for name in sorted(registry.items):
                lines.append(f"  {name:32s} {registry.providers[name]}")
        return "\n".join(lines)
