"""What a node publishes about its speeds, and what a router computes from them.

Each node's heartbeat carries :class:`NodeSpeeds`: the live read speed of the
fastest tier it has of each kind of medium -- its memory, its disk, the shared
storage (S3) every node reads -- and its engine's prefill speed where the store
knows one (``restore:`` in its config, or learned). A router then turns a
node's share of a prompt's prefix (chunks in memory, on disk, in S3) into
milliseconds: :meth:`NodeSpeeds.restore_ms` to load it, and with the rest of
the prompt recomputed, :meth:`NodeSpeeds.ready_ms`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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
        self, chunks: dict[str, int], chunk_bytes: int, recompute_tokens: int
    ) -> float | None:
        """:meth:`restore_ms` plus the prefill of ``recompute_tokens`` (None: unknown)."""
        load = self.restore_ms(chunks, chunk_bytes)
        if load is None or (recompute_tokens > 0 and self.prefill_tokens_per_s is None):
            return None
        rate = self.prefill_tokens_per_s or 1.0
        return load + recompute_tokens / rate * 1e3


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
