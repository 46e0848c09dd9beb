"""The read path of the block manager: fastest copy first, verified, with fallback.

A read runs on entries the caller has pinned, so no copy it uses can be
evicted or deleted under it. Each block is read from its fastest copy; a
tier that answers "not here" (or whose bytes fail verification) loses that
copy from the books and the next copy is tried; a tier that is unreachable
(raises) keeps its copies in the books -- the medium may come back -- and
the next copy is tried too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.discovery import discover
from kvstore.errors import BlockNotFoundError
from kvstore.index import DELETING, Entry, Level
from kvstore.keys import BlockKey
from kvstore.tiers.base import LayerRange

if TYPE_CHECKING:
    from kvstore.manager import BlockManager

__all__ = ["load", "lose_copy", "read", "tier_get"]


def load(
    m: BlockManager,
    keys: Sequence[BlockKey],
    outs: Sequence[torch.Tensor],
    layers: LayerRange,
    prefix: bool,
) -> int:
    """The manager's ``get``: pin, read, unpin, count, promote; the leading blocks loaded."""
    entries = _pin_for_read(m, keys, prefix)
    try:
        done = m.read(keys[: len(entries)], entries, outs, layers)
    finally:
        with m._cond:
            m._unpin(entries)
    n = next((i for i, ok in enumerate(done) if not ok), len(done))
    with m._cond:
        m.counters.blocks_read += n
        m.counters.blocks_missed += len(keys) - n
    m._moves.promote_later(list(keys[:n]), entries[:n])
    if not prefix and n < len(keys):
        raise BlockNotFoundError(f"block {n} (key {keys[n].hex()}) failed to load from every tier")
    return n


def _pin_for_read(m: BlockManager, keys: Sequence[BlockKey], prefix: bool) -> list[Entry]:
    """Pin the leading readable entries (asking shared tiers about missing ones)."""
    with m._cond:
        m._check_open()
        m.counters.gets += 1
        entries = m._pin_leading(keys)
    if len(entries) < len(keys) and discover(m, keys[len(entries) :]):
        with m._cond:
            m._unpin(entries)
            entries = m._pin_leading(keys)
    if not prefix and len(entries) < len(keys):
        with m._cond:
            m._unpin(entries)
            m.counters.blocks_missed += len(keys) - len(entries)
        missing = keys[len(entries)]
        raise BlockNotFoundError(f"block {len(entries)} (key {missing.hex()}) is not stored")
    return entries


def read(
    m: BlockManager,
    keys: Sequence[BlockKey],
    entries: list[Entry],
    outs: Sequence[torch.Tensor],
    layers: LayerRange,
) -> list[bool]:
    """Read each *pinned* entry from its fastest copy, falling back to slower ones."""
    done = [False] * len(entries)
    tried = [0] * len(entries)
    pending = list(range(len(entries)))
    while pending:
        groups: dict[int, list[int]] = {}
        with m._cond:
            for i in pending:
                untried = entries[i].tiers & ~tried[i]
                if untried:
                    lvl = (untried & -untried).bit_length() - 1
                    groups.setdefault(lvl, []).append(i)
        pending = []
        for lvl, idxs in groups.items():
            level = m._levels[lvl]
            ok = tier_get(m, level, [keys[i] for i in idxs], [outs[i] for i in idxs], layers)
            for n, i in enumerate(idxs):
                tried[i] |= level.bit
                if ok is not None and ok[n]:
                    done[i] = True
                    continue
                if ok is not None:  # the tier answered: it has no good copy
                    lose_copy(m, level, keys[i], entries[i])
                pending.append(i)  # (a dead medium keeps its copies in the books)
    return done


def tier_get(
    m: BlockManager,
    level: Level,
    keys: list[BlockKey],
    outs: list[torch.Tensor],
    layers: LayerRange,
) -> list[bool] | None:
    """Read from one tier; None when the medium is unavailable (it raised)."""
    start = time.perf_counter()
    try:
        ok = level.tier.get(keys, outs, layers)
    except Exception as exc:
        m._tier_failed(level, "read", len(keys), exc)
        return None
    elapsed = time.perf_counter() - start
    nbytes = m.layout.block_nbytes
    if layers is not None:
        nbytes = (layers[1] - layers[0]) * m.layout.layer_nbytes
    with m._cond:
        m.counters.bytes_read += sum(ok) * nbytes
        m.counters.read_seconds += elapsed
    return ok


def lose_copy(m: BlockManager, level: Level, key: BlockKey, entry: Entry) -> None:
    """A tier failed to produce ``key``: forget that copy (and the block if it was the last)."""
    with m._cond:
        if not m._begin_drop(level, key, entry):
            return
        m.counters.copies_lost += 1
        if not entry.tiers:
            entry.state = DELETING
            if m._index.get(key) is entry:
                del m._index[key]
    m._tier_delete(level, [key])
    with m._cond:
        m._end_drop(level, [entry])
