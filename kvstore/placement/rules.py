"""Placement rules: where copies of a block should live, decided from config and heat.

Pure decisions, no state: the block manager asks, then moves bytes.

- **Write policy** (per tier): ``write_back`` copies a block to the next tier
  when it is evicted from this one; ``write_through`` also copies it there
  (in the background) as soon as it is written here.
- **Admission** (per tier): ``admit_after = N`` lets a block into the tier only
  once it has been accessed N times (decayed), e.g. to spare an SSD the
  one-off blocks. Rejected blocks skip the tier and go further down (or drop).
- **Promotion** (per tier): ``promote_after = N`` copies a block into this
  tier, in the background, when a read served from a slower tier finds it has
  been accessed N times.
- **Hot replication** (store-wide): a block at ``hot_threshold`` heat gets a
  copy in the fastest tier and is kept there while hot. ``max_copies`` caps
  the copies in memory tiers (device, host); copies on persistent media
  (disk, S3) are the backing store, not replicas, and do not count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.config import ReplicationConfig, TierConfig

__all__ = ["Placement", "TierRules"]


@dataclass(frozen=True)
class TierRules:
    """The placement settings of one tier."""

    write_through: bool = False
    promote_after: int = 0
    admit_after: int = 0

    @classmethod
    def of(cls, config: TierConfig) -> TierRules:
        """Rules from a tier's config."""
        return cls(
            write_through=config.write_policy == "write_through",
            promote_after=config.promote_after,
            admit_after=config.admit_after,
        )


class Placement:
    """Placement decisions for an ordered list of tiers (index 0 is the fastest)."""

    def __init__(self, rules: Sequence[TierRules], replication: ReplicationConfig) -> None:
        self.rules = list(rules)
        self.replication = replication

    def admits(self, tier: int, heat: int) -> bool:
        """Whether a block of ``heat`` may enter ``tier``."""
        return heat >= self.rules[tier].admit_after

    def is_hot(self, heat: int) -> bool:
        """Whether a block of ``heat`` counts as hot (kept in, and copied to, the fastest tier)."""
        return self.replication.enabled and heat >= self.replication.hot_threshold

    def write_through_target(self, tier: int) -> int | None:
        """The tier a block written into ``tier`` is copied to right away, if any."""
        if self.rules[tier].write_through and tier + 1 < len(self.rules):
            return tier + 1
        return None

    def promotion_target(self, fastest: int, heat: int, copies: int) -> int | None:
        """The tier to copy a block into after a read from tier ``fastest``, if any.

        The fastest tier above ``fastest`` whose ``promote_after`` the heat
        reaches -- or tier 0 for a hot block -- as long as the block has fewer
        than ``replication.max_copies`` copies in memory tiers (``copies``).
        """
        if fastest == 0 or copies >= self.replication.max_copies:
            return None
        if self.is_hot(heat):
            return 0
        for tier in range(fastest):
            after = self.rules[tier].promote_after
            if after and heat >= after:
                return tier
        return None
