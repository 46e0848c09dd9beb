"""Running ``kvstore`` and ``kvstore-server`` as a user does, for tests of their mistakes.

Each run gets a directory of its own as HOME, cache directory (``XDG_CACHE_HOME``) and
working directory, and no ``KVSTORE_*`` variable from outside, so that a test can tell
that a command wrote nothing by comparing :func:`files_under` before and after.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["command_env", "files_under", "one_error_line", "prepare_home", "run_command"]

#: What :func:`files_under` records of a path: whether a directory, size, mtime (ns).
Entry = tuple[bool, int, int]


def prepare_home(tmp: Path) -> None:
    """Make ``tmp/home`` and ``tmp/work`` (the run's HOME and working directory)."""
    (tmp / "home").mkdir(exist_ok=True)
    (tmp / "work").mkdir(exist_ok=True)


def command_env(tmp: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment less ``KVSTORE_*``, with HOME and the cache under
    ``tmp``, and ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(HOME=str(tmp / "home"), XDG_CACHE_HOME=str(tmp / "cache"))
    env.update(extra or {})
    return env


def run_command(
    argv: Sequence[str], tmp: Path, extra_env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``argv`` in ``tmp/work`` (see :func:`prepare_home`), stdin empty, output captured."""
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp / "work",
        env=command_env(tmp, extra_env),
        stdin=subprocess.DEVNULL,
    )


def files_under(root: Path) -> dict[str, Entry]:
    """Every path under ``root`` (relative): whether a directory, its size and mtime."""
    found = {}
    for path in root.rglob("*"):
        st = path.lstat()
        found[str(path.relative_to(root))] = (path.is_dir(), st.st_size, st.st_mtime_ns)
    return found


def one_error_line(
    result: subprocess.CompletedProcess[str], prog: str, says: Sequence[str] = ()
) -> str:
    """Assert the run failed as a mistake should: exit 2, nothing on stdout, and exactly
    one line on stderr, ``PROG: error: ...``, containing each of ``says``, no traceback.
    Returns that line."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: "), result.stderr
    for part in says:
        assert part in lines[0], (part, lines[0])
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == "", result.stdout
    return lines[0]
