"""The engine's prefill speed: what recomputing a span of a prompt costs.

:class:`PrefillSpeed` is a declared table or rate, or one learned from the engine's
steps (:meth:`PrefillSpeed.observe_step`); restore planning weighs it against the tiers'
read speeds (:mod:`kvstore.restore.speeds`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.restore.speeds import SPREAD, DecayedFit

__all__ = ["PrefillEstimate", "PrefillSpeed"]

#: Learned prefill rates need this much (decayed) weight of steps before they count.
_MIN_STEPS = 3.0


@dataclass(frozen=True)
class PrefillEstimate:
    """Where the engine's prefill speed comes from (``table``, ``configured``,
    ``learned``, ``unknown``), its mean tokens a second (None: unknown) and the decayed
    weight of the steps behind a learned one."""

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

    ``table``: ``(prompt tokens, seconds to prefill that prompt)`` points; tokens
    ``[a, b)`` take ``F(b) - F(a)`` on the line through ``(0, 0)`` and the points (past
    the last, its last slope). Else ``tokens_per_s``, a flat rate. Else, with ``learn``,
    a rate fitted to the engine's steps (:meth:`observe_step`); until enough were seen
    :meth:`seconds` is None. Thread-safe (the learned fit takes its own lock).
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
        """Seconds to prefill prompt tokens ``[start, end)`` (None: unknown)."""
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
        xs, ys = self._tokens, self._seconds
        i = min(max(bisect.bisect_right(xs, tokens), 1), len(xs) - 1)
        return ys[i - 1] + (tokens - xs[i - 1]) * (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])

    def _per_token(self) -> float | None:
        if self.tokens_per_s is not None:
            return 1.0 / self.tokens_per_s
        moments = self._steps.moments() if self.learn else None
        if moments is None or moments[0] < _MIN_STEPS:
            return None
        _, mx, my, vxx, vxy, _ = moments
        if vxx > (SPREAD * mx) ** 2 and vxy > 0:
            return vxy / vxx  # the slope: per-step overhead is paid with or without a load
        return my / mx
