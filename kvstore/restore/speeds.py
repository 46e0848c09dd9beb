"""What restore planning weighs: each tier's read speed, priced by what restores cost,
and the engine's prefill speed.

A tier's :class:`ReadSpeed` fits ``seconds = latency + bytes / bandwidth`` to the plain
wall time of its recent read calls (weights halve every ``half_life_s``; the configured
prior until a read; ``stale`` after ``stale_s`` without one), and prices it at ``k`` times
that fit: after each restore, ``k`` moves halfway (in log space) towards the seconds the
restore's reads of the tier cost the engine over what the fit says now, within
:data:`CORRECTION_BOUNDS` (a probe of a stale tier moves it towards 1:
:meth:`ReadSpeed.probed`). So whatever slows a restore and not the fit's reads (other
processes on the cores, the GIL, a link shared with the engine's own copies) prices the
tier right within a few restores, the same on any machine. The engine's side, its
prefill speed, is :mod:`kvstore.restore.prefill`.

A tier that stores blocks in a lossy encoding (its ``encoding:``,
:mod:`kvstore.format.encodings`) moves fewer bytes than the layout's and decodes them on
the way: its :class:`ReadSpeed` knows both (``stored``: the bytes stored per layout byte,
and the seconds a layout byte takes to decode, measured on this machine when the tier
opens). Callers speak in layout bytes throughout (a chunk, a block, a layer); the fit is
of the medium alone, fed the encoded bytes each read moved and its seconds less the
decoding, and a price is the encoded bytes over the fitted bandwidth plus the decode time
(:meth:`SpeedEstimate.seconds_for`). So a 20 MB/s bucket holding fp8 blocks is priced at
about half the seconds a chunk of it holding plain ones is.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "CORRECTION_BOUNDS",
    "DecayedFit",
    "PROBE_LAYERS",
    "PROBE_READS",
    "SPREAD",
    "ReadSpeed",
    "SpeedEstimate",
    "fastest_reads",
]

#: Sizes must spread by this fraction of their mean for a fit to tell latency from
#: bandwidth (below it the two are indistinguishable from noise).
SPREAD = 0.1
#: A layer-by-layer read takes enough layers a call that the call's latency is at most
#: 1 / (1 + this) of it (a quarter).
_LATENCY_SHARE = 3.0
#: The correction's range: up to 20x (a 2-core host's engine threads made reads 10-50x
#: slower than quiet; slower still is priced out anyway), down to 0.5x (a few lucky
#: restores never price a tier above twice what its reads do).
CORRECTION_BOUNDS = (0.5, 20.0)
#: How far each restore moves ``log k`` towards its own ratio: 3x is priced within 10%
#: after 4 restores; one restore's noise moves the price by its square root.
_CORRECTION_STEP = 0.5
#: A probe that prices a read within this factor of the fit it replaces found the medium
#: as it was (:meth:`ReadSpeed.probed`).
_SAME_MEDIUM = 2.0
#: A probe's reads of each size, and its sizes: one layer and this many (two sizes let
#: the fit tell a call's latency from the bandwidth), then the whole block where those
#: two took about as long (:func:`fastest_reads`' ``until_seen``).
PROBE_READS, PROBE_LAYERS = 3, 4
#: A larger read shows its bytes when it takes this many times the smallest one's time.
#: Below it the call's latency hides the bandwidth: behind a 50 ms link at 200 MB/s a
#: layer (256 KiB) and four took 70 and 76 ms, in either order, and the fit made the
#: link 18 MB/s; at 20 MB/s they took 76 and 112 ms (1.47x: seen, no block read).
_BYTES_SEEN = 1.25
#: Sizes whose spread (standard deviation over mean) is at least this tell a flat line
#: from noise: read times that do not grow across them mean bytes too cheap to see.
_WIDE = 0.5
#: Such bytes are priced as if the mean read's took this share of its time: a price too
#: low is set right by the first restore's reads, one too high by none (no plan reads
#: the tier).
_UNSEEN_SHARE = 0.1
#: The least share of a read's seconds counted as the medium's (the rest may be decoding).
_MEDIUM_SHARE = 0.1


def fastest_reads(
    read: Callable[[int], bool],
    sizes: Sequence[int],
    layer_nbytes: int,
    reads: int = PROBE_READS,
    until_seen: bool = False,
) -> list[tuple[float, float]] | None:
    """``(bytes, fastest wall seconds)`` of ``reads`` calls of ``read(layers)`` for each
    size in layers (noise only adds time); None if a read failed (returned False).
    ``until_seen``: past the second size, the next is read only while none so far took
    :data:`_BYTES_SEEN` times the first size's time (the bytes did not show yet)."""
    samples: list[tuple[float, float]] = []
    for layers in sizes:
        if until_seen and len(samples) >= 2 and samples[-1][1] >= _BYTES_SEEN * samples[0][1]:
            break
        took = []
        for _ in range(reads):
            start = time.perf_counter()
            if not read(layers):
                return None
            took.append(time.perf_counter() - start)
        samples.append((float(layers * layer_nbytes), min(took)))
    return samples


@dataclass(frozen=True)
class SpeedEstimate:
    """A tier's read speed: ``gbps`` (1e9 bytes a second) and ``latency_ms`` a call, as
    priced (the fit times ``correction``); where it comes from (``configured``,
    ``measured``, ``stale``); the decayed weight of the reads behind it; seconds since
    the last one (None: never read)."""

    gbps: float
    latency_ms: float
    source: str
    samples: float
    age_s: float | None
    correction: float = 1.0
    #: Bytes the tier stores per layout byte (below 1 for an encoded tier) ...
    stored_ratio: float = 1.0
    #: ... and the seconds a layout byte takes to decode on the way to the engine.
    decode_s_per_byte: float = 0.0

    def seconds_for(self, nbytes: float, calls: float = 1) -> float:
        """Expected seconds to read ``nbytes`` (layout bytes) in ``calls`` calls: the
        latency, the bytes the tier moves for them over its bandwidth, their decoding."""
        moved = nbytes * self.stored_ratio / (self.gbps * 1e9)
        return calls * self.latency_ms / 1e3 + moved + nbytes * self.decode_s_per_byte

    def layers_per_call(self, layer_bytes: int, num_layers: int, least: int = 1) -> int:
        """Layers a layer-by-layer load reads from this tier a call: enough that the call's
        latency is at most a quarter of it (``least`` at least, the block at most). A
        bucket behind 50 ms that moves a layer in 13 ms is read a block a call; a disk
        or memory a layer a call, so the engine computes layer ``i`` while ``i + 1`` is
        read."""
        per_layer_s = self.seconds_for(layer_bytes, 0)
        if per_layer_s <= 0:
            return max(1, num_layers)
        wanted = math.ceil(_LATENCY_SHARE * self.latency_ms / 1e3 / per_layer_s - 1e-9)
        return max(1, min(num_layers, max(least, wanted)))

    def as_stats(self) -> dict[str, Any]:
        """The figures as ``stats()`` shows them."""
        return {
            "read_gbps_estimate": self.gbps,
            "read_latency_ms_estimate": self.latency_ms,
            "read_speed_source": self.source,
            "read_speed_samples": self.samples,
            "read_correction": self.correction,
        }


class DecayedFit:
    """A least-squares line ``y = intercept + slope * x`` over observations whose weights
    halve every ``half_life_s``. ``_lock`` guards the sums (a few float operations)."""

    def __init__(self, half_life_s: float, clock: Callable[[], float]) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget every observation."""
        with self._lock:
            self._last: float | None = None
            self._sums = [0.0] * 5  # decayed weight, x, y, x*x, x*y

    def observe(self, x: float, y: float, weight: float = 1.0) -> None:
        """One observation (``weight`` of them alike)."""
        with self._lock:
            now = self._clock()
            keep = 1.0
            if self._last is not None:
                keep = 0.5 ** (max(0.0, now - self._last) / self.half_life_s)
            self._last = now
            new = (weight, weight * x, weight * y, weight * x * x, weight * x * y)
            self._sums = [s * keep + n for s, n in zip(self._sums, new, strict=True)]

    def moments(self) -> tuple[float, float, float, float, float, float] | None:
        """``(weight, mean x, mean y, var x, cov xy, age seconds)``; None before any."""
        with self._lock:
            w, x, y, xx, xy = self._sums
            if self._last is None or w <= 0:
                return None
            age = max(0.0, self._clock() - self._last)
        mx, my = x / w, y / w
        return w, mx, my, xx / w - mx * mx, xy / w - mx * my, age


class ReadSpeed:
    """One tier's read speed (see the module docstring). Thread-safe: the fit and the
    correction take their own locks; each thread's read seconds are its own."""

    def __init__(
        self,
        prior_gbps: float,
        prior_latency_ms: float,
        half_life_s: float,
        stale_s: float,
        clock: Callable[[], float],
        stored: tuple[float, float] = (1.0, 0.0),
    ) -> None:
        #: Bytes stored per layout byte, and decode seconds per layout byte (see above).
        self.stored_ratio, self.decode_s_per_byte = stored
        self.prior = SpeedEstimate(
            prior_gbps, prior_latency_ms, "configured", 0.0, None, 1.0, *stored
        )
        self.stale_s = stale_s
        self._clock = clock
        self._born = clock()
        self._fit = DecayedFit(half_life_s, clock)
        self._mine = threading.local()  # .seconds: this thread's read seconds
        self._lock = threading.Lock()  # guards _log_k and _errors
        self._log_k = 0.0
        self._errors: deque[float] = deque(maxlen=64)  # planned / actual - 1, per restore

    def observe(self, nbytes: float, seconds: float, calls: int = 1) -> None:
        """``calls`` read calls of ``nbytes`` in ``seconds`` together (wall time)."""
        if nbytes <= 0 or seconds <= 0 or calls <= 0:
            return
        self._mine.seconds = self.thread_seconds() + seconds
        moved, medium_s = self._medium(nbytes, seconds)
        self._fit.observe(moved / calls, medium_s / calls, float(calls))

    def _medium(self, nbytes: float, seconds: float) -> tuple[float, float]:
        """A read of ``nbytes`` layout bytes in ``seconds`` as the medium saw it: the
        bytes it moved, and the seconds less the decoding (at least a tenth of them: a
        read never counts as free however slow this machine's decoding was measured)."""
        decode_s = nbytes * self.decode_s_per_byte
        return nbytes * self.stored_ratio, max(seconds - decode_s, _MEDIUM_SHARE * seconds)

    def thread_seconds(self) -> float:
        """Seconds of every read observed on the calling thread so far: a restore's own
        reads of the tier, apart from other threads' (warming, probes)."""
        return float(getattr(self._mine, "seconds", 0.0))

    def fitted(self) -> SpeedEstimate:
        """The fit alone (the prior until a read was observed, ``stale`` after
        ``stale_s`` of none: a tier no plan reads is probed on the same timer)."""
        moments = self._fit.moments()
        if moments is None:
            unread = self._clock() - self._born > self.stale_s
            return replace(self.prior, source="stale") if unread else self.prior
        weight, mx, my, vxx, vxy, age = moments
        per_byte = vxy / vxx if vxx > (SPREAD * mx) ** 2 and vxy > 0 else 0.0
        latency = my - per_byte * mx
        if per_byte <= 0 and vxx >= (_WIDE * mx) ** 2:  # sizes far apart, alike in time
            per_byte = _UNSEEN_SHARE * my / mx
            latency = my - per_byte * mx
        elif per_byte <= 0 or latency < 0:  # sizes alike: keep the prior's latency
            latency = min(self.prior.latency_ms / 1e3, my / 2)
            per_byte = (my - latency) / mx
        source = "stale" if age > self.stale_s else "measured"
        return SpeedEstimate(
            1e-9 / per_byte,
            latency * 1e3,
            source,
            weight,
            age,
            1.0,
            self.stored_ratio,
            self.decode_s_per_byte,
        )

    def estimate(self) -> SpeedEstimate:
        """The price: the fit times the correction."""
        with self._lock:
            k = math.exp(self._log_k)
        fit = self.fitted()
        return replace(
            fit,
            gbps=fit.gbps / k,
            latency_ms=fit.latency_ms * k,
            correction=k,
            decode_s_per_byte=fit.decode_s_per_byte * k,  # the cores' contention too
        )

    def correct(self, actual_s: float, nbytes: float, calls: float, planned_s: float) -> None:
        """A restore's reads of the tier (``nbytes`` in ``calls``, priced at ``planned_s``)
        cost it ``actual_s``: move the correction towards that over what the fit prices
        them at now (after the restore's own reads)."""
        fit_s = self.fitted().seconds_for(nbytes, calls)
        if actual_s <= 0 or fit_s <= 0:
            return
        low, high = CORRECTION_BOUNDS
        target = math.log(min(max(actual_s / fit_s, low), high))
        with self._lock:
            self._log_k += _CORRECTION_STEP * (target - self._log_k)
            if planned_s > 0:
                self._errors.append(planned_s / actual_s - 1)

    def probed(self, samples: Sequence[tuple[float, float]]) -> None:
        """A probe's fastest ``(bytes, seconds)``: they join a fresh fit; a stale or
        unread one starts over from them (it described the medium as it was). The
        correction, what restores cost beyond their reads, is kept apart from the medium:
        where the probe prices its largest read within :data:`_SAME_MEDIUM` of the old
        fit, ``k`` moves halfway towards 1 (the probe counts as one restore that cost
        what its reads did: a tier priced out by restores that cost more than their
        reads is not loaded again at once, and is, once a few probes say so); where the
        medium changed, ``k`` starts over from 1."""
        before = self.fitted()
        if before.source != "measured":
            self._fit.reset()
        for nbytes, seconds in samples:
            self._fit.observe(*self._medium(nbytes, seconds))
        if before.source == "measured" or not samples:
            return
        size = max(nbytes for nbytes, _ in samples)
        change = self.fitted().seconds_for(size) / before.seconds_for(size)
        with self._lock:
            same = 1 / _SAME_MEDIUM <= change <= _SAME_MEDIUM
            self._log_k = (1 - _CORRECTION_STEP) * self._log_k if same else 0.0

    def stats(self) -> dict[str, Any]:
        """The price as ``stats()`` shows it, with the median of planned / actual - 1 over
        recent restores (None: none yet)."""
        with self._lock:
            errors = list(self._errors)
        error = statistics.median(errors) if errors else None
        return {**self.estimate().as_stats(), "read_estimate_error": error}
