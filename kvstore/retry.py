"""The one retry helper: exponential backoff with full jitter, inside a deadline.

Every remote tier retries through :func:`retry_call`, so retry behaviour is
the same everywhere and testable with an injected clock and sleep.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "retry_call"]

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
    start = clock()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            attempt += 1
            if not retryable(exc) or attempt >= policy.max_attempts:
                raise
            pause = policy.delay(attempt - 1)
            if clock() + pause - start > policy.deadline:
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(pause)
