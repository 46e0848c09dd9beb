"""How a block manager's books and speed estimates are built from its tiers and config:
a level per tier (watermarks, policy, write-back ahead), the tier masks, the heat clock,
and a live read-speed estimate per tier. Pure construction; the manager owns the results."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvstore.config import StoreConfig
from kvstore.datapath.books import Books
from kvstore.datapath.index import HeatClock, Level
from kvstore.datapath.room import RetainedFn
from kvstore.datapath.tierio import tier_ids
from kvstore.placement import Placement, TierRules
from kvstore.policy import Watermarks, make_policy
from kvstore.restore import ReadSpeed
from kvstore.tiers.base import Tier

__all__ = ["build_books", "build_speeds"]


def build_speeds(
    tiers: Sequence[Tier], config: StoreConfig, clock: Callable[[], float]
) -> list[ReadSpeed]:
    """A live read-speed estimate per tier, starting from its configured figures
    (``restore.tier_speeds``, else the tier's own ``read_gbps`` / ``read_latency_ms``)."""
    restore = config.restore
    speeds = []
    for tier, tier_id in zip(tiers, tier_ids(tiers), strict=True):
        declared = restore.declared_speed(tier_id)
        gbps, ms = declared or (tier.config.read_gbps, tier.config.read_latency_ms)
        speeds.append(
            ReadSpeed(
                gbps,
                ms,
                restore.speed_half_life_s,
                restore.speed_stale_s,
                clock,
                tier.stored_bytes(),  # an encoded tier moves fewer bytes, then decodes
            )
        )
    return speeds


def build_books(
    tiers: Sequence[Tier],
    placement: Placement,
    config: StoreConfig,
    clock: Callable[[], float],
    retained: RetainedFn,
) -> Books:
    """The books for ``tiers``: a level per tier, the tier masks, the heat clock."""
    levels = [_level(i, tier, clock) for i, tier in enumerate(tiers)]
    for (upper, a), (_, b) in itertools.pairwise(zip(levels, tiers, strict=True)):
        upper.writes_back_ahead = _writes_back_ahead(a, b)
    masks = tuple(sum(1 << i for i, t in enumerate(tiers) if test(t)) for test in _MASKS)
    memory = sum(lv.marks.capacity for lv, t in zip(levels, tiers, strict=True) if not t.persistent)
    accesses = config.replication.half_life_accesses or max(1024, 2 * memory)
    heat = HeatClock(config.replication.half_life_s, accesses, clock)
    return Books(levels, (masks[0], masks[1], masks[2]), placement, heat, clock, retained)


_MASKS: tuple[Callable[[Tier], bool], ...] = (
    lambda tier: tier.persistent,
    lambda tier: tier.local,
    lambda tier: tier.shared,
)


def _writes_back_ahead(upper: Tier, lower: Tier) -> bool:
    """Whether ``upper`` copies blocks down ahead of eviction: a write-back memory
    tier right in front of a local persistent one (a host tier over a disk)."""
    memory = not upper.persistent and upper.local
    disk = lower.persistent and lower.local
    return memory and disk and not TierRules.of(upper.config).write_through


def _level(index: int, tier: Tier, clock: Callable[[], float]) -> Level:
    config = tier.config
    capacity = tier.capacity_blocks
    return Level(
        index=index,
        kind=tier.kind,
        marks=Watermarks.of(capacity, config.high_watermark, config.low_watermark),
        policy=make_policy(config.policy, capacity, clock),
    )
