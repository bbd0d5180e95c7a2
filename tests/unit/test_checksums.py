"""The checksums behind checkpoint verification and data identity: the streaming CRC-32C equals a
bitwise reference over any split of the bytes, the hashing filesystem records what reaches the
disk (through renames), and a data file's identity changes with its rows, not with a touch."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.checkpoint import checksum, store
from minirl.data.identity import changed_files, file_identity


def crc32c_reference(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_check_value():
    """The catalogue's check value of CRC-32C: "123456789" -> e3069283."""
    assert checksum.of_bytes(b"123456789") == "e3069283"


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=4))
def test_streaming_crc_equals_the_reference_over_any_split(data, cuts):
    """Writes arrive in pieces of any size (DCP, torch.save): the running CRC must not care."""
    crc = checksum.Crc()
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    for a, b in zip(bounds, bounds[1:]):
        crc.update(data[a:b])
    assert crc.value == crc32c_reference(data) and crc.size == len(data)


def test_typed_buffers_are_hashed_as_their_bytes():
    """A tensor's buffer (typed, not bytes) gives the CRC of its raw bytes."""
    t = torch.arange(7, dtype=torch.float32)
    crc = checksum.Crc()
    crc.update(t.numpy())
    assert crc.value == crc32c_reference(t.numpy().tobytes()) and crc.size == 28


@pytest.mark.parametrize("hash_threads", [0, 2])
def test_hashing_filesystem_records_what_reaches_the_disk(tmp_path, hash_threads):
    """Files written through create_stream (in pieces, small and large, a rename after) are
    recorded under their final name with the size and CRC that reading them back gives, whether
    large writes are hashed inline or on a thread while they are written."""
    fs = checksum.HashingFileSystem(str(tmp_path), hash_threads=hash_threads)
    big = np.random.default_rng(0).integers(0, 2**62, size=(3 << 20) // 8, dtype=np.int64)  # 3 MiB
    with fs.create_stream(tmp_path / "a.tmp", "wb") as stream:
        stream.write(b"hello ")
        stream.write(memoryview(big))
        stream.write(memoryview(np.arange(5, dtype=np.int64)))
        stream.close()  # DCP closes inside the block; the context exit must not record twice
    fs.rename(tmp_path / "a.tmp", tmp_path / "a")
    fs.close()
    assert fs.sums == {"a": (os.path.getsize(tmp_path / "a"), checksum.of_file(str(tmp_path / "a")))}
    assert fs.errors == []


def test_write_behind_keeps_every_byte(tmp_path, monkeypatch):
    """Every WRITE_BEHIND_BYTES the stream asks the kernel to write out what it has and drop
    what is written (posix_fadvise): the file and its recorded CRC are still exactly the bytes
    written, and each advice covers what was written since the one before (to write out) and
    what the one before wrote out (to drop)."""
    monkeypatch.setattr(checksum, "WRITE_BEHIND_BYTES", 1 << 20)
    advised, advise = [], os.posix_fadvise

    def record(fd, offset, length, advice):
        advised.append((offset, offset + length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    data = np.random.default_rng(1).integers(0, 256, size=5 << 20, dtype=np.uint8).tobytes()
    fs = checksum.HashingFileSystem(str(tmp_path), hash_threads=1)
    with fs.create_stream(tmp_path / "f", "wb") as stream:
        for start in range(0, len(data), 700_000):
            stream.write(data[start : start + 700_000])
    fs.close()
    assert (tmp_path / "f").read_bytes() == data
    assert fs.sums == {"f": (len(data), checksum.of_bytes(data))}
    starts, ends = [a for a, _ in advised], [b for _, b in advised]
    assert len(advised) >= 3 and all(b - a >= 1 << 20 for a, b in zip([0, *ends], ends))  # one per MiB written
    assert starts == [0, *[0, *ends][:-2]]  # each drops what the one before it wrote out


def test_manifest_lists_every_file_and_damage_is_found(tmp_path):
    """write_manifest takes the checksums made while writing (reads back only a file written
    around them); damaged_files re-reads and names the file whose bytes changed (same size),
    and only that one."""
    sums = {}
    for name, data in (("x.bin", b"x" * 1000), ("y.bin", b"y" * 10)):
        sums[name] = store.write_file_durably(str(tmp_path / name), data)
    (tmp_path / "extra.bin").write_bytes(b"written by a plugin, not through the checksums")
    store.write_manifest(str(tmp_path), 3, sums)
    manifest = store.verify(str(tmp_path))
    assert set(manifest["files"]) == {"x.bin", "y.bin", "extra.bin"}  # the stray file read back
    assert all(len(entry["crc32c"]) == 8 for entry in manifest["files"].values())
    assert store.damaged_files(str(tmp_path)) == []
    raw = bytearray((tmp_path / "x.bin").read_bytes())
    raw[500] ^= 4
    (tmp_path / "x.bin").write_bytes(bytes(raw))
    (damaged,) = store.damaged_files(str(tmp_path))
    assert damaged.startswith(f"{tmp_path / 'x.bin'}: CRC-32C ")


def _write(path, values, row_group_size=4):
    pq.write_table(pa.table({"v": values}), path, row_group_size=row_group_size)


def test_data_identity_follows_the_rows_not_the_modification_time(tmp_path):
    """Same rows written again with a new mtime: only 'touched'. A row changed in the first or
    last row group (same size): changed. A middle row group is not read (two reads, not a scan)."""
    path = str(tmp_path / "d.parquet")
    _write(path, list(range(12)))
    before = [file_identity(path)]
    os.utime(path, (time.time() + 10, time.time() + 10))
    assert changed_files(before, [file_identity(path)]) == ([], [path])
    _write(path, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99])
    changed, _ = changed_files(before, [file_identity(path)])
    assert len(changed) == 1 and changed[0].startswith(path)
    _write(path, [0, 1, 2, 3, 4, 77, 6, 7, 8, 9, 10, 11])  # the middle group: not part of the identity
    assert changed_files(before, [file_identity(path)])[0] == []
    assert changed_files(before, []) == ([f"{path}: removed"], [])
