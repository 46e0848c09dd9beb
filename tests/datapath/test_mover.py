"""The background mover: runs jobs, dedupes by key, drains, survives failing jobs."""

from __future__ import annotations

import threading
import time

from kvstore.datapath.mover import Mover


def test_jobs_run_and_drain_waits_for_them() -> None:
    mover = Mover(2)
    done: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            done.append(i)

    for i in range(20):
        assert mover.submit(lambda i=i: job(i))
    assert mover.drain(timeout=10)
    assert sorted(done) == list(range(20)) and mover.pending == 0
    mover.close()


def test_a_key_runs_once_at_a_time() -> None:
    mover = Mover(1)
    gate = threading.Event()
    runs: list[str] = []
    assert mover.submit(lambda: (gate.wait(5), runs.append("a")), key="k")
    assert not mover.submit(lambda: runs.append("b"), key="k")  # still queued: dropped
    gate.set()
    mover.drain(timeout=10)
    assert mover.submit(lambda: runs.append("c"), key="k")  # finished: accepted again
    mover.drain(timeout=10)
    assert runs == ["a", "c"]
    mover.close()


def test_a_failing_job_is_counted_not_raised() -> None:
    mover = Mover(1)
    mover.submit(lambda: 1 / 0)
    mover.drain(timeout=10)
    assert mover.failures == 1
    mover.close()
    assert not mover.submit(lambda: None)  # closed: no new jobs
    mover.close()  # idempotent


def test_a_job_waits_for_its_time_asked_again_when_it_comes() -> None:
    mover = Mover(1)
    began = time.monotonic()
    times = iter([began + 0.05, began + 0.2])  # the first answer moved later meanwhile
    asked: list[float] = []

    def not_before() -> float:
        asked.append(next(times, began + 0.2))
        return asked[-1]

    ran = threading.Event()
    started: list[float] = []
    assert mover.submit_later(lambda: (started.append(time.monotonic()), ran.set()), not_before)
    assert mover.pending == 1
    assert ran.wait(10)
    assert started[0] >= began + 0.2 and len(asked) >= 2
    assert mover.drain(10) and mover.pending == 0
    mover.close()


def test_drain_starts_waiting_jobs_at_once_and_keys_dedupe_them() -> None:
    mover = Mover(1)
    runs: list[str] = []
    far = time.monotonic() + 3600
    assert mover.submit_later(lambda: runs.append("a"), lambda: far, key="k")
    assert not mover.submit_later(lambda: runs.append("b"), lambda: far, key="k")
    assert not mover.submit(lambda: runs.append("c"), key="k")
    assert runs == []
    assert mover.drain(timeout=10)  # a flush does not wait an hour
    assert runs == ["a"]
    mover.close()
    assert not mover.submit_later(lambda: runs.append("d"), lambda: 0.0)


def test_a_job_queued_to_wait_while_a_drain_runs_starts_at_once() -> None:
    """A waiting job that queues its own rest to wait again (a warming that yields) must
    not hold a drain for its time: the drain waits for it, so it runs now."""
    mover = Mover(1)
    runs: list[str] = []
    far = time.monotonic() + 3600

    def first() -> None:
        runs.append("first")
        mover.submit_later(lambda: runs.append("rest"), lambda: far)

    assert mover.submit_later(first, lambda: far)
    assert mover.drain(timeout=10)
    assert runs == ["first", "rest"] and mover.pending == 0
    assert mover.submit_later(lambda: runs.append("later"), lambda: far)  # waits again
    assert runs == ["first", "rest"] and mover.pending == 1
    mover.close()
    assert runs[-1] == "later"
