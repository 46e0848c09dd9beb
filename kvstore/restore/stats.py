"""Counters of restore planning, and how its estimates held up (``stats()["restore"]``).

Each plan counts its tokens to load (per tier) and to recompute; each timed restore (a
``get_prefix`` that loaded its whole plan, or a load under compute whose wait the engine
reported) adds its planned and its actual load seconds, in all and per tier level
(``load_planned_s_tier<i>`` / ``load_actual_s_tier<i>``), so a wrong estimate of one tier
shows as that tier's gap, and the same per tier :class:`LoadSample` is what corrects
the tier's price. :class:`LoadMark` is where a restore's timing starts;
:class:`PlannedLoad` is what a plan expects of its load, for the process that loads it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["LoadMark", "LoadSample", "PlanCounts", "PlannedLoad", "RestoreStats"]

K = TypeVar("K")


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

    @property
    def tier_load_s(self) -> dict[int, float]:
        """The seconds its load of each tier level is priced at."""

    @property
    def tier_calls(self) -> dict[int, int]:
        """Read calls per tier level."""

    @property
    def load_s(self) -> float:
        """The seconds its whole load is priced at."""

    @property
    def compute_s(self) -> float | None:
        """The prefill after the load (None: unknown)."""

    @property
    def groups(self) -> int:
        """Groups of layers its load runs in under compute (1: before compute)."""

    @property
    def staged_s(self) -> float:
        """Seconds of its load read before the pipeline starts."""


@dataclass(frozen=True)
class LoadSample:
    """A restore's reads of one tier: the seconds they cost the engine, their bytes and
    calls (priced again by the fit as it is after them), and the seconds its plan priced
    them at; what corrects the tier's price (:meth:`ReadSpeed.correct
    <kvstore.restore.speeds.ReadSpeed.correct>`). Samples add up (several loads, workers)."""

    actual_s: float
    nbytes: float
    calls: float
    planned_s: float

    def __add__(self, other: LoadSample) -> LoadSample:
        return LoadSample(
            self.actual_s + other.actual_s,
            self.nbytes + other.nbytes,
            self.calls + other.calls,
            self.planned_s + other.planned_s,
        )


@dataclass(frozen=True)
class PlannedLoad(Generic[K]):
    """What a plan expects of its load: per tier (a level, or a tier id where another
    process loads it) ``(priced seconds, bytes, calls)``, and the pipeline the load runs
    in: all its seconds, the compute after it (None: unknown), its groups of layers (1:
    before compute) and the seconds read before the pipeline starts."""

    tiers: dict[K, tuple[float, float, float]]
    load_s: float
    compute_s: float | None
    groups: int = 1
    staged_s: float = 0.0

    @classmethod
    def of(cls, plan: PlanCounts, chunk_bytes: int) -> PlannedLoad[int]:
        """A plan's load, per tier level."""
        tiers: dict[int, tuple[float, float, float]] = {}
        for level, n in plan.tier_chunks.items():
            calls = plan.tier_calls.get(level, 1)
            tiers[level] = (plan.tier_load_s.get(level, 0.0), n * chunk_bytes, calls)
        return PlannedLoad(tiers, plan.load_s, plan.compute_s, plan.groups, plan.staged_s)

    def named(self: PlannedLoad[int], names: Sequence[str]) -> PlannedLoad[str]:
        """The same load, its tier levels named by ``names`` (tier ids)."""
        tiers = {names[level]: t for level, t in self.tiers.items()}
        return PlannedLoad(tiers, self.load_s, self.compute_s, self.groups, self.staged_s)

    def scale(self, waited_s: float) -> float | None:
        """How many times its priced seconds the load took, judged by the engine's wait:
        the ``x`` at which the plan's model, every read ``x`` times as long, waits
        ``waited_s``: ``staged*x + max(piped*x - compute*(1 - 1/g), piped*x/g)``, read
        from the smaller root of its two rising branches. None without a compute estimate
        or a load."""
        if self.compute_s is None or self.load_s <= 0 or waited_s <= 0:
            return None
        g = max(1, self.groups)
        piped = self.load_s - self.staged_s
        roots = [(waited_s + self.compute_s * (1 - 1 / g)) / self.load_s]
        if self.staged_s + piped / g > 0:
            roots.append(waited_s / (self.staged_s + piped / g))
        return min(roots)

    def samples(self, actual: float | dict[K, float]) -> dict[K, LoadSample]:
        """Per tier, a :class:`LoadSample`: ``actual`` seconds per tier, or one scale of
        the priced seconds for every tier (:meth:`scale`); tiers not read are left out."""
        out = {}
        for tier, (planned, nbytes, calls) in self.tiers.items():
            took = actual.get(tier, 0.0) if isinstance(actual, dict) else actual * planned
            if took > 0:
                out[tier] = LoadSample(took, nbytes, calls, planned)
        return out


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
