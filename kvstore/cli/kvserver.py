"""A real ``kvstore-server`` in a child process, for tests, benchmarks and examples.

>>> with KVStoreServerProcess({"tiers": [...]}, workdir) as server:
...     options = ClientOptions(address=server.address)
...     server.kill()                  # like a crash (SIGKILL)
...     server.start()                 # same port, same disk directory

The server listens on a free 127.0.0.1 port and on a Unix socket in
``workdir`` (whatever the config's ``listen`` and ``unix_socket`` say); its output goes
to ``workdir/server.log``. Stopping sends SIGTERM (the server drains and flushes to
disk) and waits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvstore.cli.servers import HOST, free_port
from kvstore.errors import TierError

__all__ = ["KVStoreServerProcess", "server_test_config"]

_START_TIMEOUT = 30.0


def server_test_config(
    workdir: str | os.PathLike[str], tiers: list[dict[str, Any]] | None = None, **server: Any
) -> dict[str, Any]:
    """A small server config for tests: 16 MiB of host memory over 256 MiB of disk in
    ``workdir``, any free port, a Unix socket in ``workdir``; ``server`` overrides.
    Disk tiers of ``tiers`` without a ``path`` get ``workdir/disk``."""
    work = Path(workdir)
    default_tiers = [
        {"kind": "host", "capacity": "16MiB"},
        {"kind": "disk", "capacity": "256MiB"},
    ]
    tiers = [dict(t) for t in (tiers if tiers is not None else default_tiers)]
    for tier in tiers:
        if tier.get("kind") == "disk" and not tier.get("path"):
            tier["path"] = str(work / "disk")
    settings = {
        "listen": f"{HOST}:0",
        "unix_socket": str(work / "kvstore.sock"),
        "max_stores": 256,
        **server,
    }
    return {"tiers": tiers, "server": settings}


class KVStoreServerProcess:
    """``python -m kvstore.server.cli`` with a config written to ``workdir``."""

    def __init__(
        self,
        config: Mapping[str, Any],
        workdir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        metrics: bool = False,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.metrics_port = free_port() if metrics else None
        self.unix_path = str(self.workdir / "kvstore.sock")
        # Its own port and socket always (a config made for an in-process server may
        # name port 0, which this object could not find).
        server = dict(config.get("server") or {})
        server["listen"] = f"{HOST}:{self.port}"
        server["unix_socket"] = self.unix_path
        if self.metrics_port is not None:
            server["metrics_listen"] = f"{HOST}:{self.metrics_port}"
        self.config = {**config, "server": server}
        self.config_path = self.workdir / "server.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = self.workdir / "server.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.env.update(env or {})
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """The TCP address."""
        return f"{HOST}:{self.port}"

    @property
    def unix_address(self) -> str:
        """``unix:<path>``."""
        return f"unix:{self.unix_path}"

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> KVStoreServerProcess:
        """Start it (again) and wait until it accepts connections."""
        if self.running:
            return self
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.server.cli", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        end = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < end:
            if not self.running:
                raise TierError(f"kvstore-server exited at start:\n{self.log_tail()}")
            if self._accepts():
                return self
            time.sleep(0.02)
        self.kill()
        raise TierError(f"kvstore-server did not start in {_START_TIMEOUT:g}s:\n{self.log_tail()}")

    def _accepts(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def log_tail(self, nbytes: int = 4000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-nbytes:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain, flush) and wait; the exit code (None if it was not running)."""
        if self._proc is None or not self.running:
            return None if self._proc is None else self._proc.returncode
        self._proc.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TierError(f"kvstore-server ignored SIGTERM for {timeout:g}s") from None

    def kill(self) -> None:
        """SIGKILL, like a crash, and wait."""
        if self._proc is not None and self.running:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def __enter__(self) -> KVStoreServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()
