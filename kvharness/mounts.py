"""Real small filesystems for tests of full and read-only disks (tmpfs mounts: root, or a
process with the capability; elsewhere :func:`mount_tmpfs` says no and tests skip)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["mount_tmpfs", "remount_read_only", "unmount"]


def mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` (``"2m"``) at ``path`` (made if missing); whether it
    could be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def remount_read_only(path: Path) -> None:
    """Make the filesystem mounted at ``path`` read-only (what it holds stays readable)."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def unmount(path: Path) -> None:
    """Unmount ``path`` (lazily: a file still open there does not keep it)."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
