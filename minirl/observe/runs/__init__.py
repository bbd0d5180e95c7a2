"""Looking at finished (or running) runs: `python -m minirl compare` and `python -m minirl report`.

read.py reads a run directory (metrics.jsonl, config.toml); compare.py puts the end-of-run table
of several runs side by side; report.py draws their curves (matplotlib, the `plot` extra);
commands.py parses the two subcommands' arguments.
"""
