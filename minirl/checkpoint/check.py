"""`python -m minirl check-checkpoint DIR`: verify a checkpoint (or every checkpoint of a run
directory) against the sizes and CRC-32C checksums recorded when it was written. Prints one
line per checkpoint; exits 0 when all are intact, 2 when any is damaged or incomplete."""

from __future__ import annotations

import argparse
import os

from minirl.checkpoint import store
from minirl.errors import UserError

HELP = "verify a checkpoint (ckpt_<step>) or every checkpoint of a run directory against its checksums"


def check_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minirl check-checkpoint", description=HELP)
    p.add_argument("dir", metavar="DIR", help="a ckpt_<step> directory, or a run directory holding them")
    args = p.parse_args(argv)
    paths = _checkpoints(args.dir)
    bad = 0
    for path in paths:
        line = check_one(path)
        bad += not line.startswith("ok")
        print(line)
    return 2 if bad else 0


def _checkpoints(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise UserError(f"{path} is not a directory; give a ckpt_<step> directory or a run directory")
    if os.path.isfile(os.path.join(path, store.MANIFEST)):
        return [path]
    found = [p for _, p in store.complete_checkpoints(path)]
    if not found:
        raise UserError(f"{path} holds no complete checkpoint (no ckpt_<step>/{store.MANIFEST})")
    return found


def check_one(path: str) -> str:
    """'ok PATH: ...' or 'DAMAGED PATH: FILE: why'."""
    try:
        damaged = store.damaged_files(path)
    except UserError as exc:
        return f"DAMAGED {path}: {exc}"
    if damaged:
        more = f" (and {len(damaged) - 1} more file(s))" if len(damaged) > 1 else ""
        return f"DAMAGED {path}: {damaged[0]}{more}"
    manifest = store.verify(path)
    files = manifest["files"]
    checked = sum(isinstance(e, dict) for e in files.values())
    how = "sizes and CRC-32C" if checked == len(files) else "sizes only (written before checksums)"
    return f"ok {path}: {len(files)} files, {store.total_size(path) / 1e9:.3f} GB, {how} match"
