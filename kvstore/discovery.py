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

__all__ = ["adopt", "adopt_persistent", "discover", "recheck", "rescan"]


def discover(m: BlockManager, keys: Sequence[BlockKey], batch: int = 16) -> int:
    """Index the leading ``keys`` that shared tiers hold but the index lacks.

    Other processes may have written them (a reader sharing a disk
    directory). Skips the leading keys a local tier of this machine holds
    (nothing serves them faster); a key known only in remote media is asked
    about again, as a faster copy may have appeared (a peer holding what only
    S3 held). Probes in batches that start small and double while every key
    is found, and stops at the first key no shared tier has: a miss costs one
    small batch of existence checks, a long hit a few round trips (a 512-chunk
    prompt: 6 with ``batch=16``, not 32). Returns how many keys were adopted or
    found.
    """
    shared = [lv for lv in m._levels if lv.tier.shared]
    if not shared:
        return 0
    with m._cond:  # leading keys this machine holds need no question
        keys = keys[_leading_local(m, keys) :]
    adopted = 0
    start = 0
    while start < len(keys):
        chunk = list(keys[start : start + batch])
        start += len(chunk)
        batch *= 2
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


def _leading_local(m: BlockManager, keys: Sequence[BlockKey]) -> int:
    """Leading keys readable from a local tier. Called with the lock held."""
    n = 0
    for key in keys:
        entry = m._index.get(key)
        if entry is None or entry.state != READY or not entry.tiers & m._local:
            break
        n += 1
    return n


def _tier_contains(m: BlockManager, level: Level, keys: list[BlockKey]) -> list[bool]:
    try:
        return level.tier.contains(keys)
    except Exception as exc:
        m._tier_failed(level, "check", len(keys), exc)
        return [False] * len(keys)


def adopt_persistent(m: BlockManager) -> None:
    """Index the blocks persistent tiers already hold (a restart, or a rescan)."""
    for level in m._levels:
        if level.tier.persistent:
            keys = list(level.tier.stored_keys())  # a directory scan or a listing: no lock
            with m._cond:
                for key in keys:
                    adopt(m, key, level.bit)


def rescan(m: BlockManager) -> None:
    """Index what persistent tiers hold now (blocks other processes wrote since)."""
    adopt_persistent(m)


def recheck(m: BlockManager, keys: Sequence[BlockKey], batch: int = 16) -> int:
    """Of the leading indexed ``keys``, how many shared tiers still hold; forget the rest.

    Another process sharing a tier (a worker evicting from the disk this
    process reads) may have removed blocks this index remembers. Blocks with a
    copy in a tier of this process's own are trusted; the others are probed,
    in batches, up to the first one that is gone. Nothing is deleted: the
    index just stops claiming what is no longer there.
    """
    own = sum(lv.bit for lv in m._levels if not lv.tier.shared)
    for start in range(0, len(keys), batch):
        chunk = list(keys[start : start + batch])
        with m._cond:
            entries = [m._index.get(k) for k in chunk]
        probe = [i for i, e in enumerate(entries) if e is not None and not e.tiers & own]
        gone = _gone_from_shared(m, [chunk[i] for i in probe], [entries[i] for i in probe])
        if gone is not None:
            return start + probe[gone]
    return len(keys)


def _gone_from_shared(
    m: BlockManager, keys: list[BlockKey], entries: list[Entry | None]
) -> int | None:
    """Forget copies the shared tiers no longer hold; the index of the first block
    left with none, or None."""
    if not keys:
        return None
    verdicts = {lv.index: _tier_contains(m, lv, keys) for lv in m._levels if lv.tier.shared}
    first_gone = None
    with m._cond:
        for i, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            if entry is None:
                continue
            for lvl, present in verdicts.items():
                level = m._levels[lvl]
                if entry.tiers & level.bit and not present[i] and m._begin_drop(level, key, entry):
                    m._end_drop(level, [entry])  # the other process already freed it
            if not entry.tiers:
                first_gone = i if first_gone is None else first_gone
                if entry.state == READY and entry.pins == 0 and m._index.get(key) is entry:
                    del m._index[key]
    return first_gone


def adopt(m: BlockManager, key: BlockKey, bits: int) -> None:
    """Record copies of ``key`` found in the tiers of ``bits``. Called with the lock held."""
    entry = m._index.get(key)
    if entry is None:
        entry = m._index[key] = Entry(READY)
    elif entry.state != READY:
        return
    for level in m._levels:
        if bits & level.bit and not entry.tiers & level.bit:
            m.note_copy(key, entry, level.bit)
            level.policy.insert(key)
            level.resident += 1
