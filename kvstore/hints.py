"""Session hints: what an agent framework knows about its next turn, told to the store.

An agentic session sends many turns whose prompts grow by a tool result each,
with minutes of tool time between them. Its caller knows what the store cannot:
that the session will be back, roughly when, and how much it matters. A
:class:`Hint` says so for a session's blocks (its keys, or a session id that names
the keys of its earlier hints):

- ``retain_s`` / ``priority``: keep the blocks for that long (0: no longer). Eviction in every
  tier -- memory, disk, down to a bucket with a capacity -- takes retained blocks
  only when nothing else is left, lowest priority first (the data path's retention,
  :mod:`kvstore.datapath.hints`); a retention is soft, so a flood of hints never makes a put fail.
- ``demote``: the session went idle: copy its blocks down to the first persistent
  tier and free their room in the memory tiers, in the background (hot blocks, which
  other sessions read too, stay).
- ``prefetch``: its next turn is near: copy its blocks into the fastest tier in
  the background, before the request arrives.

Every hint is answered (:class:`HintAnswer`: ``accepted``, ``clipped`` with what
was cut and why, or ``rejected`` with why) and counted.

This module holds what a caller builds and reads (:class:`Hint`, :class:`HintAnswer`,
:func:`parse_hint`); the data path carries hints out (:mod:`kvstore.datapath.hints`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidInputError

__all__ = ["MAX_PRIORITY", "Hint", "HintAnswer", "checked_hint", "parse_hint"]

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
