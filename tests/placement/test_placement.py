"""Placement rules: admission, write-through, promotion and hot replication decisions."""

from __future__ import annotations

from kvstore.config import DiskTierConfig, HostTierConfig, ReplicationConfig
from kvstore.placement import Placement, TierRules


def placement(*rules: TierRules, hot: int = 8, max_copies: int = 2) -> Placement:
    return Placement(list(rules), ReplicationConfig(hot_threshold=hot, max_copies=max_copies))


def test_rules_come_from_tier_config() -> None:
    rules = TierRules.of(HostTierConfig(write_policy="write_through", promote_after=3))
    assert rules == TierRules(write_through=True, promote_after=3, admit_after=0)
    assert TierRules.of(DiskTierConfig(admit_after=2)).admit_after == 2


def test_admission_filter() -> None:
    p = placement(TierRules(), TierRules(admit_after=2))
    assert p.admits(0, 1)
    assert not p.admits(1, 1)  # seen once: spare the SSD
    assert p.admits(1, 2)


def test_write_through_targets_the_next_tier_only() -> None:
    p = placement(TierRules(write_through=True), TierRules(), TierRules(write_through=True))
    assert p.write_through_target(0) == 1
    assert p.write_through_target(1) is None
    assert p.write_through_target(2) is None  # the last tier has no tier below


def test_promotion_after_the_nth_hit_to_the_fastest_tier_that_wants_it() -> None:
    p = placement(TierRules(promote_after=4), TierRules(promote_after=2), TierRules())
    assert p.promotion_target(2, heat=1, copies=0) is None
    assert p.promotion_target(2, heat=2, copies=0) == 1
    assert p.promotion_target(2, heat=4, copies=0) == 0
    assert p.promotion_target(0, heat=99, copies=0) is None  # already in the fastest tier


def test_hot_blocks_go_to_tier_zero_within_the_copy_limit() -> None:
    p = placement(TierRules(), TierRules(), hot=5, max_copies=2)
    assert p.is_hot(5) and not p.is_hot(4)
    assert p.promotion_target(1, heat=5, copies=0) == 0
    assert p.promotion_target(1, heat=5, copies=1) == 0
    assert p.promotion_target(1, heat=5, copies=2) is None  # max_copies reached
    off = Placement([TierRules(), TierRules()], ReplicationConfig(enabled=False))
    assert not off.is_hot(10**6) and off.promotion_target(1, heat=10**6, copies=0) is None
