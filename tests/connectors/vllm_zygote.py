"""A fork server for the end-to-end vLLM tests: one ``.venv-vllm`` process imports vLLM
(about 18 s on two cores: torch, dynamo, openai) once, then forks a fresh child for each
engine script a test runs, so every run after the first skips that import.

Each child is a new process (its own pid, memory and store objects; what it leaves on
disk is what the next one finds), run as ``python script args`` would run it: its own
argv, environment, working directory, ``sys.path[0]``, stdout and stderr in a log file,
a normal interpreter exit (threads joined, ``atexit`` hooks), and a process group of its
own, killed whole on a timeout. What it shares with its siblings is Python's hash seed
(fixed when the server started): tests that must show keys do not depend on it
(test_vllm_e2e) start real processes. ``KVSTORE_TEST_ZYGOTE=0`` turns the server off.

The client (:func:`run_script`, in the pytest process) imports nothing of vLLM; the
server is this file run by the engines' Python (``__main__`` below).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: What the server imports before its first fork: what every engine script imports.
PRELOAD = ("vllm", "vllm.v1.engine.llm_engine", "kvstore.connectors.vllm", "transformers")


class Zygote:
    """The client end of one fork server (thread-safe: ``_write_lock`` guards the request
    pipe; the reader thread alone reads the replies and hands each to its waiter)."""

    def __init__(self, python: Path) -> None:
        here = Path(__file__).resolve()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env.pop("PYTHONHASHSEED", None)
        self.proc = subprocess.Popen(
            [str(python), str(here)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=str(here.parent),
        )
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        self._waiters: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._reader = threading.Thread(target=self._read, name="vllm-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            reply = json.loads(line)
            waiter = self._waiters.get(reply["id"])
            if waiter is not None:
                waiter.put(reply)
        for waiter in list(self._waiters.values()):  # the server died: wake everyone
            waiter.put({"rc": -1, "error": "the fork server exited"})

    def run(self, cmd: Sequence[str], env: Mapping[str, str], log: Path, timeout: float) -> int:
        """Run ``cmd`` (``[python, script, *args]``) in a forked child; its exit code."""
        rid = next(self._ids)
        waiter: queue.Queue[dict[str, Any]] = queue.Queue()
        self._waiters[rid] = waiter
        request = {"id": rid, "argv": list(cmd[1:]), "env": dict(env)}
        request.update(cwd=os.getcwd(), log=str(log))
        try:
            with self._write_lock:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            pid = waiter.get(timeout=timeout).get("pid")  # the first waits for the imports
            if pid is None:
                return -1
            try:
                return int(waiter.get(timeout=timeout)["rc"])
            except queue.Empty:
                os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(list(cmd), timeout) from None
        finally:
            self._waiters.pop(rid, None)

    def close(self) -> None:
        """End the server (it waits for its running children first)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def _shared(python: Path) -> Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote(python)
            atexit.register(_zygote.close)
        return _zygote


def run_script(cmd: Sequence[str], env: Mapping[str, str], log: Path, timeout: float) -> int:
    """Run ``cmd`` (``[engines' python, script, *args]``) with stdout and stderr in
    ``log``; its exit code. Through the fork server unless ``KVSTORE_TEST_ZYGOTE=0``;
    raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
    if os.environ.get("KVSTORE_TEST_ZYGOTE", "1") == "0":
        with open(log, "w") as f:
            proc = subprocess.run(
                list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env), timeout=timeout
            )
        return proc.returncode
    return _shared(Path(cmd[0])).run(cmd, env, log, timeout)


# -- the server ---------------------------------------------------------------------------
def _child(request: dict[str, Any]) -> int:
    """In the forked child: become ``python argv...`` and run it; its exit code."""
    import runpy
    import traceback

    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _serve(proto: IO[str]) -> dict[str, Any] | None:
    """Fork a child per request line on stdin, report each pid and exit code on
    ``proto``; return the request in a child, None in the server once stdin closes and
    every child has exited."""
    import select

    children: dict[int, int] = {}
    stdin_open, pending = True, b""
    while stdin_open or children:
        # raw reads: a buffered readline could hold a second request select() never reports
        if stdin_open and select.select([0], [], [], 0.2)[0]:
            data = os.read(0, 1 << 16)
            stdin_open = bool(data)
            pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return dict(request)
            children[pid] = request["id"]
            proto.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is not None:
                rc = os.waitstatus_to_exitcode(status)
                proto.write(json.dumps({"id": rid, "rc": rc}) + "\n")
        if not stdin_open and children:
            select.select([], [], [], 0.2)
    return None


def _main() -> None:
    import importlib

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # what the imports print goes nowhere; the protocol has its own fd
    for name in PRELOAD:
        importlib.import_module(name)
    request = _serve(proto)
    if request is not None:
        proto.close()
        _exit(_child(request))


def _exit(code: int) -> None:
    """End the child as the interpreter ends a process -- threads joined (and thread
    pools told to stop), ``atexit`` hooks, stdio flushed -- but without tearing down
    torch's and vLLM's modules one by one, which takes about 3.5 s and changes nothing
    a test can see."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _main()
