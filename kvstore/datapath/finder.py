"""Finder: which blocks are stored, including those other processes stored.

A shared tier (a disk directory, a bucket, a Redis, a server, the cluster)
may gain blocks the books never recorded: another engine process on the same
node, or an earlier run. When the index lacks a key, the finder asks the
shared tiers before calling it a miss, and records what they hold
(:meth:`Finder.discover`); :meth:`Finder.nearer` asks the tiers whose copies
come and go (cluster peers) about blocks a read would otherwise take from a
shared remote medium (S3); :meth:`Finder.recheck` confirms that blocks only
shared tiers hold are still there; :meth:`Finder.adopt_persistent` indexes
what persistent tiers hold when a store opens (or on a rescan).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.datapath.books import Books
from kvstore.datapath.index import Entry
from kvstore.datapath.tierio import TierIO
from kvstore.keys import BlockKey

__all__ = ["Finder"]


class Finder:
    """Lookups, discovery and rechecks over ``books`` and the shared tiers of ``io``."""

    def __init__(self, books: Books, io: TierIO) -> None:
        self.books = books
        self.io = io
        self._shared = io.shared_levels()
        self._own = io.mask(lambda tier: not tier.shared)
        self._near = io.mask(lambda tier: tier.local)
        #: Shared tiers whose copies come and go (cluster peers): asked again before a
        #: read goes to a slower shared medium.
        persistent = io.mask(lambda tier: tier.persistent)
        self._peers = [lv for lv in self._shared if not persistent >> lv & 1]

    def lookup(self, keys: Sequence[BlockKey], recheck: bool = False, skip: int = 0) -> int:
        """Number of leading ``keys`` that are stored and readable.

        With ``recheck``, blocks held only in shared tiers are confirmed with
        those tiers first (another process may have evicted them). Tiers in the
        bit mask ``skip`` are not asked (a restore plan knows no load from them can
        pay): what the index says of them stands.

        Copies in a tier whose server refuses this store's token are not counted: a
        get could not read them (a lookup-then-get would come back short). Discovery
        still asks that tier about the keys past the prefix -- its client answers from
        memory, and probes the server once per ``retry_interval`` -- so once the server
        takes the token again its blocks count again.
        """
        refused = self.io.refused_mask()
        known = n = self.books.queries.leading(keys, without=refused)
        if n < len(keys) and self.discover(keys[n:], skip=skip):
            refused = self.io.refused_mask()
            n = self.books.queries.leading(keys, without=refused)
        # What discovery just found is confirmed; only what the index knew before is asked.
        if recheck and known:
            confirmed = self.recheck(keys[:known], skip=skip | refused)
            if confirmed < known:  # one the index knew is gone: the prefix ends there
                n = confirmed
        self.books.count(lookups=1, lookup_blocks_hit=n, lookup_blocks_missed=len(keys) - n)
        return n

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` are readable, after asking shared tiers about missing ones."""
        n = self.books.queries.leading(keys)
        if n < len(keys):
            self.discover(keys[n:])
        return self.books.queries.readable(keys)

    def discover(self, keys: Sequence[BlockKey], batch: int = 16, skip: int = 0) -> int:
        """Index the leading ``keys`` that shared tiers hold but the index lacks.

        Skips the leading keys a local tier of this machine holds (nothing
        serves them faster); a key known only in remote media is asked about
        again, as a faster copy may have appeared (a peer holding what only S3
        held). Probes in batches that start small and double while every key
        is found, and stops at the first key no shared tier has: a miss costs
        one small batch of existence checks, a long hit a few round trips (a
        512-chunk prompt: 6 with ``batch=16``, not 32). Tiers in the bit mask
        ``skip`` are not asked. Returns how many keys were adopted or found.
        """
        shared = [level for level in self._shared if not skip >> level & 1]
        if not shared:
            return 0
        keys = keys[self.books.queries.leading(keys, local=True) :]
        adopted = 0
        start = 0
        while start < len(keys):
            chunk = list(keys[start : start + batch])
            start += len(chunk)
            batch *= 2
            found = [0] * len(chunk)
            for level in shared:
                for i, present in enumerate(self.io.contains(level, chunk)):
                    found[i] |= (1 << level) if present else 0
            run = next((i for i, bits in enumerate(found) if not bits), len(chunk))
            self.books.discovery.adopt(list(zip(chunk[:run], found[:run], strict=True)))
            adopted += run
            if run < len(chunk):
                break
        return adopted

    def nearer(self, keys: Sequence[BlockKey], entries: Sequence[Entry]) -> int:
        """Ask the peer tiers about pinned blocks that only a shared remote medium
        (S3) holds as far as the books know, and record the copies they have.

        A block found in S3 before its owner had published it would otherwise be
        read from S3 for good: never fetched from the peer, never counted hot,
        never replicated. Peers answer from memory (the cluster's index copy), so
        this costs no round trip. Returns how many blocks gained a copy.
        """
        if not self._peers or not keys:
            return 0
        masks = self.books.queries.tiers_of(entries)
        peer_bits = sum(1 << lv for lv in self._peers)
        probe = [i for i, bits in enumerate(masks) if bits and not bits & (self._near | peer_bits)]
        if not probe:
            return 0
        found = [0] * len(probe)
        for level in self._peers:
            held = self.io.contains(level, [keys[i] for i in probe])
            for j, present in enumerate(held):
                found[j] |= (1 << level) if present else 0
        adopted = [(keys[i], bits) for i, bits in zip(probe, found, strict=True) if bits]
        self.books.discovery.adopt(adopted)
        return len(adopted)

    def recheck(self, keys: Sequence[BlockKey], batch: int = 16, skip: int = 0) -> int:
        """Of the leading indexed ``keys``, how many shared tiers still hold; forget the rest.

        Another process sharing a tier (a worker evicting from the disk this
        process reads) may have removed blocks this index remembers. Blocks
        with a copy in a tier of this process's own are trusted; the others are
        probed, in batches, up to the first one that is gone. Nothing is
        deleted: the index just stops claiming what is no longer there. Tiers in
        the bit mask ``skip`` are not asked: their claims stand.
        """
        for start in range(0, len(keys), batch):
            chunk = list(keys[start : start + batch])
            entries = self.books.queries.entries(chunk)
            known = [i for i, e in enumerate(entries) if e is not None]
            masks = self.books.queries.tiers_of([e for e in entries if e is not None])
            probe = [i for i, tiers in zip(known, masks, strict=True) if not tiers & self._own]
            gone = self._gone([chunk[i] for i in probe], [entries[i] for i in probe], skip)
            if gone is not None:
                return start + probe[gone]
        return len(keys)

    def _gone(self, keys: list[BlockKey], entries: list[Entry | None], skip: int) -> int | None:
        """Forget copies the shared tiers no longer hold; the position of the first
        block left with none, or None."""
        if not keys:
            return None
        known = [e for e in entries if e is not None]
        assert len(known) == len(keys)
        masks = self.books.queries.tiers_of(known)
        confirmed = [False] * len(keys)
        verdicts: dict[int, list[bool]] = {}
        # Fastest shared tier first; a key one of them still holds is not asked about
        # again further down (a slow bucket is probed only for what faster tiers lost).
        for level in self._shared:
            if skip >> level & 1:
                verdicts[level] = [bool(m >> level & 1) for m in masks]
                continue
            ask = [i for i, m in enumerate(masks) if m >> level & 1 and not confirmed[i]]
            found = self.io.contains(level, [keys[i] for i in ask]) if ask else []
            verdict = [bool(m >> level & 1) for m in masks]  # not asked: the claim stands
            for i, present in zip(ask, found, strict=True):
                verdict[i] = present
                confirmed[i] = confirmed[i] or present
            verdicts[level] = verdict
        return self.books.discovery.forget_gone(keys, known, verdicts)

    def adopt_persistent(self) -> None:
        """Index the blocks persistent tiers hold now (on open, and on a rescan)."""
        for level in self.io.persistent_levels():
            keys = self.io.stored_keys(level)  # a directory scan or a listing: no lock
            self.books.discovery.adopt([(key, 1 << level) for key in keys])
