"""Reader: blocks out of the tiers, from the fastest verified copy, with fallback.

A read runs on entries pinned in the books, so no copy it uses can be evicted
or deleted under it. Each block is read from its fastest copy; a tier that
answers "not here" (or whose bytes fail verification) loses that copy from
the books and the next copy is tried; a tier that is unreachable (raises)
keeps its copies in the books -- the medium may come back -- and the next copy
is tried too. Gets, prefetches and loans all read through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.datapath.books import Books
from kvstore.datapath.finder import Finder
from kvstore.datapath.index import Entry
from kvstore.datapath.tierio import TierIO
from kvstore.errors import BlockNotFoundError
from kvstore.keys import BlockKey
from kvstore.tiers.base import LayerRange

__all__ = ["Loaded", "Reader"]


@dataclass
class Loaded:
    """What a get loaded: the leading ``count`` blocks, and their entries (for promotion)."""

    count: int
    keys: Sequence[BlockKey]
    entries: list[Entry]


class Reader:
    """Reads pinned blocks through ``io``, asking ``finder`` about unknown keys first."""

    def __init__(self, books: Books, io: TierIO, finder: Finder) -> None:
        self.books = books
        self.io = io
        self.finder = finder
        self._shared = io.mask(lambda tier: tier.shared)

    def load(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange,
        prefix: bool,
        partial: bool = False,
    ) -> Loaded:
        """A get: pin, read, unpin, count. Raises :class:`BlockNotFoundError` (loading
        nothing) without ``prefix`` when a key is not stored; a key that fails to load
        from every tier ends the loaded prefix (the caller decides what that means),
        except that without ``prefix`` or ``partial`` (a get into a buffer, all or
        nothing) a server refusing the token is named at once. With ``partial`` such a
        block is a miss like any other (the tier's refusal is logged once and counted)."""
        entries = self._pin(keys, prefix)
        try:
            done = self.read(keys[: len(entries)], entries, outs, layers)
        finally:
            self.books.pins.unpin(entries)
        n = next((i for i, ok in enumerate(done) if not ok), len(done))
        self.books.count(blocks_read=n, blocks_missed=len(keys) - n)
        if not prefix and not partial and n < len(keys):
            self._raise_if_refused(keys, n)
        return Loaded(n, keys[:n], entries[:n])

    def _raise_if_refused(self, keys: Sequence[BlockKey], n: int) -> None:
        """Block ``n`` could not be had while a tier's server refuses this store's token:
        say that (the block may well be stored there), never "not stored"."""
        refusal = self.io.refusal()
        if refusal is not None:
            raise BlockNotFoundError(f"block {n} (key {keys[n].hex()}) cannot be read: {refusal}")

    def _pin(self, keys: Sequence[BlockKey], prefix: bool) -> list[Entry]:
        """Pin the leading readable entries (asking shared tiers about missing ones)."""
        entries = self.books.pins.pin_leading(keys, get=True)
        if len(entries) < len(keys) and self.finder.discover(keys[len(entries) :]):
            entries = self.books.pins.repin_leading(entries, keys)
        if not prefix and len(entries) < len(keys):
            self.books.pins.unpin(entries)
            self.books.count(blocks_missed=len(keys) - len(entries))
            self._raise_if_refused(keys, len(entries))
            missing = keys[len(entries)]
            raise BlockNotFoundError(
                f"block {len(entries)} (key {missing.hex()}) is not stored; get the blocks "
                "lookup(keys) counts, or get_prefix, which loads what is stored"
            )
        return entries

    def read(
        self,
        keys: Sequence[BlockKey],
        entries: Sequence[Entry],
        outs: Sequence[torch.Tensor],
        layers: LayerRange,
    ) -> list[bool]:
        """Read each *pinned* entry from its fastest copy, falling back to slower ones
        (a peer that now holds a block known only in S3 is asked first: Finder.nearer)."""
        self.finder.nearer(keys, entries)
        done = [False] * len(entries)
        tried = [0] * len(entries)
        pending = list(range(len(entries)))
        while pending:
            groups = self.books.queries.sources(entries, pending, tried)
            pending = []
            for level, idxs in groups.items():
                got = [keys[i] for i in idxs]
                ok = self.io.get(level, got, [outs[i] for i in idxs], layers)
                for n, i in enumerate(idxs):
                    tried[i] |= 1 << level
                    if ok is not None and ok[n]:
                        done[i] = True
                        continue
                    if ok is not None:  # the tier answered: it has no good copy
                        self.lose_copy(level, keys[i], entries[i])
                    pending.append(i)  # (a dead medium keeps its copies in the books)
        return done

    def lose_copy(self, level: int, key: BlockKey, entry: Entry) -> None:
        """A tier failed to produce ``key``: forget that copy (the block, if it was the
        last), delete it from the tier, give its room back.

        A shared tier's copy is only forgotten, never deleted from here: other
        processes and nodes read it too, and a read that failed there (a request
        that gave up, bytes damaged on the way) says nothing certain about the
        object. Such a tier deletes what it knows to be bad itself.
        """
        if self.books.removals.lose_copy(level, key, entry):
            if not self._shared >> level & 1:
                self.io.delete(level, [key])
            self.books.removals.end_drop(level, [key])
