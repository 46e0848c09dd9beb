"""Held reservations (:mod:`kvstore.server.orphans`): a dropped reservation's slots stay
reserved until its writer is known to be done -- a late COMMIT, its process's exit, or
``reservation_hold_s`` -- and the process test that says a writer has exited."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from kvstore.server.orphans import HeldPuts, ProcessId, process_id


class _Put:
    """A stand-in for a PendingPut: only ever aborted, by whoever holds it last."""

    def __init__(self, name: str) -> None:
        self.name = name

    def abort(self) -> None:
        raise AssertionError("HeldPuts hands puts back; it never aborts them itself")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def held(clock: _Clock, hold_s: float = 10.0) -> HeldPuts:
    return HeldPuts(hold_s, clock)


def test_this_process_is_alive_and_a_reaped_one_is_not() -> None:
    me = process_id(os.getpid())
    assert me is not None and me.alive()
    assert process_id(_dead_pid()) is None
    assert process_id(None) is None and process_id(0) is None and process_id(-5) is None


def test_a_pid_reused_by_a_later_process_is_not_the_writer() -> None:
    me = process_id(os.getpid())
    assert me is not None and me.started is not None
    assert not ProcessId(me.pid, me.started + 1).alive()  # same pid, started later


def test_a_zombie_has_exited() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    writer = process_id(proc.pid)
    assert writer is not None
    deadline = time.monotonic() + 30
    while writer.alive() and time.monotonic() < deadline:  # exits; not reaped: a zombie
        time.sleep(0.02)
    assert not writer.alive()
    proc.wait()


def test_a_late_commit_gives_the_slots_back() -> None:
    clock = _Clock()
    table = held(clock)
    a, b = _Put("a"), _Put("b")
    me = process_id(os.getpid())
    assert table.hold({(1, 7): a, (1, 8): b}, me) == []
    assert len(table) == 2
    assert table.release((1, 7)) is a
    assert table.release((1, 7)) is None  # once
    assert table.release((2, 8)) is None  # another connection's id 8
    assert table.sweep() == [] and len(table) == 1
    assert table.counts["late_commits"] == 1


def test_a_writer_that_exited_needs_no_hold() -> None:
    clock = _Clock()
    table = held(clock)
    gone = ProcessId(_dead_pid(), None)
    put = _Put("a")
    assert table.hold({(1, 1): put}, gone) == [put]  # abort now
    assert len(table) == 0 and table.counts["writer_exited"] == 1


def test_held_until_the_writer_exits_or_the_hold_runs_out() -> None:
    clock = _Clock()
    table = held(clock, hold_s=10.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        writer = process_id(proc.pid)
        unknown: Any = None
        a, b = _Put("a"), _Put("b")
        assert table.hold({(1, 1): a}, writer) == []
        assert table.hold({(2, 1): b}, unknown) == []  # no pid known: the time bound only
        clock.now += 5
        assert table.sweep() == []  # both writers may still write
        proc.kill()
        proc.wait()
        assert table.sweep() == [a]  # its writer exited
        clock.now += 5
        assert table.sweep() == [b]  # held reservation_hold_s
        assert table.counts == {
            "held": 2,
            "late_commits": 0,
            "writer_exited": 1,
            "hold_expired": 1,
        }
    finally:
        proc.kill()
        proc.wait()


def test_release_all_empties_the_table() -> None:
    table = held(_Clock())
    a = _Put("a")
    table.hold({(1, 1): a}, None)
    assert table.release_all() == [a] and len(table) == 0 and table.sweep() == []
