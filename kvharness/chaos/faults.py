"""The fault driver of a chaos soak (see :mod:`kvharness.chaos.run`).

At seeded random moments (exponential gaps around ``fault_interval_s``) the driver
injects one fault and schedules its end ``fault_s`` later; faults of different kinds
overlap. The first round injects every kind once, in a seeded order, so that even a
short soak sees all of them:

- ``node_kill``: SIGKILL a running node (never the last one); start it again later on
  the same port and disk directory.
- ``redis_restart``: SIGKILL Redis (it saves nothing: the index is gone) and start it
  again later, empty.
- ``s3_error``: the proxy answers the next requests with 500 / 503.
- ``s3_stall``: the proxy leaves the next requests unanswered past the nodes' read
  timeout, then hangs up.
- ``s3_corrupt``: the proxy flips bytes in the bodies of the next object GETs.

:meth:`FaultDriver.heal` ends every fault at once (after the run, or on failure).
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvharness.chaos.cluster import SoakCluster
from kvharness.chaos.config import FAULT_KINDS
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvharness.chaos.config import SoakConfig
    from kvharness.chaos.work import Tally

__all__ = ["FAULT_KINDS", "FaultDriver"]

#: A stalled request waits this long: past the nodes' S3 read timeout (2 s).
_STALL_S = 3.0
_Undo = Callable[[], None]


class FaultDriver:
    """Injects ``config.fault_kinds`` into ``cluster``; counts them in ``tally``."""

    def __init__(self, cluster: SoakCluster, config: SoakConfig, tally: Tally) -> None:
        self.cluster = cluster
        self.config = config
        self.tally = tally
        self.rng = random.Random(f"{config.seed}:faults")
        first = list(config.fault_kinds)
        self.rng.shuffle(first)
        self._first = first
        self._undo: list[tuple[float, int, str, _Undo]] = []  # a heap by due time
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards _undo (heal() may run from another thread)

    def run(self, stop: threading.Event) -> None:
        """Inject faults and end them when due, until ``stop``."""
        next_at = time.monotonic() + self._gap()
        while not stop.wait(0.05):
            self._undo_due(time.monotonic())
            if time.monotonic() >= next_at:
                self._inject(*self._next_kind())
                next_at = time.monotonic() + self._gap()

    def _gap(self) -> float:
        """Seconds to the next fault: exponential around the mean, kept in [0.3, 3] x it."""
        mean = self.config.fault_interval_s
        return min(3 * mean, max(0.3 * mean, self.rng.expovariate(1.0 / mean)))

    def _next_kind(self) -> tuple[str, bool]:
        """The next kind, and whether it belongs to the first round."""
        if self._first:
            return self._first.pop(), True
        kinds, weights = self.config.fault_kinds, self.config.fault_weights
        return self.rng.choices(kinds, weights)[0], False

    def _inject(self, kind: str, first: bool) -> None:
        """Inject one fault of ``kind`` and schedule its end. One that cannot run now
        (every other node down, Redis down already) is skipped; in the first round it
        is tried again later, so that every kind is injected at least once."""
        undo = getattr(self, f"_{kind}")()
        if undo is None:
            self.tally.add(f"skipped_faults.{kind}")
            if first:
                self._first.insert(0, kind)
            return
        self.tally.add(f"faults.{kind}")
        due = time.monotonic() + self.rng.uniform(*self.config.fault_s)
        with self._lock:
            heapq.heappush(self._undo, (due, next(self._seq), kind, undo))

    def _undo_due(self, now: float) -> None:
        """End the faults due by ``now`` (one whose end fails is pushed back, not redone
        in this call)."""
        with self._lock:
            due = []
            while self._undo and self._undo[0][0] <= now:
                due.append(heapq.heappop(self._undo))
        for _, _, kind, undo in due:
            self._end(kind, undo)

    def _end(self, kind: str, undo: _Undo) -> None:
        try:
            undo()
        except KVStoreError as exc:  # a restart failed: try again shortly
            self.tally.add(f"heal_failures.{kind}")
            self.tally.sample("heal_failures", f"{kind}: {exc}"[:300])
            with self._lock:
                heapq.heappush(self._undo, (time.monotonic() + 1.0, next(self._seq), kind, undo))

    def heal(self) -> None:
        """End every fault now (restart what is down, clear the proxy)."""
        for _ in range(5):  # a failed restart is pushed back onto the heap: retry it
            self._undo_due(float("inf"))
            with self._lock:
                if not self._undo:
                    break
            time.sleep(1.0)
        proxy = self.cluster.proxy
        proxy.fail_next(0)
        proxy.stall_next(0, 0.0)
        proxy.corrupt_next(0)

    # -- the faults: each returns how to end it, or None when it cannot run now ----------
    def _node_kill(self) -> _Undo | None:
        running = self.cluster.running()
        if len(running) < 2:
            return None
        proc = self.cluster.procs[self.rng.choice(running)]
        proc.kill()

        def restart() -> None:
            proc.start()  # same port, same disk directory

        return restart

    def _redis_restart(self) -> _Undo | None:
        redis = self.cluster.redis
        if redis is None or not redis.running:
            return None
        redis.kill()

        def start() -> None:
            redis.start()  # same port, empty

        return start

    def _s3_error(self) -> _Undo:
        status, code = self.rng.choice(((503, "SlowDown"), (500, "InternalError")))
        self.cluster.proxy.fail_next(self.rng.randint(5, 60), status, code)
        return lambda: self.cluster.proxy.fail_next(0)

    def _s3_stall(self) -> _Undo:
        self.cluster.proxy.stall_next(self.rng.randint(1, 8), _STALL_S)
        return lambda: self.cluster.proxy.stall_next(0, 0.0)

    def _s3_corrupt(self) -> _Undo:
        self.cluster.proxy.corrupt_next(self.rng.randint(1, 10))
        return lambda: self.cluster.proxy.corrupt_next(0)
