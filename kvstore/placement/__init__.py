"""Placement rules: where copies of a block should live (admission, write policy,
promotion, hot replication), decided from the tiers' config and a block's heat.

Pure decisions, no state: the data path asks, then moves bytes. Which block leaves a
full tier is the eviction policies' business (:mod:`kvstore.policy`).
"""

from __future__ import annotations

from kvstore.placement.rules import Placement, TierRules

__all__ = ["Placement", "TierRules"]
