"""Finding blocks other processes stored in shared tiers.

A shared tier (a disk directory, a bucket, a Redis) may gain blocks the
manager never wrote: another engine process on the same node, or an earlier
run. When the index lacks a key, the manager asks the shared tiers before
calling it a miss and adopts what they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.index import READY, Entry, Level
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from kvstore.manager import BlockManager

__all__ = ["adopt", "adopt_persistent", "discover"]


def discover(m: BlockManager, keys: Sequence[BlockKey], batch: int = 16) -> int:
    """Index the leading ``keys`` that shared tiers hold but the index lacks.

    Other processes may have written them (a reader sharing a disk
    directory). Probes in small batches and stops at the first key no
    shared tier has, so a miss costs one batch of existence checks.
    """
    shared = [lv for lv in m._levels if lv.tier.shared]
    adopted = 0
    for start in range(0, len(keys) if shared else 0, batch):
        chunk = list(keys[start : start + batch])
        found = [0] * len(chunk)
        for level in shared:
            for i, present in enumerate(_tier_contains(m, level, chunk)):
                found[i] |= level.bit if present else 0
        run = next((i for i, bits in enumerate(found) if not bits), len(chunk))
        with m._cond:
            for key, bits in zip(chunk[:run], found[:run], strict=True):
                adopt(m, key, bits)
        adopted += run
        if run < len(chunk):
            break
    return adopted


def _tier_contains(m: BlockManager, level: Level, keys: list[BlockKey]) -> list[bool]:
    try:
        return level.tier.contains(keys)
    except Exception as exc:
        m._tier_failed(level, "check", len(keys), exc)
        return [False] * len(keys)


def adopt_persistent(m: BlockManager) -> None:
    """Index the blocks persistent tiers already hold (a restart)."""
    with m._cond:
        for level in m._levels:
            if level.tier.persistent:
                for key in level.tier.stored_keys():
                    adopt(m, key, level.bit)


def adopt(m: BlockManager, key: BlockKey, bits: int) -> None:
    """Record copies of ``key`` found in the tiers of ``bits``. Called with the lock held."""
    entry = m._index.get(key)
    if entry is None:
        entry = m._index[key] = Entry(READY)
    elif entry.state != READY:
        return
    for level in m._levels:
        if bits & level.bit and not entry.tiers & level.bit:
            entry.tiers |= level.bit
            level.policy.insert(key)
            level.resident += 1
