"""One kvstore-server per disk directory: an exclusive lock held while it runs.

A server owns its disk tier's directory: its stores (one per namespace and layout,
under ``<path>/ns-<namespace>/``) index, evict and delete the block files they find
there as their own, and flush to it when the server stops. Two servers on one
directory would each evict and delete the other's blocks (lookups that count blocks
gone, restarts that find fewer than were stored), so the second one refuses to start.

The lock is ``flock(LOCK_EX)`` on ``<path>/.kvstore-server.lock``: the kernel drops it
when the process ends, however it ends, so a server restarted after ``kill -9`` starts
as usual (the file stays; only the lock matters). The holder writes its pid into the
file, for the refusal to name it. Library stores (``KVStore``) take no such lock:
several processes may share a directory (the ranks of a tensor-parallel engine, a
writer and its readers; docs/tiers.md says how capacity is counted then).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from kvstore.errors import ConfigError

__all__ = ["LOCK_NAME", "DirectoryLock"]

#: The lock file in a server's disk tier directory.
LOCK_NAME = ".kvstore-server.lock"


class DirectoryLock:
    """The exclusive lock of one disk directory, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the process that holds it
        (one line: which directory, who, what to do)."""
        if self._fd is not None:
            return
        fd = self._open()
        if fd is None:  # a read-only directory: no server can delete a block there
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(
                    f"disk tier path {self.directory}: cannot lock {self.path}: "
                    f"{exc.strerror or exc}"
                ) from None
            raise ConfigError(
                f"disk tier path {self.directory} is in use by another kvstore-server"
                f"{holder}; two servers on one directory delete each other's blocks: give "
                "each server a disk path of its own, or stop the other one first"
            ) from None
        with contextlib.suppress(OSError):  # read-only: the lock holds all the same
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _open(self) -> int | None:
        """A descriptor of the lock file (made if need be); None where the directory
        refuses writes and holds no lock file (nothing to lock, nothing to protect)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ConfigError(
                    f"disk tier path {self.directory}: cannot open {self.path}: "
                    f"{exc.strerror or exc}"
                ) from None
        try:
            return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def release(self) -> None:
        """Let the lock go (the file stays: removing it could race a starting server)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock


def _holder(fd: int) -> str:
    """`` (pid N)`` from the lock file's contents, if it names one."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""
