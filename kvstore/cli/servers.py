"""Real servers on free local ports: ``kvstore local-cluster``'s, and those of tests and
benchmarks of the remote tiers.

- :func:`free_port` -- a TCP port free on 127.0.0.1 right now.
- :class:`RedisServer` -- one ``redis-server`` (no persistence), which can be
  killed and restarted on the same port.
- :class:`RedisCluster` -- three ``redis-server --cluster-enabled yes`` nodes
  joined by ``redis-cli --cluster create``.
- :class:`S3Server` -- moto's S3 server (in a thread, or in a child process
  when the caller's GIL must stay free, as in benchmarks) with one bucket.
Every helper is a context manager and stops everything it started: child
processes are terminated (then killed), threads joined, sockets closed.
Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvstore.errors import ConfigError, TierError

__all__ = [
    "DUMMY_AWS_ENV",
    "HOST",
    "RedisCluster",
    "RedisServer",
    "S3Server",
    "free_port",
    "list_objects",
    "redis_command",
    "require_binary",
]

HOST = "127.0.0.1"
#: Credentials moto accepts; set them in the environment of a test (never real ones).
DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "kvstore-test-key",
    "AWS_SECRET_ACCESS_KEY": "kvstore-test-secret",
    "AWS_SESSION_TOKEN": "kvstore-test-token",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_START_TIMEOUT = 15.0


def free_port(also_free: Sequence[int] = ()) -> int:
    """A TCP port free on 127.0.0.1; ``also_free`` offsets (e.g. 10000) must be free too.

    Drawn at random below the kernel's ephemeral range, not by binding port 0: a port
    the kernel hands out is as likely to go next to another process's outgoing
    connection or ``bind(0)`` in the time between this check and the server's own bind.
    On a loaded machine that race was lost (``vllm serve``'s event socket: "Address
    already in use"); below the range only another draw of this function can collide.
    """
    low, high = _port_range()
    for _ in range(200):
        port = random.randint(low, high)
        if _bindable(port) and all(_bindable(port + off) for off in also_free):
            return port
    raise TierError(f"no free port found with offsets {list(also_free)} also free")


def _port_range() -> tuple[int, int]:
    """Ports below the ephemeral range, leaving room for a +10000 offset below it too."""
    first_ephemeral = 32768
    with contextlib.suppress(OSError, ValueError):
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    high = first_ephemeral - 10_001
    return (max(1024, high - 12_000), high) if high > 2048 else (1024, 65535)


def _bindable(port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def require_binary(name: str) -> str:
    """Path of executable ``name``, or a clear error saying how to install it."""
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"{name} is not installed; run scripts/install-servers.sh")
    return path


def redis_command(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """Send one command to a local Redis over a plain socket; return the raw reply.

    Handles the replies the helpers need: simple strings, errors, integers and
    bulk strings (``CLUSTER INFO``, ``GET``).
    """
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(b"".join(parts))
        reply = b""
        while not _complete(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return reply


def _complete(reply: bytes) -> bool:
    line, sep, rest = reply.partition(b"\r\n")
    if not sep:
        return False
    if not line.startswith(b"$"):
        return True
    size = int(line[1:])
    return size < 0 or len(rest) >= size + 2


def _wait(check: Any, what: str, timeout: float = _START_TIMEOUT) -> None:
    """Poll ``check()`` until it is truthy; raise TierError naming ``what`` on timeout."""
    end = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < end:
        try:
            if check():
                return
        except OSError as exc:
            last = exc
        time.sleep(0.02)
    raise TierError(f"{what} did not come up within {timeout:g}s (last error: {last})")


def _stop_process(proc: subprocess.Popen[bytes] | None, kill: bool = False) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
    if kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, no persistence, its files in a temp dir.

    ``kill()`` stops it like a crash (SIGKILL); ``start()`` brings it back on
    the same port (empty, since nothing is saved).
    """

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self.binary = require_binary("redis-server")
        self.port = port if port is not None else free_port()
        self.extra_args = list(extra_args)
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        log_path = Path(self._tmp.name) / "redis.log"
        args = [
            self.binary,
            *("--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no"),
            *("--dir", self._tmp.name, "--logfile", str(log_path), "--protected-mode", "no"),
            *self.extra_args,
        ]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            _wait(self._answers_ping, f"redis-server on port {self.port}")
        except TierError as exc:
            tail = log_path.read_text()[-2000:] if log_path.exists() else ""
            self.stop()
            raise TierError(f"{exc}\n{tail}") from None
        return self

    def _answers_ping(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            err = self._proc.stderr.read().decode() if self._proc and self._proc.stderr else ""
            raise TierError(f"redis-server on port {self.port} exited: {err[-2000:]}")
        # -NOAUTH: up, with a password (``--requirepass`` in extra_args)
        return redis_command(self.port, "PING", timeout=0.5).startswith((b"+PONG", b"-NOAUTH"))

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL). Idempotent."""
        _stop_process(self._proc)
        self._close_pipes()

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        _stop_process(self._proc, kill=True)
        self._close_pipes()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        if self._proc is not None and self.running:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused server (SIGCONT)."""
        if self._proc is not None and self.running:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start again on the same port."""
        self.kill()
        self.start()

    def _close_pipes(self) -> None:
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisCluster:
    """A 3-node Redis Cluster (3 primaries, no replicas) on 127.0.0.1."""

    def __init__(self, nodes: int = 3) -> None:
        self.cli = require_binary("redis-cli")
        self.servers: list[RedisServer] = []
        self._nodes = nodes

    @property
    def url(self) -> str:
        """The URL of the first node (the client discovers the others)."""
        return self.servers[0].url

    def start(self) -> RedisCluster:
        """Start the nodes, create the cluster, wait for ``cluster_state:ok`` everywhere."""
        try:
            for _ in range(self._nodes):
                port = free_port(also_free=(10000,))  # the cluster bus is port + 10000
                args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "5000")
                self.servers.append(RedisServer(port, args).start())
            addrs = [f"{HOST}:{s.port}" for s in self.servers]
            create = ["--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run(
                [self.cli, *create],
                check=True,
                capture_output=True,
                timeout=60,
            )
            for server in self.servers:
                _wait(
                    lambda s=server: (
                        b"cluster_state:ok" in redis_command(s.port, "CLUSTER", "INFO")
                    ),
                    f"cluster node {server.port}",
                    timeout=30,
                )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every node. Idempotent."""
        for server in self.servers:
            server.close()
        self.servers = []

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3Server:
    """moto's S3 on 127.0.0.1 with one bucket.

    ``mode="thread"`` runs moto's ``ThreadedMotoServer`` in this process (fast
    to start); ``mode="process"`` runs ``python -m moto.server`` as a child,
    so the server does not share this process's GIL (benchmarks). The
    in-process servers share moto's global state: a bucket may already exist,
    and the state is reset when the last in-process server stops.
    """

    _in_process: ClassVar[int] = 0  # live thread-mode servers (they share moto's state)
    _werkzeug_level: ClassVar[int] = logging.NOTSET

    def __init__(
        self, bucket: str = "kvstore-test", mode: str = "thread", refuse_credentials: bool = False
    ) -> None:
        if mode not in ("thread", "process"):
            raise ConfigError(f"S3Server mode must be 'thread' or 'process', got {mode!r}")
        if refuse_credentials and mode != "process":
            raise ConfigError("S3Server(refuse_credentials=True) needs mode='process'")
        self.bucket = bucket
        self.mode = mode
        #: moto checks every request after the one making the bucket against its own
        #: (empty) IAM, so any credentials are refused (InvalidAccessKeyId).
        self.refuse_credentials = refuse_credentials
        self.port = free_port()
        self._thread_server: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    @property
    def url(self) -> str:
        """The endpoint URL, ``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> S3Server:
        """Start the server and create the bucket."""
        try:
            if self.mode == "thread":
                self._start_thread()
            else:
                self._start_process()
            _wait(self._answers, f"moto S3 server on port {self.port}")
            self._create_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def _create_bucket(self) -> None:
        import botocore.exceptions

        try:
            self.client().create_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def _start_thread(self) -> None:
        from moto.server import ThreadedMotoServer

        if S3Server._in_process == 0:  # werkzeug logs every request at INFO: quiet it
            wz = logging.getLogger("werkzeug")
            S3Server._werkzeug_level = wz.level
            wz.setLevel(logging.ERROR)
        self._thread_server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        self._thread_server.start()
        S3Server._in_process += 1

    def _start_process(self) -> None:
        args = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]
        env = {**os.environ, **DUMMY_AWS_ENV}
        if self.refuse_credentials:  # the first request (making the bucket) goes through
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "1"
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    def _answers(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise TierError(f"moto server exited with status {self._proc.returncode}")
        with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=1) as resp:
            return bool(resp.status == 200)

    def client(self) -> Any:
        """A boto3 S3 client on this server with the dummy credentials (for test setup).

        One client per server, shared (boto3 clients are thread-safe); closed on stop.
        """
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        import boto3
        import botocore.config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.url,
            region_name=DUMMY_AWS_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(s3={"addressing_style": "path"}),
        )

    def stop(self) -> None:
        """Stop the server (and its client). Idempotent."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._thread_server is not None:
            S3Server._in_process -= 1
            if S3Server._in_process == 0:  # no other in-process server relies on the state
                with contextlib.suppress(OSError):
                    req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
                    urllib.request.urlopen(req, timeout=2).close()
                logging.getLogger("werkzeug").setLevel(S3Server._werkzeug_level)
            self._thread_server.stop()
            server = getattr(self._thread_server, "_server", None)
            if server is not None:
                server.server_close()  # ThreadedMotoServer.stop leaves the socket open
            self._thread_server = None
        _stop_process(self._proc)
        self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def list_objects(server: S3Server, prefix: str = "") -> Iterator[str]:
    """Every object name in ``server``'s bucket under ``prefix`` (test helper)."""
    pages = (
        server.client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=server.bucket, Prefix=prefix)
    )
    for page in pages:
        for obj in page.get("Contents", ()):
            yield str(obj["Key"])
