"""Live read speeds of the tiers: what a load from each one costs right now.

Every tier read goes through :class:`~kvstore.datapath.tierio.TierIO`, timed, and each
call is one observation ``(bytes read, seconds)`` of its tier's
:class:`ReadSpeed`. The estimate is a least-squares fit of

    seconds = latency + bytes / bandwidth

over recent calls, each weighted by how recent it is (weights halve every
``half_life_s``), so a medium that slows down -- a disk under other load, a
throttled bucket, a peer behind a congested link -- shows within a few half-lives
and one that recovers shows as fast. Calls of one size cannot tell latency from
bandwidth; then the configured latency stands (at most half the mean call) and
the bandwidth is what is left. Before a tier is read the estimate is its
configured prior (``read_gbps`` / ``read_latency_ms`` of the tier's config); a
measured estimate with no read for ``stale_s`` is reported as ``stale`` (still
the last figures: whoever plans with it may want to probe first).

The engine's side of the same question -- what recomputing tokens costs -- is
:class:`PrefillSpeed`: a declared table of prefill times by prompt length
(attention grows faster than linearly), a declared rate, or a rate learned from
the engine's own step times.

A read's seconds are its wall time less the time its threads waited to run
(:func:`runqueue_wait_s`; :class:`RunShare` for reads a tier spreads over a pool of
threads): a reader starved of CPU by other work in its process (an engine's OpenMP
threads spinning on every core) would otherwise make the medium look ten times slower
than it reads, and a planner recompute what loads faster.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "DecayedFit",
    "PrefillEstimate",
    "PrefillSpeed",
    "ReadSpeed",
    "RunShare",
    "RunTime",
    "SpeedEstimate",
    "runqueue_wait_s",
    "timed_work",
]

T = TypeVar("T")
R = TypeVar("R")

#: Sizes must spread by this fraction of their mean for the fit to separate latency
#: from bandwidth (below it the two are indistinguishable from noise).
_SPREAD = 0.1

#: A layer-by-layer read takes enough layers a call that the call's latency is at most
#: 1 / (1 + this) of it (a quarter).
_LATENCY_SHARE = 3.0


class _SchedFd:
    """An open ``/proc/thread-self/schedstat``, closed when dropped."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        os.close(self.fd)


class _SchedStat(threading.local):
    """This thread's :class:`_SchedFd`, opened on first use (None where the kernel has
    none). A thread-local's values are dropped as the thread ends, so the fd closes then:
    a finalizer on the ``Thread`` object would wait for the garbage collector wherever a
    cycle holds a stopped pool's threads, and a store that restarts its pools would
    collect open fds meanwhile."""

    def __init__(self) -> None:
        try:
            self.file: _SchedFd | None = _SchedFd()
        except OSError:
            self.file = None


_schedstat = _SchedStat()


def runqueue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but not running, so far (its
    scheduler's run-queue wait; 0.0 where the kernel does not say): the difference over
    a read is time the read did not spend reading."""
    file = _schedstat.file
    if file is None:
        return 0.0
    try:
        fields = os.pread(file.fd, 64, 0).split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class RunTime:
    """What :meth:`RunShare.timed` measured: a call's wall seconds, and the seconds of
    them its work could run (set as the timed block ends)."""

    wall_s: float = 0.0
    running_s: float = 0.0


class RunShare:
    """How much of a timed call's work ran and how much waited to run, over the threads
    that did it (:func:`timed_work` adds each task of a pool; thread-safe). A share
    opened inside another passes its tasks on to the outer one too, so that a caller
    timing several tier reads sees their pools' waits."""

    _current: contextvars.ContextVar[RunShare | None] = contextvars.ContextVar(
        "kvstore_run_share", default=None
    )

    def __init__(self, outer: RunShare | None = None) -> None:
        self._lock = threading.Lock()
        self._outer = outer
        self.wall_s = 0.0
        self.waited_s = 0.0

    def add(self, wall_s: float, waited_s: float) -> None:
        """One task: its wall time, and the part of it its thread waited to run."""
        with self._lock:
            self.wall_s += wall_s
            self.waited_s += min(waited_s, wall_s)
        if self._outer is not None:
            self._outer.add(wall_s, waited_s)

    def running(self, elapsed_s: float, own_wait_s: float) -> float:
        """The seconds of a call of ``elapsed_s`` (the caller waited ``own_wait_s`` to
        run) that its work could run: scaled by the share of its pool tasks' time that
        ran, where pool tasks did it, else less the caller's own wait."""
        with self._lock:
            wall, waited = self.wall_s, self.waited_s
        # The caller's own wait is the time it was runnable and not running: once the
        # tasks ended (waking to take their results), or doing the work itself. While
        # the tasks run it sleeps, so that wait never overlaps theirs.
        span = max(elapsed_s - own_wait_s, 0.0)
        if wall > 0:
            span *= 1.0 - waited / wall
        return max(span, 1e-9)

    @classmethod
    @contextlib.contextmanager
    def timing(cls) -> Iterator[RunShare]:
        """A share that the pool tasks this context submits (:func:`timed_work`) feed."""
        share = cls(cls._current.get())
        token = cls._current.set(share)
        try:
            yield share
        finally:
            cls._current.reset(token)

    @classmethod
    @contextlib.contextmanager
    def timed(cls) -> Iterator[RunTime]:
        """Time the block: its wall seconds, and those its work could run (see
        :meth:`running`): a read's speed sample, whether or not a pool did the read."""
        result = RunTime()
        with cls.timing() as share:
            start, waited = time.perf_counter(), runqueue_wait_s()
            try:
                yield result
            finally:
                result.wall_s = time.perf_counter() - start
                result.running_s = share.running(result.wall_s, runqueue_wait_s() - waited)

    @classmethod
    def current(cls) -> RunShare | None:
        """The share this context's pool tasks feed (None: untimed)."""
        return cls._current.get()


def timed_work(fn: Callable[[T], R]) -> Callable[[T], R]:
    """``fn`` as a pool task that adds its wall time and its thread's run-queue wait to
    the :class:`RunShare` of the context submitting it (``fn`` itself where none)."""
    share = RunShare.current()
    if share is None:
        return fn

    def task(item: T) -> R:
        waited, start = runqueue_wait_s(), time.perf_counter()
        try:
            return fn(item)
        finally:
            share.add(time.perf_counter() - start, runqueue_wait_s() - waited)

    return task


@dataclass(frozen=True)
class SpeedEstimate:
    """A tier's read speed: ``gbps`` (1e9 bytes a second), ``latency_ms`` a call, where it
    comes from (``configured``, ``measured``, ``stale``), the decayed weight of the reads
    behind it, and seconds since the last read (None: never read)."""

    gbps: float
    latency_ms: float
    source: str
    samples: float
    age_s: float | None

    def seconds_for(self, nbytes: float, calls: int = 1) -> float:
        """Expected seconds to read ``nbytes`` in ``calls`` calls."""
        return calls * self.latency_ms / 1e3 + nbytes / (self.gbps * 1e9)

    def layers_per_call(self, layer_bytes: int, num_layers: int, least: int = 1) -> int:
        """Layers of a block that a layer-by-layer load reads from this tier in one call:
        enough that the call's latency is at most a quarter of it (``least`` at least,
        the whole block at most). A bucket behind 50 ms of latency that moves a layer in
        13 ms is read a whole block a call: twelve calls a block would cost 0.6 s of
        latency alone. A local disk or memory moves a layer a call, so that the engine
        computes layer ``i`` while ``i + 1`` is read."""
        per_layer_s = layer_bytes / (self.gbps * 1e9)
        latency_s = self.latency_ms / 1e3
        if per_layer_s <= 0:
            return max(1, num_layers)
        wanted = math.ceil(_LATENCY_SHARE * latency_s / per_layer_s - 1e-9)  # 3.0000001 is 3
        return max(1, min(num_layers, max(least, wanted)))

    def as_stats(self) -> dict[str, Any]:
        """The figures as ``stats()`` shows them."""
        return {
            "read_gbps_estimate": self.gbps,
            "read_latency_ms_estimate": self.latency_ms,
            "read_speed_source": self.source,
            "read_speed_samples": self.samples,
        }


class DecayedFit:
    """A least-squares line ``y = intercept + slope * x`` over observations whose weights
    halve every ``half_life_s`` (the fit behind :class:`ReadSpeed` and
    :class:`PrefillSpeed`).

    Locking: ``_lock`` guards the decayed sums; each observer takes it once per call,
    for a few float operations.
    """

    def __init__(self, half_life_s: float, clock: Callable[[], float]) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None  # when the last observation came
        # Decayed sums of weight, x, y, x*x and x*y.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, x: float, y: float, weight: float = 1.0) -> None:
        """One observation (``weight`` of them alike)."""
        with self._lock:
            now = self._clock()
            if self._last is not None:
                keep = 0.5 ** (max(0.0, now - self._last) / self.half_life_s)
                self._w *= keep
                self._x *= keep
                self._y *= keep
                self._xx *= keep
                self._xy *= keep
            self._last = now
            self._w += weight
            self._x += weight * x
            self._y += weight * y
            self._xx += weight * x * x
            self._xy += weight * x * y

    def moments(self) -> tuple[float, float, float, float, float, float] | None:
        """``(weight, mean x, mean y, var x, cov xy, age seconds)``; None before any
        observation."""
        with self._lock:
            if self._last is None or self._w <= 0:
                return None
            weight = self._w
            mx, my = self._x / weight, self._y / weight
            vxx = self._xx / weight - mx * mx
            vxy = self._xy / weight - mx * my
            age = max(0.0, self._clock() - self._last)
        return weight, mx, my, vxx, vxy, age


class ReadSpeed:
    """One tier's read-speed estimate (see the module docstring).

    Thread-safe: the fit takes its own lock; each thread's own read seconds
    (:meth:`thread_seconds`) are kept apart, in a thread-local.
    """

    def __init__(
        self,
        prior_gbps: float,
        prior_latency_ms: float,
        half_life_s: float,
        stale_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.prior = SpeedEstimate(prior_gbps, prior_latency_ms, "configured", 0.0, None)
        self.half_life_s = half_life_s
        self.stale_s = stale_s
        self._fit_line = DecayedFit(half_life_s, clock)
        self._mine = threading.local()  # .seconds: this thread's observed read seconds

    def observe(self, nbytes: float, seconds: float, calls: int = 1) -> None:
        """Read calls: ``calls`` of them, ``nbytes`` in ``seconds`` together (calls that
        read nothing are not observations)."""
        if nbytes <= 0 or seconds <= 0 or calls <= 0:
            return
        self._mine.seconds = getattr(self._mine, "seconds", 0.0) + seconds
        self._fit_line.observe(nbytes / calls, seconds / calls, float(calls))

    def thread_seconds(self) -> float:
        """Seconds of every read observed so far on the calling thread: what a restore's
        own reads of this tier took, apart from other threads' (warming, probes)."""
        return float(getattr(self._mine, "seconds", 0.0))

    def estimate(self) -> SpeedEstimate:
        """The current estimate (the prior until a read was observed)."""
        moments = self._fit_line.moments()
        if moments is None:
            return self.prior
        weight, mx, my, vxx, vxy, age = moments
        latency_s, per_byte = self._fit(mx, my, vxx, vxy)
        source = "stale" if age > self.stale_s else "measured"
        return SpeedEstimate(1.0 / per_byte / 1e9, latency_s * 1e3, source, weight, age)

    def _fit(self, mx: float, my: float, vxx: float, vxy: float) -> tuple[float, float]:
        """``(latency seconds, seconds per byte)`` from the weighted moments."""
        if vxx > (_SPREAD * mx) ** 2 and vxy > 0:
            per_byte = vxy / vxx
            latency = my - per_byte * mx
            if latency >= 0:
                return latency, per_byte
        latency = min(self.prior.latency_ms / 1e3, my / 2)  # sizes alike: keep the prior's
        return latency, (my - latency) / mx


#: Learned prefill rates need this much (decayed) weight of steps before they count.
_MIN_STEPS = 3.0


@dataclass(frozen=True)
class PrefillEstimate:
    """Where the engine's prefill speed comes from (``table``, ``configured``,
    ``learned``, ``unknown``), its mean rate in tokens a second (None: unknown) and the
    decayed weight of the steps behind a learned one."""

    source: str
    tokens_per_s: float | None
    samples: float = 0.0

    def as_stats(self) -> dict[str, Any]:
        """The figures as ``stats()`` shows them."""
        return {
            "prefill_source": self.source,
            "prefill_tokens_per_s": self.tokens_per_s,
            "prefill_samples": self.samples,
        }


class PrefillSpeed:
    """Seconds the engine takes to prefill a span of a prompt.

    ``table``: ``(prompt tokens, seconds to prefill that whole prompt)`` points; the
    time of tokens ``[a, b)`` is ``F(b) - F(a)`` on the line through ``(0, 0)`` and
    the points (past the last one, its last segment's slope). Else ``tokens_per_s``,
    a flat rate. Else, with ``learn``, a rate fitted to the engine's steps
    (:meth:`observe_step`: tokens scheduled, seconds taken) over recent ones; until
    enough were seen the speed is unknown and :meth:`seconds` is None.

    Thread-safe: the learned fit takes its own lock; the rest is read-only.
    """

    def __init__(
        self,
        table: Sequence[tuple[int, float]] | None,
        tokens_per_s: float | None,
        learn: bool,
        half_life_s: float,
        clock: Callable[[], float],
    ) -> None:
        points = sorted((int(t), float(s)) for t, s in table or ())
        self._tokens = [0] + [t for t, _ in points]
        self._seconds = [0.0] + [s for _, s in points]
        self.tokens_per_s = tokens_per_s
        self.learn = learn
        self._steps = DecayedFit(half_life_s, clock)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One engine step: ``tokens`` computed in ``seconds`` (used when learning)."""
        if self.learn and tokens > 0 and seconds > 0:
            self._steps.observe(float(tokens), seconds)

    def seconds(self, start: int, end: int) -> float | None:
        """Seconds to prefill prompt tokens ``[start, end)`` (None: the speed is unknown)."""
        if end <= start:
            return 0.0
        if len(self._tokens) > 1:
            return self._curve(end) - self._curve(start)
        per_token = self._per_token()
        return None if per_token is None else (end - start) * per_token

    def estimate(self) -> PrefillEstimate:
        """The speed behind :meth:`seconds`, as ``stats()`` shows it."""
        if len(self._tokens) > 1:
            return PrefillEstimate("table", self._tokens[-1] / self._seconds[-1])
        if self.tokens_per_s is not None:
            return PrefillEstimate("configured", self.tokens_per_s)
        per_token = self._per_token()
        moments = self._steps.moments()
        samples = moments[0] if moments is not None else 0.0
        if per_token is None:
            return PrefillEstimate("unknown", None, samples)
        return PrefillEstimate("learned", 1.0 / per_token, samples)

    def _curve(self, tokens: int) -> float:
        """Seconds to prefill a whole prompt of ``tokens`` (piecewise linear)."""
        xs, ys = self._tokens, self._seconds
        i = min(max(bisect.bisect_right(xs, tokens), 1), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + (tokens - xs[i - 1]) * slope

    def _per_token(self) -> float | None:
        """Seconds a token: declared, else learned (None: neither)."""
        if self.tokens_per_s is not None:
            return 1.0 / self.tokens_per_s
        moments = self._steps.moments() if self.learn else None
        if moments is None or moments[0] < _MIN_STEPS:
            return None
        _, mx, my, vxx, vxy, _ = moments
        if vxx > (_SPREAD * mx) ** 2 and vxy > 0:
            return vxy / vxx  # the slope: per-step overhead is paid with or without a load
        return my / mx
