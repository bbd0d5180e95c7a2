"""The command line (USAGE below): run a job, or print its resolved config as TOML; `plugins`
lists every plugin and registered component by kind, the config's own plugin modules included;
`compare` and `report` read run directories (minirl.observe.runs); `check-checkpoint` verifies
checkpoints against their checksums (minirl.checkpoint.check). The config is validated as a
whole before any model loads (minirl.validate.core). A user mistake prints one error line per
mistake on stderr and exits with status 2; Ctrl-C during start-up exits with 130. Notices go to
stderr, so `--print-config > job.toml` writes valid TOML.
"""

from __future__ import annotations

import argparse
import sys

from minirl.checkpoint.check import HELP as CHECK_HELP
from minirl.checkpoint.check import check_command
from minirl.checkpoint.export import HELP as EXPORT_HELP
from minirl.checkpoint.export import export_command
from minirl.config.load import load_config, plugin_modules, profiles_in, to_toml
from minirl.errors import UserError
from minirl.observe.runs.commands import COMMANDS
from minirl.plugins import PluginManager

USAGE = """python -m minirl --config FILE [--profile P] [--print-config] [section.key=value ...]
       python -m minirl plugins [--config FILE] [section.key=value ...]
       python -m minirl compare RUN_A RUN_B [...] [--names a,b] [--steps 2:] [--format text|markdown|csv]
       python -m minirl report RUN [RUN ...] [--out DIR]
       python -m minirl check-checkpoint DIR
       python -m minirl export --checkpoint RUN/ckpt_N --out DIR [--keep-adapter]
       python -m minirl eval --model CKPT_OR_HF_DIR --data FILE.parquet --out results.jsonl [--n K] [--greedy]"""

EVAL_HELP = "generate on a parquet file with a checkpoint or HF directory: score per data_source, pass@k"
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minirl",
        usage=USAGE,
        description="Reinforcement-learning post-training of LLMs (GRPO, RLOO, REINFORCE++, PPO).",
        epilog="commands (python -m minirl COMMAND --help for each):\n"
        "  (none)     run a job: --config FILE [--profile P] [section.key=value ...]\n"
        "  plugins    list every plugin and registered component (with --config: its [plugins] modules too)\n"
        + "".join(f"  {name:10s} {help_line}\n" for name, (_, help_line) in COMMANDS.items())
        + f"  check-checkpoint DIR\n             {CHECK_HELP}\n"
        + f"  export     {EXPORT_HELP}\n"
        + f"  eval       {EVAL_HELP}\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="a TOML config file (see bench.toml)")
    p.add_argument("--profile", help="a [profiles.NAME] table of the config; default: cpu without CUDA, else h200")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="validate the values (not the files), print the resolved config as TOML, exit",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value (value parsed as TOML)")
    return p


def plugin_manager(path: str | None, overrides: list[str], profile: str | None) -> PluginManager:
    """The plugins of [plugins] modules, loaded before the full config because they may add
    sections to it; an import error names the layer that listed the module."""
    modules, source = plugin_modules(path, overrides, profile)
    where = "plugins.modules on the command line" if source == "command line" else f"plugins.modules in {source}"
    return PluginManager(modules, source=where)


def notice(text: str) -> None:
    """Messages for the user that are not the command's output: stderr."""
    print(f"minirl: {text}", file=sys.stderr, flush=True)


def default_profile(path: str | None) -> str | None:
    if path is None:
        return None
    available = profiles_in(path)
    if not available:
        return None
    import torch

    wanted = "h200" if torch.cuda.is_available() else "cpu"
    if wanted in available:
        notice(f"no --profile given; CUDA {'found' if wanted == 'h200' else 'not found'}, using profile {wanted!r}")
        return wanted
    return None


def resolve(args: argparse.Namespace):
    """Plugins first (they may add config sections), then the config."""
    profile = args.profile or default_profile(args.config)
    pm = plugin_manager(args.config, args.overrides, profile)
    sections = dict(pm["config_sections"].items)
    cfg = load_config(args.config, args.overrides, profile, extra_sections=sections, strict=False)
    return pm, cfg


def list_plugins(argv: list[str]) -> int:
    """`python -m minirl plugins [--config X] [overrides]`: the config's plugin modules included."""
    args = build_parser().parse_intermixed_args(argv)
    print(plugin_manager(args.config, args.overrides, args.profile).describe())
    return 0


def run(argv: list[str]) -> int:
    if argv[:1] == ["plugins"]:
        return list_plugins(argv[1:])
    if argv[:1] == ["check-checkpoint"]:
        return check_command(argv[1:])
    if argv[:1] == ["export"]:
        return export_command(argv[1:])
    if argv[:1] == ["eval"]:
        from minirl.evaluation.command import eval_command

        return eval_command(argv[1:])
    if argv[:1] and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:])
    args = build_parser().parse_intermixed_args(argv)
    if args.config is None and not args.print_config:
        build_parser().error("--config is required to run a job")
    pm, cfg = resolve(args)
    from minirl.validate.core import validate
    from minirl.validate.critic import unused_keys

    validate(cfg, pm, files=not args.print_config)
    if args.print_config:
        print(to_toml(cfg, unused_keys(cfg, pm)), end="")
        return 0
    from minirl.launch import launch

    return launch(cfg, pm)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(argv)
    except UserError as exc:
        print(f"minirl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        notice("interrupted (Ctrl-C); stopped")
        return EXIT_INTERRUPTED
