"""Session hints carried out on one store: retention, the sessions' keys, the answers.

The public types (:class:`~kvstore.hints.Hint`, :class:`~kvstore.hints.HintAnswer`) live
in :mod:`kvstore.hints`; this module is the data path's side of them. :class:`Retention`
says which blocks eviction takes last (read by ``room.pick_victims`` under the books'
lock); :class:`Hinter` retains, demotes and prefetches through :class:`HinterParts`, and
answers and counts every hint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.hints import Hint, HintAnswer
from kvstore.keys import BlockKey

__all__ = ["HintLimits", "Hinter", "HinterParts", "Retention", "SessionKeys"]


class Retention:
    """Which blocks eviction should take last, until when, and in which order.

    ``priority(key)`` is read by eviction under the books' lock for each candidate;
    it is a dict probe and a clock read, and takes no lock (CPython's dict reads are
    atomic). ``_lock`` guards the writers (``retain``, ``release``, the purge).
    """

    def __init__(self, max_blocks: int, clock: Callable[[], float]) -> None:
        self.max_blocks = max_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._until: dict[BlockKey, tuple[float, int]] = {}  # key -> (deadline, priority)

    def retain(self, keys: Sequence[BlockKey], seconds: float, priority: int) -> int:
        """Retain ``keys`` for ``seconds`` at ``priority`` (a longer or higher retention
        already there stands); how many fit within ``max_blocks`` (the leading ones)."""
        now = self._clock()
        with self._lock:
            self._purge(now)
            granted = 0
            for key in keys:
                old = self._until.get(key)
                if old is None and len(self._until) >= self.max_blocks:
                    break
                deadline = now + seconds
                if old is not None:
                    deadline, priority_kept = max(deadline, old[0]), max(priority, old[1])
                else:
                    priority_kept = priority
                self._until[key] = (deadline, priority_kept)
                granted += 1
            return granted

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Retain ``keys`` no more."""
        with self._lock:
            for key in keys:
                self._until.pop(key, None)

    def priority(self, key: BlockKey) -> int | None:
        """``key``'s retention priority now (None: not retained, or it ran out)."""
        held = self._until.get(key)
        if held is None or held[0] <= self._clock():
            return None
        return held[1]

    def __len__(self) -> int:
        with self._lock:
            self._purge(self._clock())
            return len(self._until)

    def _purge(self, now: float) -> None:
        if len(self._until) >= self.max_blocks // 2:
            for key in [k for k, (t, _) in self._until.items() if t <= now]:
                del self._until[key]


class SessionKeys:
    """The keys of each session's latest hint, so a later hint may name the session
    alone (``hint(session="agent-7", demote=True)``); the least recently hinted
    sessions are forgotten past ``max_sessions``. ``_lock`` guards the table."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._keys: dict[str, list[BlockKey]] = {}

    def remember(self, session: str, keys: Sequence[BlockKey]) -> None:
        """``session``'s keys are now ``keys``."""
        with self._lock:
            self._keys.pop(session, None)
            self._keys[session] = list(keys)
            while len(self._keys) > self.max_sessions:
                del self._keys[next(iter(self._keys))]

    def keys(self, session: str) -> list[BlockKey] | None:
        """The keys of ``session``'s latest hint (None: unknown session)."""
        with self._lock:
            keys = self._keys.get(session)
            return None if keys is None else list(keys)


class HinterParts(Protocol):
    """What a :class:`Hinter` acts through: the data path's façade
    (:class:`~kvstore.datapath.manager.BlockManager`) implements it."""

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` are stored."""

    def warm(self, keys: Sequence[BlockKey]) -> int:
        """Copy ``keys`` into the fastest tier in the background; how many were queued."""

    def demote(self, keys: Sequence[BlockKey]) -> int:
        """Copy ``keys`` down to the first persistent tier and free them in memory."""

    def forward_hint(self, keys: Sequence[BlockKey], hint: Hint) -> int:
        """Pass ``hint`` to tiers outside the process that hold ``keys`` (a kvstore-server)."""


@dataclass(frozen=True)
class HintLimits:
    """The longest retention granted and how many sessions are remembered."""

    max_retain_s: float
    max_sessions: int


class Hinter:
    """Carries out hints on one store and answers them (see the module docstring).

    ``_lock`` guards the counters only; the retention and session tables have their own.
    """

    def __init__(self, parts: HinterParts, retention: Retention, limits: HintLimits) -> None:
        self.parts = parts
        self.retention = retention
        self.limits = limits
        self.sessions = SessionKeys(limits.max_sessions)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(
            ("hints_accepted", "hints_clipped", "hints_rejected"), 0
        )

    def apply(self, keys: Sequence[BlockKey] | None, session: str | None, hint: Hint) -> HintAnswer:
        """Carry out ``hint`` on ``keys`` (None: the keys of ``session``'s last hint)."""
        if keys is None:
            keys = self.sessions.keys(session) if session is not None else None
            if keys is None:
                return self._count(HintAnswer("rejected", f"unknown session {session!r}"))
        elif session is not None:
            self.sessions.remember(session, keys)
        stored = [k for k, ok in zip(keys, self.parts.exists(keys), strict=True) if ok]
        if not stored:
            return self._count(HintAnswer("rejected", "none of the blocks is stored"))
        clipped = []
        if len(stored) < len(keys):
            clipped.append(f"{len(keys) - len(stored)} of {len(keys)} blocks are not stored")
        retain_s = None
        if hint.retain_s == 0:  # the session is over: end its retention now
            self.retention.release(stored)
            retain_s = 0.0
        elif hint.retain_s is not None:
            retain_s = min(float(hint.retain_s), self.limits.max_retain_s)
            if retain_s < hint.retain_s:
                clipped.append(f"retention capped at {self.limits.max_retain_s:g} s")
            granted = self.retention.retain(stored, retain_s, hint.priority)
            if granted < len(stored):
                clipped.append(
                    f"{len(stored) - granted} blocks not retained: the store retains at "
                    f"most {self.retention.max_blocks} blocks"
                )
        prefetching = self.parts.warm(stored) if hint.prefetch else 0
        demoted = self.parts.demote(stored) if hint.demote else 0
        self.parts.forward_hint(stored, hint)
        status = "clipped" if clipped else "accepted"
        answer = HintAnswer(status, "; ".join(clipped), len(stored), retain_s, prefetching, demoted)
        return self._count(answer)

    def _count(self, answer: HintAnswer) -> HintAnswer:
        with self._lock:
            self._counts[f"hints_{answer.status}"] += 1
            if answer.prefetching:
                self._counts["hint_blocks_prefetched"] = (
                    self._counts.get("hint_blocks_prefetched", 0) + answer.prefetching
                )
            if answer.demoted:
                self._counts["hint_blocks_demoted"] = (
                    self._counts.get("hint_blocks_demoted", 0) + answer.demoted
                )
        return answer

    def snapshot(self) -> dict[str, Any]:
        """Counters, and the blocks retained now, as ``stats()`` shows them."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        out["blocks_retained"] = len(self.retention)
        return out
