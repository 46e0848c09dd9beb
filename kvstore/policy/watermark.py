"""High/low watermark arithmetic for one tier (counted in blocks).

Eviction starts when usage would pass the *high* watermark and then frees
down to the *low* one, so a tier hovering near full evicts in batches
instead of one block per put (hysteresis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Watermarks"]


@dataclass(frozen=True)
class Watermarks:
    """Capacity and watermarks of one tier, in blocks."""

    capacity: int
    high: int
    low: int

    @classmethod
    def of(cls, capacity: int, high_fraction: float, low_fraction: float) -> Watermarks:
        """Watermarks from fractions of ``capacity`` (high at least 1 block)."""
        # Fractions of the decimal text, not binary floats: 100 * 0.57 is 57, not 56.
        high = max(1, min(capacity, math.floor(capacity * Fraction(str(high_fraction)))))
        low = max(0, min(high - 1, math.floor(capacity * Fraction(str(low_fraction)))))
        return cls(capacity=capacity, high=high, low=low)

    def plan(self, resident: int, incoming: int) -> tuple[int, int]:
        """``(must, want)``: blocks to evict so ``incoming`` fit.

        ``must`` frees just enough room within capacity; ``want`` also brings
        usage down to the low watermark when it would pass the high one.
        """
        after = resident + incoming
        must = max(0, after - self.capacity)
        want = max(must, after - self.low) if after > self.high else must
        return must, min(want, resident)
