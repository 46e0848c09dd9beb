"""The one retry helper: exponential backoff with full jitter, inside a deadline.

Every remote tier and client retries through :func:`retry_call`, so retry
behaviour is the same everywhere and testable with an injected clock and
sleep. :class:`Breaker` is its companion for outages: once a server is found
down, calls fail fast and one probe per interval looks for it again.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "Breaker", "retry_async", "retry_call"]

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """How to retry: attempt ``n`` (from 0) sleeps up to ``min(cap, base * 2**n)``.

    ``max_attempts`` counts the first try; ``deadline`` (seconds from the
    first try) bounds the whole call: no retry starts if its sleep would end
    past it.
    """

    base: float = 0.05
    cap: float = 2.0
    max_attempts: int = 5
    deadline: float = 30.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full-jitter delay before retry number ``attempt + 1``."""
        ceiling = min(self.cap, self.base * (2**attempt))
        return (rng or random).uniform(0, ceiling)


class _Schedule:
    """One call's retries under ``policy``: after each error, the pause before the next
    try, or None to give up (both drivers below share it, so they cannot drift apart)."""

    def __init__(
        self,
        policy: Backoff,
        retryable: Callable[[BaseException], bool],
        clock: Callable[[], float],
        on_retry: Callable[[int, BaseException], None] | None,
    ) -> None:
        self._policy = policy
        self._retryable = retryable
        self._clock = clock
        self._on_retry = on_retry
        self._start = clock()
        self._attempt = 0

    def pause_after(self, exc: Exception) -> float | None:
        """The sleep before retrying ``exc``; None when it is not retryable, attempts
        ran out, or the retry would end past the deadline."""
        self._attempt += 1
        if not self._retryable(exc) or self._attempt >= self._policy.max_attempts:
            return None
        pause = self._policy.delay(self._attempt - 1)
        if self._clock() + pause - self._start > self._policy.deadline:
            return None
        if self._on_retry is not None:
            self._on_retry(self._attempt, exc)
        return pause


def retry_call(
    fn: Callable[[], T],
    retryable: Callable[[BaseException], bool],
    policy: Backoff = Backoff(),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, retrying errors ``retryable`` accepts.

    Raises the last error when it is not retryable, when attempts run out,
    or when the next retry would end past the deadline.
    """
    schedule = _Schedule(policy, retryable, clock, on_retry)
    while True:
        try:
            return fn()
        except Exception as exc:
            pause = schedule.pause_after(exc)
            if pause is None:
                raise
            sleep(pause)


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    retryable: Callable[[BaseException], bool],
    policy: Backoff = Backoff(),
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """The asyncio form of :func:`retry_call`: the same policy, awaiting between tries."""
    schedule = _Schedule(policy, retryable, time.monotonic, on_retry)
    while True:
        try:
            return await fn()
        except Exception as exc:
            pause = schedule.pause_after(exc)
            if pause is None:
                raise
            await asyncio.sleep(pause)


class Breaker:
    """Circuit breaker: closed while the server answers; after an outage, one probe
    call goes through per ``interval`` seconds and the rest fail fast."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._down = False
        self._next_probe = 0.0

    @property
    def available(self) -> bool:
        """False while the last call found the server unreachable."""
        with self._lock:
            return not self._down

    def allow(self) -> bool:
        """Whether a call may go to the network now."""
        with self._lock:
            if not self._down:
                return True
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + self._interval  # this caller is the probe
            return True

    def succeeded(self) -> bool:
        """Record a success; True if it ended an outage."""
        with self._lock:
            was_down, self._down = self._down, False
            return was_down

    def failed(self) -> bool:
        """Record an outage; True if it started one."""
        with self._lock:
            was_down, self._down = self._down, True
            self._next_probe = time.monotonic() + self._interval
            return not was_down
