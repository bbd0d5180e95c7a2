"""The checkpoints of a run directory on disk: which are complete, atomic writes, retention.

A checkpoint `ckpt_<step>/` is complete when it has its manifest.json (written last, listing every
file with its size and its CRC-32C, computed as the bytes were written: minirl.checkpoint.checksum).
It only ever appears through the rename of a fully written and fsynced
`.tmp_ckpt_<step>/`, so a process killed anywhere leaves the previous one complete. `latest` names
the newest (informational: the scan decides). The run directory must be one filesystem that
every rank sees (a shared one across nodes).
"""

from __future__ import annotations

import json
import os
import re
import shutil

from minirl.checkpoint import checksum
from minirl.errors import UserError

MANIFEST = "manifest.json"
LATEST = "latest"
_CKPT_RE = re.compile(r"^ckpt_(\d+)$")
TMP_PREFIX = ".tmp_ckpt_"
DAMAGED_SUFFIX = ".damaged"  # a checkpoint whose checksums failed, moved aside at resume


def ckpt_name(step: int) -> str:
    return f"ckpt_{step}"


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in run_dir, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        match = _CKPT_RE.match(name)
        path = os.path.join(run_dir, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def stale_temporaries(run_dir: str) -> list[str]:
    if not os.path.isdir(run_dir):
        return []
    return sorted(os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.startswith(TMP_PREFIX))


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, data: bytes) -> tuple[int, str]:
    """Write, flush and fsync; returns (size, CRC-32C) of what was written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), checksum.of_bytes(data)


def write_manifest(tmp_dir: str, step: int, sums: dict[str, tuple[int, str]]) -> None:
    """List every file under tmp_dir with its size and checksum (`sums`: relative path -> (size,
    crc) as written); written after all of them are synced. A file written without passing
    through minirl.checkpoint.checksum (a plugin's extra file) is read back for its checksum."""
    files = {}
    for root, _, names in os.walk(tmp_dir):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, tmp_dir)
            size, crc = sums[rel] if rel in sums else (os.path.getsize(full), checksum.of_file(full))
            files[rel] = {"size": size, checksum.ALGORITHM: crc}
    manifest = {"format": 2, "step": step, "files": dict(sorted(files.items()))}
    write_file_durably(os.path.join(tmp_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
    for root, dirs, _ in os.walk(tmp_dir):
        for d in dirs:
            fsync_path(os.path.join(root, d))
    fsync_path(tmp_dir)


def publish(tmp_dir: str, run_dir: str, step: int, keep: int) -> str:
    """Rename a fully written temporary directory into place, then update `latest`, then prune."""
    final = os.path.join(run_dir, ckpt_name(step))
    if os.path.exists(final):  # the same step saved again (a resumed run's first save): replace it
        shutil.rmtree(final)
    os.rename(tmp_dir, final)
    fsync_path(run_dir)
    latest_tmp = os.path.join(run_dir, LATEST + ".tmp")
    write_file_durably(latest_tmp, (ckpt_name(step) + "\n").encode())
    os.replace(latest_tmp, os.path.join(run_dir, LATEST))
    fsync_path(run_dir)
    prune(run_dir, keep)
    return final


def prune(run_dir: str, keep: int) -> None:
    """Delete the oldest complete checkpoints so that `keep` remain (keep = 0: delete none)."""
    if keep <= 0:
        return
    for _, path in complete_checkpoints(run_dir)[:-keep]:
        # the manifest goes first: a deletion cut short leaves an incomplete directory, never a
        # checkpoint that looks complete but is missing files
        os.remove(os.path.join(path, MANIFEST))
        shutil.rmtree(path)


def read_json(file: str, tables: tuple[str, ...] = ()) -> dict:
    """A checkpoint's JSON file: its integer "step" and `tables` (objects) are there, else a
    UserError names the file."""
    try:
        with open(file) as f:
            data = json.load(f)
        int(data["step"])
        for key in tables:
            dict(data[key])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"checkpoint file {file} is unreadable ({exc}); resume from an older checkpoint") from None
    return data


def verify(path: str) -> dict:
    """The manifest of a complete checkpoint, after checking that every file is there in full."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise UserError(
            f"{path} is not a complete checkpoint (no {MANIFEST}: it was never finished or was "
            "copied partially); pick another ckpt_<step> directory for trainer.resume_from_path"
        )
    manifest = read_json(manifest_path, tables=("files",))
    for rel, entry in dict(manifest["files"]).items():
        size = entry["size"] if isinstance(entry, dict) else entry  # format 1: the size alone
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise UserError(f"checkpoint file {full} is missing; resume from an older checkpoint or restore the file")
        actual = os.path.getsize(full)
        if actual != size:
            raise UserError(
                f"checkpoint file {full} has {actual} bytes, but {size} were written (truncated or "
                "damaged); resume from an older checkpoint (trainer.resume_mode = 'resume_path')"
            )
    return manifest


def damaged_files(path: str) -> list[str]:
    """Every file of complete checkpoint `path` whose bytes differ from what was written (its
    CRC-32C), each as 'FILE: why'; [] when all match. A checkpoint written before checksums
    (manifest format 1) is checked for sizes only. Missing or truncated files raise (verify)."""
    manifest = verify(path)
    recorded = {rel: e.get(checksum.ALGORITHM) for rel, e in manifest["files"].items() if isinstance(e, dict)}
    rels = [rel for rel, crc in sorted(recorded.items()) if crc]
    found = checksum.of_files([os.path.join(path, rel) for rel in rels])
    return [
        f"{os.path.join(path, rel)}: CRC-32C {crc} on disk, {recorded[rel]} when written"
        for rel, crc in zip(rels, found)
        if crc != recorded[rel]
    ]


def total_size(path: str) -> int:
    """Bytes of a complete checkpoint, from its manifest (0 when unreadable)."""
    try:
        files = read_json(os.path.join(path, MANIFEST), tables=("files",))["files"]
    except UserError:
        return 0
    return sum(e["size"] if isinstance(e, dict) else int(e) for e in files.values())
