"""Counters of restore planning, and how its estimates held up (``stats()["restore"]``).

Each plan counts its tokens to load (per tier) and to recompute; each timed restore (a
``get_prefix`` that loaded its whole plan) adds its planned and its actual load seconds,
in all and per tier level (``load_planned_s_tier<i>`` / ``load_actual_s_tier<i>``: what
the plan expected of tier ``i`` and what that tier's reads took), so a wrong estimate of
one tier shows as that tier's gap. :class:`LoadMark` is where a restore's timing starts.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["LoadMark", "PlanCounts", "RestoreStats"]


class PlanCounts(Protocol):
    """What :meth:`RestoreStats.planned` counts of a plan
    (:class:`~kvstore.restore.RestorePlan`)."""

    @property
    def reason(self) -> str:
        """Why the plan loads what it does (``pays``, ``all``, ``off``, ...)."""

    @property
    def first(self) -> int:
        """The first chunk it loads."""

    @property
    def load(self) -> int:
        """The chunk its load ends before."""

    @property
    def skipped(self) -> int:
        """Stored chunks it leaves to recompute."""

    @property
    def tier_chunks(self) -> dict[int, int]:
        """Chunks it loads per tier level."""


@dataclass(frozen=True)
class LoadMark:
    """Where a restore's timing starts: ``time.perf_counter()`` then, and per tier level
    the seconds the calling thread's reads of it had taken by then."""

    start: float
    reads: tuple[float, ...]

    @classmethod
    def now(cls, reads: Sequence[float]) -> LoadMark:
        """A mark taken now, the thread's per-tier read seconds being ``reads``."""
        return cls(time.perf_counter(), tuple(reads))

    def since(self, reads: Sequence[float]) -> tuple[float, dict[int, float]]:
        """Seconds since the mark, and per tier level the seconds of the thread's reads
        since then (``reads``: the per-tier read seconds now; tiers not read: absent)."""
        tiers = {}
        for level, now in enumerate(reads):
            spent = now - (self.reads[level] if level < len(self.reads) else 0.0)
            if spent > 0:
                tiers[level] = spent
        return time.perf_counter() - self.start, tiers


class RestoreStats:
    """Counts of plans and how their estimates held up.

    Locking: ``_lock`` guards every field; callers hold it for a few additions.
    """

    #: Counters shown from the start (others appear when first counted).
    BASE = (
        "plans",
        "tokens_planned_load",
        "tokens_planned_recompute",
        "chunks_warming",
        "lookups_deferred",
        "warming_yields",
        "restores_timed",
        "load_planned_s",
        "load_actual_s",
    )

    def __init__(self, keep: int = 256) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(self.BASE, 0)
        self._errors: deque[float] = deque(maxlen=keep)  # planned / actual - 1

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def planned(self, plan: PlanCounts, chunk_tokens: int) -> None:
        """Count a plan: tokens to load (per tier) and tokens left to recompute."""
        with self._lock:
            c = self._counts
            c["plans"] = c.get("plans", 0) + 1
            c[f"plans_{plan.reason}"] = c.get(f"plans_{plan.reason}", 0) + 1
            loaded = (plan.load - plan.first) * chunk_tokens
            c["tokens_planned_load"] = c.get("tokens_planned_load", 0) + loaded
            skipped = plan.skipped * chunk_tokens
            c["tokens_planned_recompute"] = c.get("tokens_planned_recompute", 0) + skipped
            for level, n in plan.tier_chunks.items():
                name = f"tokens_planned_load_tier{level}"
                c[name] = c.get(name, 0) + n * chunk_tokens

    def loaded(
        self,
        planned_s: float,
        actual_s: float,
        tiers: Mapping[int, tuple[float, float]] | None = None,
    ) -> None:
        """One restore ran: its planned and its actual load seconds, and per tier level
        ``(planned, actual)`` seconds (``tiers``: levels the plan or the reads used)."""
        if planned_s <= 0 or actual_s <= 0:
            return
        with self._lock:
            c = self._counts
            self._errors.append(planned_s / actual_s - 1)
            c["restores_timed"] = c.get("restores_timed", 0) + 1
            c["load_planned_s"] = c.get("load_planned_s", 0) + planned_s
            c["load_actual_s"] = c.get("load_actual_s", 0) + actual_s
            for level, (tier_planned, tier_actual) in sorted((tiers or {}).items()):
                for name, value in (("planned", tier_planned), ("actual", tier_actual)):
                    key = f"load_{name}_s_tier{level}"
                    c[key] = c.get(key, 0) + value

    def snapshot(self) -> dict[str, Any]:
        """Every counter, and the median of planned / actual load time - 1 (recent ones)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["estimate_error_median"] = statistics.median(self._errors) if self._errors else None
        return out
