"""What a disk tier finds out about its directory at open, and a server at start.

Whether the configured path can ever become a directory (:func:`unusable_path`,
:func:`check_path`, :func:`unusable`), whether files can be created in it
(:func:`probe_write`), whether its filesystem takes ``O_DIRECT``
(:func:`probe_o_direct`) and how many block files the free space holds
(:func:`fit_capacity`). Apart from :mod:`kvstore.tiers.disk` because none of it
moves a block: it reads the filesystem once, before (or instead of) any I/O.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path

from kvstore.config import DiskTierConfig
from kvstore.errors import ConfigError
from kvstore.tiers.files import FileOps

__all__ = [
    "check_path",
    "fit_capacity",
    "probe_o_direct",
    "probe_write",
    "unusable",
    "unusable_path",
]

#: The disk tier's lines keep its logger's name.
log = logging.getLogger("kvstore.tiers.disk")


def _blocked(root: Path) -> str | None:
    """Which existing part of ``root`` is not a directory (so ``root`` can never be one)."""
    blocker = next((p for p in (root, *root.parents) if os.path.lexists(p)), None)
    if blocker is None or blocker.is_dir():
        return None
    return f"{blocker} is {'a file, ' if blocker.is_file() else ''}not a directory"


def _message(root: Path, why: str) -> str:
    return (
        f"disk tier path {root}: {why}; "
        "set the tier's path to a directory kvstore can create and write"
    )


def unusable(root: Path, exc: OSError) -> str:
    """One line saying why the configured path ``root`` cannot hold a disk tier."""
    why = _blocked(root)
    if why is None:
        failed = exc.filename or root
        where = "it" if str(failed) == str(root) else str(failed)
        why = f"cannot create {where}: {exc.strerror or exc}"
    return _message(root, why)


def unusable_path(path: str) -> str | None:
    """Why a disk tier could never use ``path``, found by reading only (``kvstore stats``
    writes nothing): a part of it that exists is not a directory, or it does not exist
    and the directory it would be made in refuses writes. None: nothing read says so.
    The same line a store's open raises as :class:`ConfigError`."""
    root = Path(path).expanduser()
    why = _blocked(root)
    chain = [root, *root.parents]
    found = next((i for i, p in enumerate(chain) if os.path.lexists(p)), None)
    if why is None and found:  # not root itself: something must be made, in chain[found]
        place, missing = chain[found], chain[found - 1]
        if not os.access(place, os.W_OK | os.X_OK):
            code = errno.EROFS if os.statvfs(place).f_flag & os.ST_RDONLY else errno.EACCES
            where = "it" if missing == root else str(missing)
            why = f"cannot create {where}: {os.strerror(code)}"
    return None if why is None else _message(root, why)


def check_path(config: DiskTierConfig) -> None:
    """Refuse (:class:`ConfigError`) a disk tier path that cannot become a directory, and
    warn once when files cannot be created in it; for a server, whose stores open their
    disk tiers only when clients come, so a bad path is said at start, not per client."""
    root = Path(config.path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if not root.is_dir():
            raise ConfigError(unusable(root, exc)) from None
    probe = root / f".write-probe.{os.getpid()}.0.tmp"
    try:
        probe.touch(exist_ok=False)
    except OSError as exc:
        log.warning(
            "disk tier %s: cannot write (%s); its stores will serve the blocks already "
            "there and store none",
            root,
            exc.strerror or exc,
        )
        return
    probe.unlink()


def probe_write(ops: FileOps, base: Path, nonce: int) -> str | None:
    """Why a file cannot be created in the layout directory ``base``, or None if it can.

    The probe is named like a temp file, so one left by a crash is swept at the
    next open."""
    probe = str(base / f".write-probe.{os.getpid()}.{nonce}.tmp")
    try:
        fd = ops.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return exc.strerror or str(exc)
    ops.close(fd)
    with contextlib.suppress(OSError):
        ops.unlink(probe)
    return None


def probe_o_direct(base: Path, warn: bool = True) -> bool:
    """True if the filesystem holding ``base`` takes O_DIRECT (tmpfs, for one, does not)."""
    flag = getattr(os, "O_DIRECT", 0)
    probe = str(base / f".o_direct_probe.{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | flag, 0o600)
    except OSError:
        if warn:
            log.warning("disk tier %s: O_DIRECT not supported, using buffered I/O", base)
        return False
    os.close(fd)
    os.unlink(probe)
    return bool(flag)


def fit_capacity(blocks: int, base: Path, held: int, file_nbytes: int) -> int:
    """``blocks`` (block files the configured capacity holds), or fewer where the free
    space under ``base`` -- plus the ``held`` files already there -- holds fewer."""
    try:
        usage = shutil.disk_usage(base)
    except OSError:
        return blocks
    room = int(0.95 * (usage.free + held * file_nbytes)) // file_nbytes
    if room < blocks:
        log.warning(
            "disk tier %s: capacity %d blocks exceeds free space; using %d",
            base,
            blocks,
            max(1, room),
        )
        return max(1, room)
    return blocks
