"""engine_for(): one shared engine, made lazily, thread-safe, usable in a forked child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from kvstore.copies import CopyEngine, Event, ThreadCopyEngine, engine_for
from kvstore.errors import KVStoreError

WAIT = 10.0


def test_host_devices_share_one_thread_engine() -> None:
    engine = engine_for("cpu")
    assert isinstance(engine, ThreadCopyEngine)
    assert engine_for(torch.device("cpu")) is engine
    if not torch.cuda.is_available():  # (with CUDA: test_copies_contract.py)
        assert engine_for("cuda") is engine
        assert engine_for(torch.device("cuda", 1)) is engine
    with pytest.raises(RuntimeError):
        engine_for("no-such-device")


def test_engine_for_is_thread_safe() -> None:
    barrier = threading.Barrier(16)
    got: list[CopyEngine] = []

    def get() -> None:
        barrier.wait(WAIT)
        got.append(engine_for("cpu"))

    threads = [threading.Thread(target=get) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(got) == 16 and all(e is got[0] for e in got)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_nothing_is_made_at_import_and_a_closed_engine_is_replaced() -> None:
    proc = run_python(
        """
        import threading, torch
        import kvstore.copies as copies
        assert not [t for t in threading.enumerate() if t.name.startswith("kvstore-copy")]
        first = copies.engine_for("cpu")
        first.close()
        second = copies.engine_for("cpu")
        assert second is not first and not second.closed
        dst = torch.zeros(4)
        assert second.lane("x").submit([(dst, torch.ones(4))]).wait(10)
        assert torch.equal(dst, torch.ones(4))
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def child_checks(engine: CopyEngine, pending: list[Event], src: torch.Tensor) -> None:
    """What a forked child must be able to do; raises AssertionError if it cannot.

    ``src`` (16 MiB, from the parent) is big enough for torch's parallel (OpenMP)
    copy. GNU OpenMP serves such kernels on threads new in the child (the lane
    workers) but hangs on the thread that forked, until ``torch.set_num_threads(1)``
    (see threads.py): so no big tensor op runs on this thread before that call.
    """
    assert engine_for("cpu") is engine
    for event in pending:  # queued or running in the parent: done here, with an error
        assert event.done() and isinstance(event.error, KVStoreError)
    small_src, small_dst = torch.arange(64.0).view(8, 8), torch.zeros(8, 8)
    engine_for("cpu").copy_all([(small_dst[i], small_src[i]) for i in range(8)])
    assert torch.equal(small_dst, small_src)
    out, again = torch.empty_like(src), torch.empty_like(src)
    lane = engine.lane("fork")
    assert lane.submit([(out[i], src[i]) for i in range(16)]).wait(WAIT)
    assert lane.drain(WAIT)
    assert engine.lane("fork-new").submit([(again, src)]).wait(WAIT)
    torch.set_num_threads(1)  # before the forking thread runs big kernels of its own
    assert torch.equal(out, src) and torch.equal(again, src)
    out.zero_()
    engine_for("cpu").copy_all([(out[i], src[i]) for i in range(16)])
    assert torch.equal(out, src)


def wait_child(pid: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_can_copy() -> None:
    engine = engine_for("cpu")
    lane = engine.lane("fork")
    src = torch.randn(16, 1 << 18)
    warm = torch.zeros(1 << 22)
    assert lane.submit([(warm, torch.ones(1 << 22))]).wait(WAIT)  # the worker is running
    gate = threading.Event()
    busy = lane.submit([], on_done=lambda _: gate.wait(WAIT))  # running at the fork
    queued = lane.submit([(torch.zeros(4), torch.ones(4))])  # queued at the fork
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 1
        try:
            child_checks(engine, [busy, queued], src)
            code = 0
        except BaseException as exc:
            os.write(2, f"child failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    gate.set()
    assert wait_child(pid) == 0
    assert busy.wait(WAIT) and queued.wait(WAIT)  # the parent's own work is untouched
    assert busy.error is None and queued.error is None
