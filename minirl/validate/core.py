"""One pass over the resolved config before any model loads or worker starts.

`validate(cfg, pm)` collects every invalid value from the rule modules beside this one (RULES,
then the files) and raises one ConfigError with a line per problem: the key, its value, where
the value came from (file, profile, command line or default), the rule it breaks and the fix.
The keys that did not load at all (unknown, of the wrong type: cfg.load_errors) come first in
the same error.
"""

from __future__ import annotations

from minirl.config.load import Config, ConfigError, error_lines
from minirl.validate import layout, options
from minirl.validate.critic import critic_problems
from minirl.validate.files import file_problems
from minirl.validate.lora import lora_problems
from minirl.validate.problem import Problem
from minirl.validate.values import value_problems

# in this order: a key reports the first rule it breaks, so a value's own range comes before the
# rules that join it with others
RULES = (
    value_problems,
    critic_problems,
    layout.batch_problems,
    layout.token_budget_problems,
    layout.launcher_problems,
    layout.device_problems,
    layout.layout_problems,
    options.steps_problems,
    options.resume_problems,
    options.reward_problems,
    options.policy_loss_problems,
    options.filter_groups_problems,
    options.kv_cache_problems,
    options.multi_turn_problems,
    options.async_problems,
    lora_problems,
)


def validate(cfg: Config, pm, files: bool = True) -> None:
    """Raise one ConfigError that lists every problem, or return quietly. files=False skips the
    checks of data, model and output paths (--print-config: a config may be printed on a machine
    that does not hold the job's files)."""
    _raise(find_problems(cfg, pm, files), cfg)


def check_world(cfg: Config, pm, world: int) -> None:
    """The layout rules again, for a launcher that learns the number of workers only when it
    starts (ray with trainer.device = 'auto' takes the GPUs of the cluster, not of this machine)."""
    _raise(layout.layout_problems(cfg, pm, world - cfg.rollout_world), cfg)  # the ranks that train


def find_problems(cfg: Config, pm, files: bool = True) -> list[Problem]:
    """Every problem, at most one per key (the first rule a key breaks)."""
    found: dict[str, Problem] = {}
    for rule in RULES:
        for p in rule(cfg, pm):
            found.setdefault(p.key, p)
    if files and not any(k.startswith(("data.", "trainer.total")) for k in found):  # need sane sizes
        for p in file_problems(cfg, pm):
            found.setdefault(f"{p.key}:{p.value}", p)
    return list(found.values())


def _raise(problems: list[Problem], cfg: Config) -> None:
    if problems or cfg.load_errors:
        raise ConfigError(report(problems, cfg))


def report(problems: list[Problem], cfg: Config) -> str:
    """A line per key that did not load, then per invalid value (a key that did not load stands
    at its default, so a rule about that default would only repeat the first line)."""
    unloaded = {e.key for e in cfg.load_errors}
    lines = [e.line for e in cfg.load_errors] + [
        f"{p.key} = {p.value!r} ({_origin(cfg, p.key)}): {p.rule}" + (f"; {p.fix}" if p.fix else "")
        for p in problems
        if p.key.split("[")[0] not in unloaded
    ]
    return error_lines(lines, "invalid config values")


def _origin(cfg: Config, key: str) -> str:
    return cfg.origin(key.split("[")[0])  # trainer.logger[0] was set as trainer.logger
