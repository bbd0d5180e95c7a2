"""What identifies a data file for a resume: its path, size, modification time and the CRC-32C
of the raw bytes of its first and last row groups (read from the byte ranges the parquet footer
gives, so a large file costs two row groups' reads, not a full scan). A checkpoint records the
training files' identities; a resume compares them (minirl.checkpoint.training)."""

from __future__ import annotations

import os

import crc32c


def file_identity(path: str) -> dict:
    import pyarrow.parquet as pq  # deferred: only data loading needs pyarrow

    meta = pq.ParquetFile(path).metadata
    groups = sorted({0, meta.num_row_groups - 1}) if meta.num_row_groups else []
    st = os.stat(path)
    with open(path, "rb") as f:
        hashes = [_row_group_crc(f, meta.row_group(i)) for i in groups]
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime": st.st_mtime, "row_groups": hashes}


def _row_group_crc(f, group) -> str:
    start = min(_chunk_start(group.column(c)) for c in range(group.num_columns))
    end = max(_chunk_start(col) + col.total_compressed_size for col in map(group.column, range(group.num_columns)))
    f.seek(start)
    return f"{crc32c.crc32c(f.read(end - start)):08x}"


def _chunk_start(col) -> int:
    starts = [col.data_page_offset, col.dictionary_page_offset]
    return min(s for s in starts if s is not None and s > 0)


def changed_files(saved: list[dict], now: list[dict]) -> tuple[list[str], list[str]]:
    """(changed, touched): 'FILE: what differs' for files whose size or row-group bytes differ
    (or which were added or removed), and the files only their modification time changed."""
    changed, touched = [], []
    for i in range(max(len(saved), len(now))):
        if i >= len(saved) or i >= len(now):
            which = now[i] if i < len(now) else saved[i]
            changed.append(f"{which['path']}: {'added' if i < len(now) else 'removed'}")
            continue
        a, b = saved[i], now[i]
        if a["size"] != b["size"]:
            changed.append(f"{b['path']}: {a['size']} bytes at the checkpoint, {b['size']} now")
        elif a["row_groups"] != b["row_groups"]:
            changed.append(f"{b['path']}: same size, other bytes in its first or last row group")
        elif a["mtime"] != b["mtime"]:
            touched.append(b["path"])
    return changed, touched
