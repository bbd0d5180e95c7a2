"""The command line: ``python -m minirl --config FILE [--profile P] [section.key=value ...]``.

``python -m minirl plugins`` prints every plugin and every registered component by kind.
User mistakes (config, data, plugins) print one clear error line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from minirl.config import ConfigError, load_config, parse_overrides, profiles_in, to_toml
from minirl.plugins import PluginError, PluginManager


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minirl", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a TOML config file (see bench.toml)")
    p.add_argument("--profile", help="a [profiles.NAME] table of the config; default: cpu without CUDA, else h200")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("overrides", nargs="*", help="section.key=value (value parsed as TOML)")
    return p


def plugin_modules(path: str | None, overrides: list[str]) -> list[str]:
    """[plugins] modules, read before the full config because plugins may add sections."""
    modules = load_config(path, []).plugins.modules if path else []
    from_cli = parse_overrides(overrides).get("plugins", {}).get("modules")
    return list(from_cli) if from_cli is not None else modules


def default_profile(path: str | None) -> str | None:
    if path is None:
        return None
    available = profiles_in(path)
    if not available:
        return None
    import torch

    wanted = "h200" if torch.cuda.is_available() else "cpu"
    if wanted in available:
        print(
            f"minirl: no --profile given; CUDA {'found' if wanted == 'h200' else 'not found'}, using profile {wanted!r}"
        )
        return wanted
    return None


def resolve(args: argparse.Namespace):
    """Plugins first (they may add config sections), then the config."""
    pm = PluginManager(plugin_modules(args.config, args.overrides))
    profile = args.profile or default_profile(args.config)
    sections = dict(pm["config_sections"].items)
    cfg = load_config(args.config, args.overrides, profile, extra_sections=sections)
    return pm, cfg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["plugins"]:
            print(PluginManager().describe())
            return 0
        args = build_parser().parse_args(argv)
        pm, cfg = resolve(args)
        if args.print_config:
            print(to_toml(cfg), end="")
            return 0
        if args.config is None:
            build_parser().error("--config is required to run a job")
        from minirl.launch import launch

        return launch(cfg, pm)
    except (ConfigError, PluginError) as exc:
        print(f"minirl: error: {exc}", file=sys.stderr)
        return 2
