"""The block manager's cumulative counters (guarded by the books' lock)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PER_TIER", "ManagerCounters"]

#: Counters kept per tier (lists with one slot per tier).
PER_TIER = (
    "evictions",
    "demotions",
    "promotions",
    "write_through_copies",
    "writebacks",
    "admission_rejects",
)


@dataclass
class ManagerCounters:
    """Cumulative counters of one store."""

    lookups: int = 0
    lookup_blocks_hit: int = 0
    lookup_blocks_missed: int = 0
    puts: int = 0
    blocks_stored: int = 0
    blocks_already_present: int = 0
    blocks_not_stored: int = 0
    gets: int = 0
    blocks_read: int = 0
    blocks_missed: int = 0
    blocks_deleted: int = 0
    evictions: list[int] = field(default_factory=list)
    demotions: list[int] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    write_through_copies: list[int] = field(default_factory=list)
    writebacks: list[int] = field(default_factory=list)
    admission_rejects: list[int] = field(default_factory=list)
    blocks_dropped: int = 0
    copies_lost: int = 0
    tier_errors: int = 0
    leases_expired: int = 0
    layer_writes_expired: int = 0
    bytes_written: int = 0
    #: Bytes writers copied themselves into room reserved in a tier (``begin_put``,
    #: layer writes, a server's shared-memory puts): not timed, so not in ``write_gbps``.
    bytes_written_in_place: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0

    @classmethod
    def for_tiers(cls, count: int) -> ManagerCounters:
        """Counters with one slot per tier in the per-tier lists."""
        counters = cls()
        for name in PER_TIER:
            setattr(counters, name, [0] * count)
        return counters

    def add(self, amounts: Mapping[str, float]) -> None:
        """Add each amount to the counter of its name."""
        for name, amount in amounts.items():
            setattr(self, name, getattr(self, name) + amount)

    def add_level(self, name: str, level: int, n: int) -> None:
        """Add ``n`` to tier ``level``'s slot of per-tier counter ``name``."""
        getattr(self, name)[level] += n

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}
