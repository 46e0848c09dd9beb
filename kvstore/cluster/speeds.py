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
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from kvstore.restore import RestoreCosts, RestorePlan, RestoreRequest, plan_restore
from kvstore.speeds import PrefillSpeed, SpeedEstimate

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
        """From :meth:`KVStore.restore_speeds` (``{medium: [gbps, ms], "prefill_tokens_per_s":
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

    def restore_ms(self, chunks: dict[str, int], chunk_bytes: int) -> float | None:
        """Milliseconds to load ``chunks[medium]`` chunks from each medium (one call per
        medium); None if the node published no speed for a medium it would read."""
        by_name = {name: (gbps, ms) for name, gbps, ms in self.media}
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
        and ``recompute_tokens`` more recomputed (:meth:`plan`); None if unknown."""
        plan = self.plan(chunks, chunk_bytes, recompute_tokens, chunk_tokens)
        return None if plan is None or plan.ready_s is None else plan.ready_s * 1e3

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
