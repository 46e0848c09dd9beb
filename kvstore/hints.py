"""Session hints: what an agent framework knows about its next turn, told to the store.

An agentic session sends many turns whose prompts grow by a tool result each,
with minutes of tool time between them. Its caller knows what the store cannot:
that the session will be back, roughly when, and how much it matters. A
:class:`Hint` says so for a session's blocks (its keys, or a session id that names
the keys of its earlier hints):

- ``retain_s`` / ``priority``: keep the blocks for that long (0: no longer). Eviction in every
  tier -- memory, disk, down to a bucket with a capacity -- takes retained blocks
  only when nothing else is left, lowest priority first (:class:`Retention`); a
  retention is soft, so a flood of hints never makes a put fail.
- ``demote``: the session went idle: copy its blocks down to the first persistent
  tier and free their room in the memory tiers, in the background (hot blocks, which
  other sessions read too, stay).
- ``prefetch``: its next turn is near: copy its blocks into the fastest tier in
  the background, before the request arrives.

Every hint is answered (:class:`HintAnswer`: ``accepted``, ``clipped`` with what
was cut and why, or ``rejected`` with why) and counted.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidInputError
from kvstore.keys import BlockKey

__all__ = [
    "MAX_PRIORITY",
    "Hint",
    "HintAnswer",
    "HintLimits",
    "Hinter",
    "HinterParts",
    "Retention",
    "SessionKeys",
    "checked_hint",
    "parse_hint",
]

#: Priorities run from 0 (the default) to this.
MAX_PRIORITY = 100


@dataclass(frozen=True)
class Hint:
    """What a caller says about a session's blocks (see the module docstring)."""

    retain_s: float | None = None
    priority: int = 0
    prefetch: bool = False
    demote: bool = False

    def problem(self) -> str | None:
        """Why the hint is malformed (None: it is not)."""
        if self.retain_s is not None and (
            isinstance(self.retain_s, bool)
            or not isinstance(self.retain_s, (int, float))
            or not math.isfinite(self.retain_s)
            or self.retain_s < 0
        ):
            return f"retain_s must be a number >= 0, got {self.retain_s!r}"
        if type(self.priority) is not int or not 0 <= self.priority <= MAX_PRIORITY:
            return f"priority must be an int from 0 to {MAX_PRIORITY}, got {self.priority!r}"
        if self.prefetch and self.demote:
            return "prefetch and demote contradict each other"
        if not isinstance(self.prefetch, bool) or not isinstance(self.demote, bool):
            return "prefetch and demote must be true or false"
        return None


def checked_hint(has_keys: bool, session: str | None, hint: Hint) -> Hint:
    """``hint`` if it is well formed for keys (``has_keys``) and/or ``session``, else
    :class:`InvalidInputError` saying why."""
    if not has_keys and session is None:
        raise InvalidInputError("hint: give keys, a session, or both")
    if session is not None and (not isinstance(session, str) or not session):
        raise InvalidInputError(f"hint: session must be a non-empty string, got {session!r}")
    problem = hint.problem()
    if problem is not None:
        raise InvalidInputError(f"hint: {problem}")
    return hint


def parse_hint(data: Any) -> tuple[Hint | None, str | None, str | None]:
    """A hint from a plain dict (a request's ``kv_transfer_params``, the server
    protocol): ``(hint, session, None)``, or ``(None, None, why)`` when it is malformed."""
    if not isinstance(data, dict):
        return None, None, f"a hint is a mapping, got {type(data).__name__}"
    known = {"retain_s", "priority", "prefetch", "demote", "session"}
    unknown = sorted(set(data) - known)
    if unknown:
        return None, None, f"unknown hint key {unknown[0]!r}; known: {', '.join(sorted(known))}"
    session = data.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        return None, None, f"session must be a non-empty string, got {session!r}"
    hint = Hint(**{k: v for k, v in data.items() if k != "session"})
    problem = hint.problem()
    return (None, None, problem) if problem else (hint, session, None)


@dataclass(frozen=True)
class HintAnswer:
    """The store's answer: ``status`` (``accepted``, ``clipped``, ``rejected``),
    ``reason`` (why, for the two last), how many stored ``blocks`` it applies to, the
    retention granted (seconds, None: none) and the work it started (blocks queued for
    a prefetch, blocks demoted)."""

    status: str
    reason: str = ""
    blocks: int = 0
    retain_s: float | None = None
    prefetching: int = 0
    demoted: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain values (the server protocol, logs)."""
        return {
            "status": self.status,
            "reason": self.reason,
            "blocks": self.blocks,
            "retain_s": self.retain_s,
            "prefetching": self.prefetching,
            "demoted": self.demoted,
        }


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


@dataclass(frozen=True)
class HinterParts:
    """The narrow view of the data path a :class:`Hinter` acts through."""

    exists: Callable[[Sequence[BlockKey]], list[bool]]
    warm: Callable[[Sequence[BlockKey]], int]
    demote: Callable[[Sequence[BlockKey]], int]
    #: Pass the hint to tiers outside the process that hold the keys (a kvstore-server).
    forward: Callable[[Sequence[BlockKey], Hint], int] = lambda keys, hint: 0


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
        self.parts.forward(stored, hint)
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
