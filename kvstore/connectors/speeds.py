"""What the vLLM scheduler side learns about speeds, though it never moves a byte.

A restore plan weighs tier read speeds against the engine's prefill speed, and
both are measured where the scheduler is not: tiers are read by the workers
(other processes), and the forward pass runs there too. So:

- each worker ships the tier reads it made since its last report as counters
  in its ``KVConnectorStats`` (:class:`ReadDeltas`, under :data:`READS_PREFIX`),
  which vLLM hands the scheduler side every step; :class:`EngineSpeeds` feeds
  them to the scheduler's store (``store.engine.observe_reads``, matched by tier kind);
- and what its planned loads cost the engine per tier (the engine's wait, against
  the plan's model: :data:`LOADS_PREFIX`), which corrects the tiers' prices in the
  scheduler's store (``store.engine.observe_loads``);
- the scheduler times each step from ``build_connector_meta`` to the
  ``update_connector_output`` of its result, with the tokens it scheduled, and
  feeds steps that loaded nothing to ``store.engine.note_prefill_step`` (used when the config
  declares no prefill speed). Under asynchronous scheduling, where steps overlap,
  the pairing is ambiguous and no step is learned from: declare the speed then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvstore.restore import LoadSample
from kvstore.store import KVStore

__all__ = [
    "LOADS_PREFIX",
    "READS_PREFIX",
    "EngineSpeeds",
    "ReadDeltas",
    "loads_as_counters",
    "loads_from",
    "reads_from",
]

#: Counter names ``tier_reads/<tier id>/<bytes|seconds|calls>``.
READS_PREFIX = "tier_reads/"
_FIELDS = ("bytes", "seconds", "calls")
#: Counter names ``tier_loads/<tier id>/<field of LoadSample>``.
LOADS_PREFIX = "tier_loads/"
_LOAD_FIELDS = ("actual_s", "nbytes", "calls", "planned_s")


def loads_as_counters(loads: Mapping[str, LoadSample]) -> dict[str, float]:
    """``{tier_loads/<tier>/<field>: value}`` of per-tier load samples."""
    return {
        f"{LOADS_PREFIX}{tier}/{name}": float(getattr(load, name))
        for tier, load in loads.items()
        for name in _LOAD_FIELDS
    }


def loads_from(data: Mapping[str, Any]) -> dict[str, LoadSample]:
    """The load samples in a stats dict (summed over workers): ``{tier id: LoadSample}``."""
    parts: dict[str, dict[str, float]] = {}
    for name, value in data.items():
        if name.startswith(LOADS_PREFIX) and isinstance(value, (int, float)):
            tier, _, field = name[len(LOADS_PREFIX) :].rpartition("/")
            if field in _LOAD_FIELDS and tier:
                parts.setdefault(tier, {})[field] = float(value)
    return {
        tier: LoadSample(*(p.get(name, 0.0) for name in _LOAD_FIELDS))
        for tier, p in parts.items()
        if p.get("actual_s", 0.0) > 0
    }


class ReadDeltas:
    """A worker's tier reads since the last :meth:`take`, as counters."""

    def __init__(self, store: KVStore) -> None:
        self._store = store
        self._last: dict[str, tuple[float, float, int]] = {}

    def take(self) -> dict[str, float]:
        """``{tier_reads/<tier>/<field>: amount}`` for tiers read since the last call."""
        totals = self._store.engine.read_totals()
        out: dict[str, float] = {}
        for tier, now in totals.items():
            last = self._last.get(tier, (0.0, 0.0, 0))
            if now[2] > last[2]:
                for name, a, b in zip(_FIELDS, now, last, strict=True):
                    out[f"{READS_PREFIX}{tier}/{name}"] = a - b
        self._last = totals
        return out


def reads_from(data: Mapping[str, Any]) -> dict[str, tuple[float, float, int]]:
    """The tier reads in a stats dict: ``{tier id: (bytes, seconds, calls)}``."""
    parts: dict[str, dict[str, float]] = {}
    for name, value in data.items():
        if name.startswith(READS_PREFIX):
            tier, _, field = name[len(READS_PREFIX) :].rpartition("/")
            if field in _FIELDS and tier:
                parts.setdefault(tier, {})[field] = float(value)
    return {
        tier: (p.get("bytes", 0.0), p.get("seconds", 0.0), int(p.get("calls", 0)))
        for tier, p in parts.items()
        if p.get("calls", 0) > 0
    }


class EngineSpeeds:
    """Feeds the scheduler's lookup store with step times and the workers' reads (see
    the module docstring). Called from vLLM's scheduler thread only."""

    def __init__(
        self, store: KVStore | None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._store = store
        self._clock = clock
        self._open: deque[tuple[float, int]] = deque()  # steps built, not yet ended

    def step_started(self, tokens: int, loads: bool) -> None:
        """A step of ``tokens`` was planned; ``loads``: it loads KV (not a prefill sample)."""
        if self._store is None or tokens <= 0:
            return
        self._open.append((self._clock(), 0 if loads else tokens))

    def step_ended(self, stats: Any) -> None:
        """The result of the oldest open step arrived, with the workers' ``stats``."""
        if self._store is None:
            return
        if self._open:
            started, tokens = self._open.popleft()
            if self._open:  # steps overlap (asynchronous scheduling): no clean sample
                self._open.clear()
            elif tokens:
                self._store.engine.note_prefill_step(tokens, self._clock() - started)
        data = getattr(stats, "data", None)
        if isinstance(data, Mapping):
            reads, loads = reads_from(data), loads_from(data)
            if reads:
                self._store.engine.observe_reads(reads)
            if loads:  # after the reads: a load is judged by the fit that includes them
                self._store.engine.observe_loads(loads)
