"""Medians with 90% intervals for bench_peers.py: a percentile bootstrap of the median.

Each figure's interval is the 5th-95th percentile of the median over ``B`` resamples (with
replacement) of its reps; a ratio's is that of ``median(a) / median(b)`` with both sides
resampled independently. The generator is seeded, so a JSON re-rendered from the same reps
gives the same intervals. With one rep an interval is the value itself.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

RESAMPLES = 2000
LEVEL = 0.90


def _percentiles(values: list[float]) -> tuple[float, float]:
    values.sort()
    tail = (1 - LEVEL) / 2
    lo = values[int(tail * (len(values) - 1))]
    hi = values[round((1 - tail) * (len(values) - 1))]
    return lo, hi


def _medians(rng: random.Random, values: Sequence[float]) -> list[float]:
    n = len(values)
    return [statistics.median(rng.choices(values, k=n)) for _ in range(RESAMPLES)]


def summary(values: Sequence[float], seed: int = 1) -> dict[str, Any]:
    """``{"median", "lo", "hi", "n"}`` of ``values`` (positive figures, one per rep)."""
    if not values:
        raise ValueError("no values")
    med = float(statistics.median(values))
    if len(values) == 1:
        return {"median": med, "lo": med, "hi": med, "n": 1}
    lo, hi = _percentiles(_medians(random.Random(seed), values))
    return {"median": med, "lo": float(lo), "hi": float(hi), "n": len(values)}


def ratio_summary(num: Sequence[float], den: Sequence[float], seed: int = 2) -> dict[str, Any]:
    """``{"median", "lo", "hi"}`` of ``median(num) / median(den)``."""
    med = float(statistics.median(num) / statistics.median(den))
    if len(num) == 1 and len(den) == 1:
        return {"median": med, "lo": med, "hi": med}
    rng = random.Random(seed)
    ratios = [a / b for a, b in zip(_medians(rng, num), _medians(rng, den), strict=True)]
    lo, hi = _percentiles(ratios)
    return {"median": med, "lo": float(lo), "hi": float(hi)}
