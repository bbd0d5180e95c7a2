"""Looking at finished (or running) runs: `python -m minirl compare` and `python -m minirl report`.

read.py reads a run directory (metrics.jsonl, config.toml); compare.py builds the seed's
side-by-side table of several runs; report.py draws their curves (matplotlib, the `plot` extra);
commands.py parses the two subcommands' arguments.
"""
