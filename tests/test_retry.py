"""The backoff helper: retries what is retryable, within attempts and deadline."""

from __future__ import annotations

import random

import pytest

from kvstore.runtime.retry import Backoff, retry_call


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def flaky(failures: int, exc: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise exc
        return "ok"

    return calls, fn


def test_succeeds_after_transient_failures() -> None:
    t = FakeTime()
    calls, fn = flaky(2, TimeoutError("slow"))
    retried: list[int] = []
    result = retry_call(
        fn,
        lambda e: isinstance(e, TimeoutError),
        Backoff(max_attempts=5),
        t.clock,
        t.sleep,
        on_retry=lambda n, e: retried.append(n),
    )
    assert result == "ok" and len(calls) == 3 and retried == [1, 2]
    assert len(t.sleeps) == 2


def test_non_retryable_error_is_raised_at_once() -> None:
    t = FakeTime()
    calls, fn = flaky(5, KeyError("no"))
    with pytest.raises(KeyError):
        retry_call(fn, lambda e: isinstance(e, TimeoutError), Backoff(), t.clock, t.sleep)
    assert len(calls) == 1 and t.sleeps == []


def test_gives_up_after_max_attempts() -> None:
    t = FakeTime()
    calls, fn = flaky(10, TimeoutError("slow"))
    with pytest.raises(TimeoutError):
        retry_call(fn, lambda e: True, Backoff(max_attempts=4, deadline=1e9), t.clock, t.sleep)
    assert len(calls) == 4


def test_deadline_bounds_total_time() -> None:
    t = FakeTime()
    calls, fn = flaky(1000, TimeoutError("slow"))
    policy = Backoff(base=1.0, cap=1.0, max_attempts=1000, deadline=5.0)
    with pytest.raises(TimeoutError):
        retry_call(fn, lambda e: True, policy, t.clock, t.sleep)
    assert t.now <= 5.0
    assert len(calls) >= 2


def test_delay_is_full_jitter_capped() -> None:
    policy = Backoff(base=0.1, cap=0.5)
    rng = random.Random(1)
    delays = [policy.delay(n, rng) for n in range(10) for _ in range(50)]
    assert all(0 <= d <= 0.5 for d in delays)
    assert max(policy.delay(0, rng) for _ in range(200)) <= 0.1


def test_retry_async_follows_the_same_policy() -> None:
    import asyncio

    from kvstore.runtime.retry import retry_async

    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "ok"

    policy = Backoff(base=0.001, cap=0.002, max_attempts=5, deadline=5)
    retried: list[int] = []
    result = asyncio.run(
        retry_async(
            flaky, lambda e: isinstance(e, ConnectionError), policy, lambda n, _: retried.append(n)
        )
    )
    assert result == "ok" and len(calls) == 3 and retried == [1, 2]

    async def broken() -> str:
        raise ValueError("not retryable")

    with pytest.raises(ValueError):
        asyncio.run(retry_async(broken, lambda e: isinstance(e, ConnectionError), policy))
