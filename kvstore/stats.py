"""Reporting: a block manager's counters and per-tier usage as plain dicts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.manager import BlockManager

__all__ = ["counters", "tier_usage"]


def tier_usage(m: BlockManager) -> list[dict[str, Any]]:
    """Per tier: kind, blocks held, capacity and watermarks (in blocks), movements."""
    with m._cond:
        return [
            {
                "kind": lv.tier.kind,
                "blocks": len(lv.policy),
                "capacity_blocks": lv.marks.capacity,
                "high_watermark_blocks": lv.marks.high,
                "low_watermark_blocks": lv.marks.low,
                "bytes": len(lv.policy) * m.layout.block_nbytes,
                "capacity_bytes": lv.marks.capacity * m.layout.block_nbytes,
                "policy": lv.policy.name,
                **{
                    name: getattr(m.counters, name)[lv.index]
                    for name in ("evictions", "demotions", "promotions", "admission_rejects")
                },
                "write_through_copies": m.counters.write_through_copies[lv.index],
                "writebacks": m.counters.writebacks[lv.index],
                **lv.tier.stats(),
            }
            for lv in m._levels
        ]


def counters(m: BlockManager) -> dict[str, Any]:
    """A consistent copy of the counters."""
    with m._cond:
        snapshot = m.counters.snapshot()
        snapshot["leases_live"] = len(m._leases)
    snapshot["moves_pending"] = m._mover.pending
    snapshot["moves_failed"] = m._mover.failures
    return snapshot
