"""File plumbing for the disk tier: syscalls, whole reads and writes, the directory tree.

:class:`FileOps` is the disk tier's only door to the OS, so tests can put a
fault-injecting subclass in front of a real filesystem for the errors a real
disk will not produce on demand (EIO). Everything else here is plain
functions over it.

Tree: ``<root>/kvstore-v1/<layout fingerprint>/<first 2 hex of key>/<key hex>.kvb``.
The layout directory keeps blocks of other layouts apart (they are never
listed, never misread); the 256-way fan-out keeps directories small. A block
is written to ``.<key hex>.<pid>.<nonce>.tmp`` in the same directory and
renamed over its final name, so a reader -- or a process restarted after
``kill -9`` -- sees a block whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BLOCK_SUFFIX",
    "FileOps",
    "Tree",
    "pid_alive",
    "read_exact",
    "write_all",
]

BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
FORMAT_DIR = "kvstore-v1"
STALE_TMP_SECONDS = 3600.0

Buffer = bytes | bytearray | memoryview


class FileOps:
    """The syscalls the disk tier makes (overridden by fault-injection tests)."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        """``os.open``."""
        return os.open(path, flags, mode)

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        """``os.pwritev``."""
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        """``os.preadv``."""
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        """``os.fsync``."""
        os.fsync(fd)

    def fadvise(self, fd: int, offset: int, length: int, advice: int) -> None:
        """``os.posix_fadvise`` (a no-op where the platform lacks it)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, advice)

    def close(self, fd: int) -> None:
        """``os.close``."""
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        """``os.rename`` (atomic within a directory)."""
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        """``os.unlink``."""
        os.unlink(path)


def _advance(buffers: list[memoryview], done: int) -> list[memoryview]:
    """The buffers left after ``done`` bytes of them were transferred."""
    while buffers and done >= len(buffers[0]):
        done -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and done:
        buffers = [buffers[0][done:], *buffers[1:]]
    return buffers


def write_all(ops: FileOps, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """Write every buffer at ``offset`` (looping over short writes); return bytes written."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = ops.pwritev(fd, views[:1024], offset + total)  # IOV_MAX is 1024 on Linux
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        total += n
        views = _advance(views, n)
    return total


def read_exact(ops: FileOps, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """Fill the buffers from ``offset`` (looping over short reads); return bytes read.

    Stops early only at end of file, so a return below the buffers' total
    size means the file is shorter (a truncated block).
    """
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = ops.preadv(fd, views[:1024], offset + total)
        if n == 0:
            break
        total += n
        views = _advance(views, n)
    return total


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a temp file's writer may still be writing it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Tree:
    """Paths of one layout's blocks under a disk tier's root directory."""

    root: Path
    layout_hex: str

    @property
    def base(self) -> Path:
        """The layout's directory."""
        return self.root / FORMAT_DIR / self.layout_hex

    def block_path(self, key: bytes) -> str:
        """Final path of the block ``key``."""
        name = key.hex()
        return f"{self.base}/{name[:2]}/{name}{BLOCK_SUFFIX}"

    def temp_path(self, key: bytes, nonce: int) -> str:
        """A unique temporary path next to the block's final path."""
        name = key.hex()
        return f"{self.base}/{name[:2]}/.{name}.{os.getpid()}.{nonce}{TMP_SUFFIX}"

    def make_dirs(self) -> None:
        """Create the layout directory and its 256 fan-out directories."""
        for i in range(256):
            (self.base / f"{i:02x}").mkdir(parents=True, exist_ok=True)

    def scan(self, ops: FileOps | None = None) -> tuple[list[bytes], int]:
        """Keys of every whole block on disk, least recently written first.

        With ``ops``, also deletes temp files left by dead writers (or older
        than an hour) in the same pass; returns ``(keys, temps_removed)``.
        """
        found: list[tuple[float, bytes]] = []
        now = time.time()
        # The layout directory's own temps (a write probe, layout.json's) a dead opener left.
        removed = 0 if ops is None else _sweep_temps(ops, str(self.base), now)
        for fan in _subdirs(self.base):
            with contextlib.suppress(FileNotFoundError), os.scandir(fan) as entries:
                for entry in entries:
                    key = _key_of(entry.name)
                    if key is not None:
                        with contextlib.suppress(FileNotFoundError):
                            found.append((entry.stat().st_mtime, key))
                    elif ops is not None and _is_stale_temp(entry, now):
                        # Gone already, or a read-only directory: a temp is never read.
                        with contextlib.suppress(OSError):
                            ops.unlink(entry.path)
                            removed += 1
        found.sort()
        return [key for _, key in found], removed


def _subdirs(base: Path) -> list[str]:
    try:
        with os.scandir(base) as entries:
            return sorted(e.path for e in entries if len(e.name) == 2 and e.is_dir())
    except (FileNotFoundError, NotADirectoryError):  # nothing stored there
        return []


def _key_of(name: str) -> bytes | None:
    if len(name) != 32 + len(BLOCK_SUFFIX) or not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:32])
    except ValueError:
        return None


def _sweep_temps(ops: FileOps, directory: str, now: float) -> int:
    """Delete the stale temp files right in ``directory``; how many went."""
    removed = 0
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(directory) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False) and _is_stale_temp(entry, now):
                with contextlib.suppress(OSError):
                    ops.unlink(entry.path)
                    removed += 1
    return removed


def _is_stale_temp(entry: os.DirEntry[str], now: float) -> bool:
    """A temp file is stale unless its writer still runs and it is recent."""
    if not (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)):
        return False
    parts = entry.name.split(".")  # "", key (or what it is), pid, nonce, "tmp"
    try:
        pid = int(parts[2])
        age = now - entry.stat().st_mtime
    except (IndexError, ValueError, FileNotFoundError):
        return True
    return not (pid_alive(pid) and age < STALE_TMP_SECONDS)
