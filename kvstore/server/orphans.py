"""Reservations whose writer may still be writing: their slots stay reserved.

A RESERVE lends a client slots of the server's shared memory to write blocks into;
its COMMIT says the copies ended. A reservation dropped before its COMMIT (not
committed within ``io_timeout_s``, or its connection ended) does not say that: a
client thread frozen mid-copy (a stopped process, a machine swapping) writes on when
it wakes. Given back at once, its slots would go to other blocks and that late write
would change their bytes after their checksums were taken: wrong KV served as a hit.

So a dropped reservation is *held*, its slots still reserved, until its writer is
known to be done:

- a late COMMIT of it arrives on its connection (a client sends COMMIT after its
  copies; the COMMIT is refused, the put fails, and the slots go back);
- its client process has exited (its pid, from the Unix socket's peer credentials or
  as the client stated it in OPEN, is gone or another process by now);
- ``server.orphan_hold_s`` has passed since it was dropped (a bound on what a live
  client that lost its connection can hold; a writer frozen longer than that is the
  remaining, stated window).

Lock ownership: none. :class:`HeldPuts` is touched on the server's event loop only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.datapath.contracts import PendingPut

__all__ = ["HeldPuts", "ProcessId", "process_id"]


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from a later one with the same pid by its start time."""

    pid: int
    #: Clock ticks after boot when it started (``/proc/<pid>/stat`` field 22); None
    #: where ``/proc`` cannot say (the pid alone is then compared).
    started: int | None

    def alive(self) -> bool:
        """Whether this very process still runs (a zombie does not)."""
        now = _stat(self.pid)
        if now is None:
            return _signal_alive(self.pid) if self.started is None else False
        state, started = now
        if state in ("Z", "X"):
            return False
        return self.started is None or started == self.started


def process_id(pid: int | None) -> ProcessId | None:
    """The process ``pid`` names now (None: no pid, or no such process)."""
    if pid is None or pid <= 0:
        return None
    now = _stat(pid)
    if now is None:
        return ProcessId(pid, None) if _signal_alive(pid) else None
    return ProcessId(pid, now[1])


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) from ``/proc/<pid>/stat``; None if it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _signal_alive(pid: int) -> bool:
    """``kill(pid, 0)``: the process exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@dataclass
class _Held:
    pending: PendingPut
    writer: ProcessId | None
    since: float


class HeldPuts:
    """Dropped reservations, held until their writer is known to be done (see the
    module's docstring), each under a tag its connection can name it by again (a late
    COMMIT). ``clock``: the event loop's time."""

    def __init__(self, hold_s: float, clock: Callable[[], float]) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._held: dict[Hashable, _Held] = {}
        #: Reservations held so far; given back on a late COMMIT, at their writer's
        #: exit, or when the hold ran out.
        self.counts = {"held": 0, "late_commits": 0, "writer_exited": 0, "hold_expired": 0}

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self, pendings: Mapping[Hashable, PendingPut], writer: ProcessId | None
    ) -> list[PendingPut]:
        """Hold ``pendings`` (by tag) for ``writer``; those that need no hold (their
        writer has exited), to abort now."""
        if writer is not None and not writer.alive():
            self.counts["writer_exited"] += len(pendings)
            return list(pendings.values())
        now = self._clock()
        for tag, pending in pendings.items():
            self._held[tag] = _Held(pending, writer, now)
        self.counts["held"] += len(pendings)
        return []

    def release(self, tag: Hashable) -> PendingPut | None:
        """The held put ``tag`` names, no longer held (its writer's COMMIT came: the
        copies ended); None if it is not held."""
        held = self._held.pop(tag, None)
        if held is None:
            return None
        self.counts["late_commits"] += 1
        return held.pending

    def sweep(self) -> list[PendingPut]:
        """Remove and return the held puts whose writer exited or whose hold ran out."""
        now, done = self._clock(), []
        alive: dict[ProcessId, bool] = {}
        for tag, held in list(self._held.items()):
            writer = held.writer
            if writer is not None and not alive.setdefault(writer, writer.alive()):
                self.counts["writer_exited"] += 1
            elif now - held.since >= self.hold_s:
                self.counts["hold_expired"] += 1
            else:
                continue
            del self._held[tag]
            done.append(held.pending)
        return done

    def release_all(self) -> list[PendingPut]:
        """Every held put (the server is closing: no slot is handed out again)."""
        done = [h.pending for h in self._held.values()]
        self._held = {}
        return done
