"""The processes bench_peers.py starts: Mooncake's master and store process, and client workers.

- :class:`MooncakeVenv`: where ``.venv-mooncake`` (``benchmarks/peers/setup_mooncake.sh``)
  keeps its Python, its binaries and the Debian libraries ``store.so`` links (put on
  ``LD_LIBRARY_PATH`` of every Mooncake process started here, nothing system-wide);
- :class:`MooncakeServers`: ``mooncake_master`` and the standalone store process
  ``mooncake_client`` on 127.0.0.1 (protocol ``tcp``, metadata ``P2PHANDSHAKE``), one
  global segment of a given size;
- :class:`WorkerPool`: ``benchmarks/peers/store_worker.py`` processes of one system, driven
  by JSON lines; :meth:`WorkerPool.rep` times one rep of a subject across them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from _common import log

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "peers" / "store_worker.py"
MOONCAKE_SETUP = "bash benchmarks/peers/setup_mooncake.sh"
HOST = "127.0.0.1"


class PeerUnavailable(Exception):
    """A peer that cannot be installed or started here: its rows are skipped, with why."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def accepts(port: int) -> bool:
    """True if something listens on 127.0.0.1:``port``."""
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def tail(path: Path, nbytes: int = 2500) -> str:
    """The end of a log file ("" if there is none)."""
    try:
        return path.read_text(errors="replace")[-nbytes:]
    except OSError:
        return ""


# -- Mooncake ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MooncakeVenv:
    """``.venv-mooncake``: its Python, the package's folder and the libraries' folders."""

    root: Path
    python: Path
    package: Path
    ld_library_path: str
    version: str

    @classmethod
    def find(cls, root: Path) -> MooncakeVenv:
        """The venv at ``root``; :class:`PeerUnavailable` (with the fix) if it is not usable."""
        python = root / "bin" / "python"
        stamp = root / ".kvstore-mooncake-installed"
        if not python.exists() or not stamp.exists():
            raise PeerUnavailable(f"no complete Mooncake venv at {root}: run {MOONCAKE_SETUP}")
        packages = sorted(root.glob("lib/python3*/site-packages/mooncake"))
        if not packages or not (packages[0] / "mooncake_master").exists():
            raise PeerUnavailable(f"{root} has no mooncake package: run {MOONCAKE_SETUP}")
        libs = (root / "ld_library_path").read_text().strip()
        version = stamp.read_text().split("-debs-")[0].rsplit("-", 1)[-1]
        return cls(root, python, packages[0], libs, version)

    def env(self) -> dict[str, str]:
        """The environment of a Mooncake process: the venv's libraries found first."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = self.ld_library_path + (f":{old}" if old else "")
        return env


class MooncakeServers:
    """``mooncake_master`` and ``mooncake_client`` (the store process holding one global
    segment of ``segment_bytes``) on 127.0.0.1, logs in ``workdir``."""

    def __init__(self, venv: MooncakeVenv, segment_bytes: int, workdir: Path) -> None:
        self.venv, self.segment_bytes, self.workdir = venv, segment_bytes, workdir
        self.master_port, self.client_port = free_port(), free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def ends(self) -> dict[str, str]:
        """Where the clients connect."""
        return {
            "mooncake_master": f"{HOST}:{self.master_port}",
            "mooncake_client": f"{HOST}:{self.client_port}",
        }

    def _start(self, name: str, args: list[str], port: int, timeout: float = 60) -> None:
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [str(self.venv.package / name), *args, "--logtostderr"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.venv.env(),
            )
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while not accepts(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                what = f"exited ({proc.returncode})" if proc.poll() is not None else "hung"
                raise PeerUnavailable(f"{name} {what} at start:\n{tail(log_path)}")
            time.sleep(0.05)

    def __enter__(self) -> MooncakeServers:
        try:
            self._start(
                "mooncake_master",
                [
                    f"--rpc_port={self.master_port}",
                    f"--rpc_address={HOST}",
                    f"--metrics_port={free_port()}",
                    f"--metrics_host={HOST}",
                    "--enable_http_metadata_server=false",
                ],
                self.master_port,
            )
            self._start(
                "mooncake_client",
                [
                    f"--master_server_address={HOST}:{self.master_port}",
                    "--metadata_server=P2PHANDSHAKE",
                    "--protocol=tcp",
                    f"--host={HOST}",
                    f"--port={self.client_port}",
                    f"--global_segment_size={self.segment_bytes}",
                ],
                self.client_port,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs = []


# -- client workers ----------------------------------------------------------------------------
class WorkerError(RuntimeError):
    """A worker failed a command (its traceback is the message)."""


class Worker:
    """One ``store_worker.py`` process."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
                bufsize=1,
            )

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> Any:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"worker exited ({code}):\n{tail(self.log_path)}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise WorkerError(reply["error"])
        return reply["value"]

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("stop")
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class WorkerPool:
    """``count`` worker processes of ``side`` (``kvstore`` or ``mooncake``)."""

    def __init__(
        self, side: str, count: int, python: Path, env: dict[str, str], workdir: Path, plant: bool
    ) -> None:
        self.side = side
        argv = [str(python), str(WORKER), side] + (["--plant-wrong-byte"] if plant else [])
        self.workers = [Worker(argv, env, workdir / f"{side}-worker{i}.log") for i in range(count)]

    def call(self, which: range, cmd: str, **args: Any) -> list[Any]:
        """``cmd`` on workers ``which`` at once; their values in order."""
        for i in which:
            self.workers[i].send(cmd, **args)
        return [self.workers[i].receive() for i in which]

    def setup(self, plan: dict[str, Any]) -> None:
        """Each worker connects and makes its blocks (all at once)."""
        for i, worker in enumerate(self.workers):
            worker.send("setup", plan={**plan, "index": i})
        for worker in self.workers:
            worker.receive()

    def rep(self, op: str, path: str, size: str, clients: int, reps: int = 1) -> dict[str, Any]:
        """One rep on ``clients`` workers: all prepare (untimed), then all go; its seconds
        (first start to last end) and the byte check's findings."""
        which = range(clients)
        self.call(which, "prepare", op=op, path=path, size=size, clients=clients, reps=reps)
        spans = self.call(which, "go")
        wrong = [
            f"worker {i}: {s['wrong']}" for i, s in zip(which, spans, strict=True) if s["wrong"]
        ]
        seconds = max(s["end"] for s in spans) - min(s["start"] for s in spans)
        return {"seconds": seconds, "wrong": wrong}

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()


def kvstore_worker_env() -> dict[str, str]:
    """A kvstore worker's environment: no ``KVSTORE_*`` settings (the clients would read them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def kvstore_python() -> Path:
    """This interpreter (kvstore's venv)."""
    return Path(sys.executable)


def say(msg: str) -> None:
    """Progress on stderr."""
    log(f"bench_peers: {msg}")
