"""CRC-32C checksums of a checkpoint's files, computed from the bytes as they are written.

Every byte a checkpoint writes passes through `Crc.update` on its way to the file: the DCP
shards through `HashingFileSystem` (the storage layer DCP's FileSystemWriter writes through), the
small files (RNG, trainer state, config) through `minirl.checkpoint.store.write_file_durably`.
Nothing is read back to checksum it. The crc32c package uses the CPU's CRC32 instruction (about
15 GB/s a core) and releases the GIL, and a large write is hashed on a helper thread while the
write system call runs, so the hashing overlaps the I/O instead of adding to it
(scripts/bench_checkpoint.py measures the cost against the write time).

Why CRC-32C: it detects every burst error up to 32 bits and every odd number of flipped bits,
which covers what a disk or a copy does to a file; it is not a cryptographic hash (a checkpoint
is not defended against someone who forges one).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
from torch.distributed.checkpoint.filesystem import FileSystem

from minirl.dist import fault

ALGORITHM = "crc32c"
_READ_CHUNK = 16 << 20  # bytes per read when a file is verified


class Crc:
    """A running CRC-32C and byte count."""

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")  # a tensor's buffer arrives typed
        self.value = crc32c.crc32c(view, self.value)
        self.size += view.nbytes

    @property
    def hex(self) -> str:
        return f"{self.value:08x}"


def of_bytes(data: bytes) -> str:
    crc = Crc()
    crc.update(data)
    return crc.hex


def of_file(path: str) -> str:
    """The CRC-32C of a file on disk (what `check` compares with the one recorded at write time)."""
    crc = Crc()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK)
        while n := f.readinto(buf):
            crc.update(memoryview(buf)[:n])
    return crc.hex


def of_files(paths: list[str], threads: int = 4) -> list[str]:
    """Checksums of many files, read in parallel (the CRC releases the GIL)."""
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        return list(pool.map(of_file, paths))


_OVERLAP_BYTES = 1 << 20  # a write at least this large is hashed while the write runs
WRITE_BEHIND_BYTES = 64 << 20  # every this many bytes, the kernel starts writing them to the disk


class _HashingStream:
    """A binary file that checksums what is written to it; DCP calls write, tell, flush,
    fileno (for fsync) and close. A large write (a tensor's bytes) is hashed on `pool` while
    the write system call copies the same buffer: both release the GIL, so the CRC costs about
    nothing beyond the write instead of adding to it.

    Write-behind: every WRITE_BEHIND_BYTES the kernel is told to start writing what is in the
    page cache to the disk and to drop what it has written (posix_fadvise DONTNEED, on Linux).
    Without it, the bytes of a checkpoint smaller than a tenth of the RAM wait in the cache until
    the fsync at the end, so the disk idles while they are copied and the write takes copy time
    plus disk time; with it the two overlap, and the cache does not fill with a checkpoint that
    nobody reads back."""

    def __init__(self, raw, on_close, pool: ThreadPoolExecutor | None = None) -> None:
        self.raw, self.crc, self._on_close, self._closed = raw, Crc(), on_close, False
        self.pool = pool
        self._started = self._dropped = 0  # file offsets: writing started below, pages dropped below

    def write(self, data) -> int:
        if self.pool is None or memoryview(data).nbytes < _OVERLAP_BYTES:
            n = self.raw.write(data)
            self.crc.update(data)
        else:
            hashed = self.pool.submit(self.crc.update, data)  # the CRC is sequential per file: one at a time
            try:
                n = self.raw.write(data)
            finally:
                hashed.result()
        if self.crc.size - self._started >= WRITE_BEHIND_BYTES:
            self._write_behind()
        return n

    def _write_behind(self) -> None:
        """Start writing [started, now) to the disk; drop [dropped, started), written by now."""
        end = self.crc.size  # DCP appends: the bytes hashed are the file's length
        with contextlib.suppress(AttributeError, OSError):  # no posix_fadvise (macOS), or a pipe
            os.posix_fadvise(self.raw.fileno(), self._dropped, end - self._dropped, os.POSIX_FADV_DONTNEED)
        self._dropped, self._started = self._started, end

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self._closed:
            self.raw.close()
            self._closed = True
            self._on_close(self.crc)


class HashingFileSystem(FileSystem):
    """DCP's local filesystem with every written file's size and CRC-32C recorded in `sums`
    (file name relative to `root` -> (size, crc hex)); renames (DCP writes .metadata.tmp, then
    renames it) carry the entry along. `errors`: what any writer thread raised."""

    def __init__(self, root: str, step: int | None = None, hash_threads: int = 0) -> None:
        super().__init__()
        self.root, self.step = os.path.abspath(root), step
        # hash_threads > 0: large writes are hashed on these while they are written (close() ends them)
        self.pool = ThreadPoolExecutor(hash_threads, thread_name_prefix="minirl-crc") if hash_threads else None
        self.sums: dict[str, tuple[int, str]] = {}
        self.errors: list[BaseException] = []  # raised in any writer thread (DCP may drop a helper's)
        self._lock = threading.Lock()

    def _rel(self, path) -> str:
        return os.path.relpath(os.path.abspath(os.fspath(path)), self.root)

    def _record(self, path, crc: Crc) -> None:
        with self._lock:
            self.sums[self._rel(path)] = (crc.size, crc.hex)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            fault.point("checkpoint_write", self.step)  # in DCP's writer threads
            with Path(path).open(mode) as raw:
                stream = _HashingStream(raw, lambda crc: self._record(path, crc), self.pool)
                try:
                    yield stream
                finally:
                    stream.close()
        except BaseException as exc:
            # DCP's helper threads die with their exception and their files' results go missing:
            # keep it, so that the save is known to have failed
            with self._lock:
                self.errors.append(exc)
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.sums.pop(self._rel(path), None)
            if entry is not None:
                self.sums[self._rel(new_path)] = entry
