"""Live read speeds of the tiers: what a load from each one costs right now.

Every tier read goes through :class:`~kvstore.tierio.TierIO`, timed, and each
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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ReadSpeed", "SpeedEstimate"]

#: Sizes must spread by this fraction of their mean for the fit to separate latency
#: from bandwidth (below it the two are indistinguishable from noise).
_SPREAD = 0.1


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

    def as_stats(self) -> dict[str, Any]:
        """The figures as ``stats()`` shows them."""
        return {
            "read_gbps_estimate": self.gbps,
            "read_latency_ms_estimate": self.latency_ms,
            "read_speed_source": self.source,
            "read_speed_samples": self.samples,
        }


class ReadSpeed:
    """One tier's read-speed estimate (see the module docstring).

    Locking: ``_lock`` guards the decayed sums; every reader of the tier takes it
    once per call, for a few float operations.
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
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None  # when the last call was observed
        # Decayed sums of weight, x (bytes), y (seconds), x*x and x*y.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, nbytes: float, seconds: float) -> None:
        """One read call: ``nbytes`` read in ``seconds`` (calls that read nothing are not
        observations)."""
        if nbytes <= 0 or seconds <= 0:
            return
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
            self._w += 1.0
            self._x += nbytes
            self._y += seconds
            self._xx += nbytes * nbytes
            self._xy += nbytes * seconds

    def estimate(self) -> SpeedEstimate:
        """The current estimate (the prior until a read was observed)."""
        with self._lock:
            if self._last is None or self._w <= 0:
                return self.prior
            age = max(0.0, self._clock() - self._last)
            weight = self._w
            mx, my = self._x / weight, self._y / weight
            vxx = self._xx / weight - mx * mx
            vxy = self._xy / weight - mx * my
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
