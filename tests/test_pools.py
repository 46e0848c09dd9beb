"""Thread-pool calls made while the interpreter exits run in the caller's thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.runtime.pools import call_or_inline, map_or_inline


def test_the_pool_runs_them_while_the_interpreter_runs() -> None:
    with ThreadPoolExecutor(2) as pool:
        assert map_or_inline(pool, lambda x: x * 2, [1, 2, 3]) == [2, 4, 6]
        assert call_or_inline(pool, lambda: 2 + 3) == 5


def test_a_pool_shut_down_by_its_owner_still_refuses() -> None:
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        map_or_inline(pool, abs, [1, 2])


def test_at_exit_they_run_in_the_callers_thread() -> None:
    script = """
        import atexit, threading
        from concurrent.futures import ThreadPoolExecutor
        from kvstore.runtime.pools import call_or_inline, map_or_inline
        pool = ThreadPoolExecutor(2)
        pool.submit(print, "pool started").result()
        def at_exit():
            where = lambda x: (x, threading.current_thread() is threading.main_thread())
            print(map_or_inline(pool, where, [1, 2]), call_or_inline(pool, lambda: where(3)))
        atexit.register(at_exit)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["pool started", "[(1, True), (2, True)] (3, True)"]


def test_a_pool_its_worker_marked_shut_down_at_exit_runs_them_in_the_callers_thread() -> None:
    """While the exit hook of concurrent.futures joins the workers, a pool whose idle
    worker already left says "after shutdown" to a thread still working (a flush job
    writing to a disk tier): the interpreter exits, so the calls run in that thread."""
    script = """
        import threading, time
        from concurrent.futures import ThreadPoolExecutor
        from kvstore.runtime.pools import call_or_inline, map_or_inline
        idle = ThreadPoolExecutor(1)
        idle.submit(int).result()  # its worker started; it leaves first at exit
        busy = ThreadPoolExecutor(1)
        started = threading.Event()
        def job():
            started.set()
            time.sleep(0.5)  # the interpreter starts exiting meanwhile
            try:
                print(map_or_inline(idle, lambda x: x * 2, [1, 2]), call_or_inline(idle, int))
            except RuntimeError as exc:
                print("refused:", exc)
        busy.submit(job)
        started.wait()
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[2, 4] 0"]
