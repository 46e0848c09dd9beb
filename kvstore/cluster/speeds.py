"""What a node publishes about its speeds, and what a router computes from them.

Each node's heartbeat carries :class:`NodeSpeeds`: the live read speed of the
fastest tier it has of each kind of medium -- its memory, its disk, the shared
storage (S3) every node reads -- and its engine's prefill speed where the store
knows one (``restore:`` in its config, or learned). A router then turns a
node's share of a prompt's prefix (chunks in memory, on disk, in S3) into
milliseconds: :meth:`NodeSpeeds.restore_ms` to load it, and with the rest of
the prompt recomputed, :meth:`NodeSpeeds.ready_ms`: by the node's own restore
planner's rule (:func:`~kvstore.restore.plan_restore`), the node loads only the
leading chunks that load faster than they recompute, so a prefix on a medium slower
than the node's prefill counts its recompute time, not its load time.

``ready_ms`` is that plan's ready time in closed form, in a few operations per medium
whatever the prompt's length (a router ranks every live node for every prompt: a plan
per node per request cost 0.7 ms for three nodes at 512 chunks). The planner loads
whole chunks in order, memory first, then disk, then shared storage; with the node's
flat prefill rate, the time to a ready prompt after ``n`` chunks is a line in ``n``
within each medium's run (each chunk adds its read and takes its tokens' prefill off),
plus the medium's one call latency as the run starts. The least of a line over a run
is at one of its ends, and the run's first chunk is never better than its start (it
adds a latency and at least the line's slope), so the planner's best ``n`` is one of
the runs' ends: no chunks, all of memory (the floor every plan loads), memory and disk,
everything. Scanned in that order with the planner's tie rule, the answer is the full
plan's (:meth:`NodeSpeeds.plan`; tests/cluster/test_router.py compares the two) up to
the planner's tie slack of one part in a million.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any

from kvstore.restore import (
    TIE,
    PrefillSpeed,
    RestoreCosts,
    RestorePlan,
    RestoreRequest,
    SpeedEstimate,
    plan_restore,
)

__all__ = ["MEDIA", "NodeSpeeds"]

#: The kinds of medium a router tells apart, as NodeRank counts them.
MEDIA = ("memory", "disk", "shared")


@dataclass(frozen=True)
class NodeSpeeds:
    """Per medium ``(GB/s, ms a call)`` (absent: the node has no such tier) and the
    engine's prefill tokens a second (None: not known)."""

    media: tuple[tuple[str, float, float], ...] = ()
    prefill_tokens_per_s: float | None = None

    @classmethod
    def of(cls, report: dict[str, Any]) -> NodeSpeeds:
        """From ``KVStore.engine.restore_speeds`` (``{medium: [gbps, ms], "prefill_tokens_per_s":
        x}``); malformed entries are dropped (a peer's heartbeat is a hint)."""
        media = []
        for name in MEDIA:
            value = report.get(name)
            if isinstance(value, (list, tuple)) and len(value) == 2:
                gbps, ms = value
                if _number(gbps) and gbps > 0 and _number(ms) and ms >= 0:
                    media.append((name, float(gbps), float(ms)))
        rate: Any = report.get("prefill_tokens_per_s")
        return cls(tuple(media), float(rate) if _number(rate) and rate > 0 else None)

    @classmethod
    def decode(cls, text: str | None) -> NodeSpeeds:
        """From a heartbeat field (empty or bad: no figures)."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except ValueError:
            return cls()
        return cls.of(data) if isinstance(data, dict) else cls()

    def encode(self) -> str:
        """The heartbeat field."""
        data: dict[str, Any] = {name: [gbps, ms] for name, gbps, ms in self.media}
        data["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return json.dumps(data, separators=(",", ":"))

    @functools.cached_property
    def _by_name(self) -> dict[str, tuple[float, float]]:
        return {name: (gbps, ms) for name, gbps, ms in self.media}

    @functools.cached_property
    def _runs(self) -> tuple[tuple[float, float] | None, ...]:
        """Per medium in :data:`MEDIA` order, ``(bytes a millisecond, ms a call)``."""
        by_name = self._by_name
        return tuple(
            (by_name[name][0] * 1e6, by_name[name][1]) if name in by_name else None
            for name in MEDIA
        )

    def restore_ms(self, chunks: dict[str, int], chunk_bytes: int) -> float | None:
        """Milliseconds to load ``chunks[medium]`` chunks from each medium (one call per
        medium); None if the node published no speed for a medium it would read."""
        by_name = self._by_name
        total = 0.0
        for name, n in chunks.items():
            if n <= 0:
                continue
            if name not in by_name:
                return None
            gbps, ms = by_name[name]
            total += ms + n * chunk_bytes / (gbps * 1e6)
        return total

    def ready_ms(
        self, chunks: dict[str, int], chunk_bytes: int, recompute_tokens: int, chunk_tokens: int
    ) -> float | None:
        """Milliseconds to a ready prompt: the node's prefix (``chunks[medium]`` chunks of
        ``chunk_tokens`` tokens from each medium) loaded as far as loading pays, the rest
        and ``recompute_tokens`` more recomputed, in closed form (the module docstring);
        None if unknown."""
        counts = tuple(max(0, chunks.get(name, 0)) for name in MEDIA)
        return self.times(counts, chunk_bytes, recompute_tokens, chunk_tokens)[1]

    def times(
        self, counts: tuple[int, ...], chunk_bytes: int, recompute_tokens: int, chunk_tokens: int
    ) -> tuple[float | None, float | None]:
        """``(restore_ms, ready_ms)`` of ``counts[i]`` chunks in each medium of
        :data:`MEDIA`, in one pass (what a router asks of every live node)."""
        load, n, ends, runs = 0.0, 0, [], self._runs  # ends: (chunks, ms to load them)
        for i, count in enumerate(counts):
            if count > 0:
                run = runs[i]
                if run is None:
                    return None, None
                load += run[1] + count * chunk_bytes / run[0]
                n += count
                ends.append((n, load))
        rate = self.prefill_tokens_per_s
        if rate is None:  # the planner loads every stored chunk; the rest is unknown
            return load, load if recompute_tokens <= 0 else None
        chunk_ms = chunk_tokens * 1e3 / rate
        best, best_ms = 0, n * chunk_ms
        chosen = best_ms
        for end, loaded in ends:  # the planner's scan: ties go to loading
            t = loaded + (n - end) * chunk_ms
            if t <= best_ms * (1 + TIE):
                best, chosen, best_ms = end, t, min(t, best_ms)
        if best < counts[0]:  # what memory holds is always loaded: the first run's end
            chosen = ends[0][1] + (n - counts[0]) * chunk_ms
        return load, chosen + max(0, recompute_tokens) * 1e3 / rate

    def plan(
        self, chunks: dict[str, int], chunk_bytes: int, recompute_tokens: int, chunk_tokens: int
    ) -> RestorePlan | None:
        """The node's restore plan for a prompt whose prefix it holds as ``chunks[medium]``
        chunks, followed by ``recompute_tokens`` it holds nowhere: the restore planner's
        rule (:func:`~kvstore.restore.plan_restore`) over the published speeds, with the
        chunks in memory first (always loaded), then on disk, then in shared storage (the
        order is not published: the fast media lead). None if the node published no
        speed for a medium it would read."""
        by_name = {name: (gbps, ms) for name, gbps, ms in self.media}
        levels: list[int] = []
        speeds = []
        for level, name in enumerate(MEDIA):
            if chunks.get(name, 0) > 0 and name not in by_name:
                return None
            gbps, ms = by_name.get(name, (1.0, 0.0))  # a medium not read: any figure
            speeds.append(SpeedEstimate(gbps, ms, "published", 0.0, None))
            levels += [level] * max(0, chunks.get(name, 0))
        prefill = PrefillSpeed(None, self.prefill_tokens_per_s, False, 1.0, time.monotonic)
        fast = frozenset({MEDIA.index("memory")})
        costs = RestoreCosts(chunk_tokens, chunk_bytes, speeds, fast, prefill)
        prompt = len(levels) * chunk_tokens + max(0, recompute_tokens)
        return plan_restore(RestoreRequest(levels, prompt_tokens=prompt), costs)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
