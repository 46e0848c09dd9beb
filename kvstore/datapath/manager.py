"""The block manager: a thin façade over the data path.

:class:`BlockManager` builds the pieces of the data path for one store and
hands each the narrow things it needs; its methods only route a call to the
piece that owns it (and hand background work the writes leave behind to
:class:`~kvstore.datapath.migrations.Migrations`). Calls and imports run one way::

    manager ─▶ Finder · Reader · Writer · Migrations · Prefetcher · LayerWrites · Lender
                    │ all of them use ▼
               Books (index, THE lock, levels, heat, leases, partial writes, change feed, counters)
               TierIO (every tier call: timed, counted, failure → miss)
               copies (the copy engine: every copy between memories)
                    ▼
                  tiers

Placement: a new block goes to the first tier that admits it and has (or can
make) room. Making room evicts just what is needed, synchronously; bringing
a tier that passed its high watermark down to its low one happens in the
background, as do write-through copies and promotions. Eviction demotes a
block to the next tier unless it already has a copy further down.
``evict(n)`` frees exactly ``n`` blocks or none.

Write-back ahead of eviction: a write-back memory tier in front of a local
disk keeps at most its low watermark's worth of blocks that only it holds;
past that, the least recently used are copied to the disk in the background.
Evictions take those first too, so they find them on disk already and free
their room without waiting for it: a put does not block on the disk unless it
outruns it.

docs/architecture.md draws the pieces and the path of each operation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.config import StoreConfig
from kvstore.copies import engine_for
from kvstore.datapath.assembly import build_books, build_speeds
from kvstore.datapath.contracts import ChangeFeed, Medium
from kvstore.datapath.counters import ManagerCounters
from kvstore.datapath.finder import Finder
from kvstore.datapath.index import Entry, HeatClock, lowest_bit
from kvstore.datapath.layerwrites import LayerWrites
from kvstore.datapath.leases import Lease, Pin
from kvstore.datapath.lending import Lender, Loan, PendingPut
from kvstore.datapath.migrations import Migrations
from kvstore.datapath.mover import Mover
from kvstore.datapath.prefetch import Prefetcher, PrefetchHandle
from kvstore.datapath.probes import SpeedProbes
from kvstore.datapath.progress import FlushProgress
from kvstore.datapath.reader import Reader
from kvstore.datapath.saves import SAVE_COUNTERS, Saver, SaverParts
from kvstore.datapath.tierio import TierIO
from kvstore.datapath.writer import FollowUps, Writer
from kvstore.errors import BlockNotFoundError, ConfigError, InvalidInputError
from kvstore.hints import Hint, Hinter, HinterParts, HintLimits, Retention
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.layout import KVLayout
from kvstore.memory import cuda_available
from kvstore.placement import Placement, TierRules
from kvstore.quota import QuotaHook, QuotaLedger
from kvstore.restore import Restorer, RestorerParts, Warming, medium_of
from kvstore.speeds import PrefillSpeed
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["BlockManager", "ManagerCounters"]

log = logging.getLogger(__name__)


class BlockManager:
    """Index and movement of blocks across an ordered list of tiers (fastest first).

    The pieces are public attributes, for tests and tools: ``books``, ``io``,
    ``finder``, ``reader``, ``writer``, ``migrations``, ``layer_writes``,
    ``prefetcher``, ``lender``, ``copies`` (the copy engine), ``mover``.
    """

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers:
            raise ConfigError("a block manager needs at least one tier")
        self.layout = layout
        self.config = config or StoreConfig(tiers=tuple(t.config for t in tiers))
        self.clock = clock
        rules = [TierRules.of(t.config) for t in tiers]
        self.placement = Placement(rules, self.config.replication)
        #: Blocks session hints retain: eviction takes them last (kvstore/hints.py).
        self.retention = Retention(1, clock)
        self.books = build_books(tiers, self.placement, self.config, clock, self.retention.priority)
        self.io = TierIO(tiers, layout, self.books, build_speeds(tiers, self.config, clock))
        first = tiers[0].device
        self.copies = engine_for(first if first is not None else "cpu")
        self.mover = Mover(self.config.mover_threads)
        lease_s = self.config.lease_s
        self.finder = Finder(self.books, self.io)
        self.reader = Reader(self.books, self.io, self.finder)
        self.writer = Writer(self.books, self.io)
        self.migrations = Migrations(self.books, self.io, self.writer, self.mover)
        self.layer_writes = LayerWrites(self.books, self.io, self.writer, lease_s)
        self.prefetcher = Prefetcher(
            self.reader, self.copies, self.config.prefetch, lease_s, self._promote_prefetched
        )
        self.lender = Lender(self.reader, self.layer_writes, self.migrations.schedule, lease_s)
        #: Background reads that measure tiers' read speeds for restore planning.
        self.probes = SpeedProbes(layout, self.reader, self.mover, self.config.restore)
        #: Restore planning: what a stored prefix is worth loading (``store.plan``).
        self.restorer = _restorer(self, tiers)
        #: Session hints: retain, demote, prefetch (``store.hint``).
        self.hinter = _hinter(self)
        #: What close() wrote to the persistent tier: bytes, bytes_written, seconds.
        self.close_flush: dict[str, Any] | None = None
        #: Asynchronous saves from GPU tensors, one saver per device (made on first use;
        #: None for a device whose staging ring did not fit).
        self._savers: dict[torch.device, Saver | None] = {}
        self._savers_lock = threading.Lock()  # guards _savers
        self.finder.adopt_persistent()
        self.probes.probe_at_open()

    # -- state ----------------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return list(self.io.tiers)

    @property
    def counters(self) -> ManagerCounters:
        """The cumulative counters (read them through :meth:`report` for a consistent copy)."""
        return self.books.counters

    @property
    def heat(self) -> HeatClock:
        """The heat clock (decayed access counts)."""
        return self.books.heat

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.books.closed

    def __len__(self) -> int:
        return self.books.queries.ready_count()

    def report(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A consistent copy of the counters, and per tier its usage and own figures."""
        counters = self.books.snapshot()
        with self._savers_lock:
            savers = list(self._savers.values())
        for name in SAVE_COUNTERS:
            counters[name] = sum(saver.counts[name] for saver in savers if saver is not None)
        counters["moves_pending"] = self.mover.pending
        counters["moves_failed"] = self.mover.failures
        nbytes = self.layout.block_nbytes
        usage = self.books.level_usage()
        for level, tier in enumerate(usage):
            tier["bytes"] = tier["blocks"] * nbytes
            tier["capacity_bytes"] = tier["capacity_blocks"] * nbytes
            tier.update(self.io.stats(level))
        return counters, usage

    # -- queries --------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], recheck: bool = False, skip: int = 0) -> int:
        """Number of leading ``keys`` that are stored and readable, not asking the tiers
        in the bit mask ``skip`` (see Finder.lookup)."""
        self.settle(keys)
        return self.finder.lookup(keys, recheck, skip)

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored and readable."""
        self.settle([key])
        return self.books.queries.leading([key]) == 1

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` are readable, after asking shared tiers about missing ones."""
        self.settle(keys)
        return self.finder.exists(keys)

    def where(self, key: BlockKey) -> list[int]:
        """Indexes of the tiers holding a copy of ``key`` (fastest first)."""
        return self.books.queries.where(key)

    def heat_of(self, key: BlockKey) -> int:
        """The decayed access count of ``key`` (0 if not stored)."""
        return self.books.queries.heat_of(key)

    def stored_keys(self, local: bool = False) -> list[BlockKey]:
        """Every readable key the index knows (after :meth:`rescan`, also what other
        processes stored in persistent tiers); with ``local``, only those with a copy
        in a tier of this machine (memory, local disk)."""
        return self.books.queries.stored_keys(local)

    def stored_media(self) -> list[tuple[BlockKey, Medium]]:
        """Each key held in this machine's tiers or a shared remote one, with the
        :class:`~kvstore.datapath.contracts.Medium` of its nearest copy (what a cluster node
        publishes)."""
        return self.books.queries.stored_media()

    def shared_keys(self) -> list[BlockKey]:
        """Each readable key with a copy in a shared persistent tier (S3), wherever its
        nearest copy is (what a cluster node lists in the shared set)."""
        return self.books.queries.shared_keys()

    def rescan(self) -> None:
        """Index what persistent tiers hold now (blocks other processes wrote since)."""
        self.finder.adopt_persistent()

    def pinned_blocks(self) -> int:
        """Blocks pinned right now (for tests and leak checks)."""
        self.layer_writes.reap()
        return self.books.pins.pinned_count()

    def watch(self, shared_copies: bool = False) -> ChangeFeed:
        """A new feed recording which keys gain or lose their copies in local tiers;
        every call returns its own (several watchers each drain theirs).
        ``shared_copies``: the feed also records which keys gain or lose their copy in
        a shared persistent tier (S3), wherever their nearest copy is."""
        return self.books.watch(shared_copies)

    def unwatch(self, feed: ChangeFeed) -> None:
        """Stop recording into ``feed``."""
        self.books.unwatch(feed)

    def note_tokens(self, tokens: ChunkTokens) -> None:
        """Tell every tier which tokens the chunks ``tokens.keys`` hold (a server behind a
        remote tier publishes them in its KV events); a tier that fails is counted."""
        for level in range(len(self.io.tiers)):
            self.io.note_tokens(level, tokens)

    # -- whole blocks -----------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; return how many of the keys are stored.

        Keys already stored are not written again (same key, same content).
        Blocks that fit in no tier are not stored.
        """
        stored, follow = self.writer.put(keys, blocks)
        self.migrations.schedule(follow)
        return stored

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
        prefix: bool = False,
        partial: bool = False,
    ) -> int:
        """Copy blocks into ``outs``; return how many leading blocks were loaded.

        With ``prefix=False`` every key must be stored, else
        :class:`BlockNotFoundError` is raised. With ``prefix=True`` the
        longest loadable prefix is loaded and its length returned; ``outs``
        past it hold unspecified data. ``partial`` (without ``prefix``): every key
        must still be stored when the call starts, but a block that then fails to
        load from every tier (damaged, or gone: forgotten and counted) ends the
        loaded prefix instead of raising.
        """
        self.settle(keys)
        loaded = self.reader.load(keys, outs, layers, prefix, partial)
        self.migrations.promote_later(loaded.keys, loaded.entries)
        n = loaded.count
        if not prefix and not partial and n < len(keys):
            raise BlockNotFoundError(
                f"block {n} (key {keys[n].hex()}) failed to load from every tier"
            )
        return n

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys`` from every tier; return how many were stored."""
        targets, groups = self.books.removals.begin_delete(keys)
        for level, dropped in groups.items():
            self.io.delete(level, [key for key, _ in dropped])
        return self.books.removals.end_delete(targets, groups)

    def drop_local(self, keys: Sequence[BlockKey]) -> int:
        """Delete the copies of ``keys`` in this machine's tiers (memory, local disk),
        keeping those in shared remote tiers such as S3: a cluster replica giving up
        its place. Blocks being read are skipped. Returns how many copies went."""
        _, groups = self.books.removals.begin_drop_local(keys)
        for level, dropped in groups.items():
            self.io.delete(level, [key for key, _ in dropped])
            self.books.removals.end_drop(level, [key for key, _ in dropped])
        return sum(len(dropped) for dropped in groups.values())

    def evict(self, tier_index: int, n: int) -> list[BlockKey]:
        """Evict exactly ``n`` unpinned blocks from tier ``tier_index``, or none.

        Raises :class:`~kvstore.errors.CapacityError` (changing nothing) when
        fewer than ``n`` blocks can be evicted.
        """
        follow = FollowUps()
        evicted = self.writer.evict_exactly(tier_index, n, follow)
        self.migrations.schedule(follow)
        return evicted

    def persist(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Write ``keys`` to the first persistent tier now; which are there afterwards."""
        return self.migrations.persist(keys)

    def demote(self, keys: Sequence[BlockKey]) -> int:
        """In the background, copy ``keys`` to the first persistent tier and give up their
        memory copies (an idle session's blocks); hot blocks, which other sessions read
        too (a shared system prompt), stay. How many blocks were queued."""
        self.settle(keys)
        memory = [lv for lv, t in enumerate(self.tiers) if t.device is not None and t.local]
        hot = self.placement.is_hot
        chosen = [
            k
            for k in keys
            if set(memory) & set(self.books.queries.where(k))
            and not hot(self.books.queries.heat_of(k))
        ]
        return self.migrations.demote_later(chosen, memory)

    def reencrypt(self) -> int:
        """Rewrite, in the background, blocks sealed under older keys with the active
        key, in every tier that encrypts; how many blocks are queued to be checked."""
        return sum(
            self.migrations.reencrypt(level)
            for level, tier in enumerate(self.io.tiers)
            if tier.cipher is not None
        )

    def _promote_prefetched(self, keys: Sequence[BlockKey], entries: Sequence[Entry]) -> None:
        """After a prefetch: promote, as after a get, the blocks it read from this
        machine's own slower tiers (a disk). Blocks of other machines' media (a peer, a
        bucket) are left to the plans' warming and the cluster's replication: an engine
        loads them through prefetch all the time, and a promotion reads each again."""
        tiers = self.io.tiers
        mine = [
            (key, entry)
            for key, entry in zip(keys, entries, strict=True)
            if entry.tiers and tiers[lowest_bit(entry.tiers)].local
        ]
        if mine:
            self.migrations.promote_later([k for k, _ in mine], [e for _, e in mine])

    def warm(self, keys: Sequence[BlockKey]) -> int:
        """Copy those of ``keys`` the fastest tier lacks into it, in the background; how
        many copies were queued."""
        return self.migrations.warm([k for k in keys if 0 not in self.books.queries.where(k)])

    def warm_now(self, keys: Sequence[BlockKey]) -> int:
        """:meth:`warm` on the caller's thread; how many copies landed."""
        return self.migrations.promote_now(
            [k for k in keys if 0 not in self.books.queries.where(k)], 0
        )

    def forward_hint(self, keys: Sequence[BlockKey], hint: Hint) -> int:
        """Pass a hint to the tiers outside this process that hold some of ``keys`` (a
        kvstore-server honours it in its own tiers); how many tiers were told."""
        remote = [level for level, tier in enumerate(self.tiers) if not tier.local]
        held = {
            level: [k for k in keys if level in self.books.queries.where(k)] for level in remote
        }
        for level, some in held.items():
            self.io.hint(level, some, hint)
        return sum(1 for some in held.values() if some)

    def find(self, keys: Sequence[BlockKey], levels: int) -> int:
        """Ask the tiers in the bit mask ``levels`` which leading ``keys`` they hold (what
        a plan did not ask slow tiers about), on the caller's thread; how many leading
        ``keys`` are stored now."""
        if not keys:
            return 0
        others = (1 << len(self.tiers)) - 1 & ~levels
        self.finder.discover(list(keys), skip=others)
        return self.books.queries.leading(keys)

    def chunk_pays(self, level: int, nbytes: int, tokens: tuple[int, int]) -> bool | None:
        """:meth:`Restorer.chunk_pays <kvstore.restore.Restorer.chunk_pays>`."""
        return self.restorer.chunk_pays(level, nbytes, tokens)

    def use_quota(self, ledger: QuotaLedger, owner: str) -> QuotaHook:
        """Grant room in every tier through ``owner``'s seat at ``ledger`` from now on
        (:mod:`kvstore.quota`); the seat."""
        hook = ledger.hook(owner, self.books.room.levels, self.layout.block_nbytes)
        self.books.room.use_quota(hook)
        return hook

    def promote(self, keys: Sequence[BlockKey], tier: int = 0) -> int:
        """Copy ``keys`` into tier ``tier`` now (where they are stored and not there yet);
        how many were copied."""
        return self.migrations.promote_now(keys, tier)

    # -- leases, loans, in-place puts ---------------------------------------------------
    def pin(self, keys: Sequence[BlockKey], duration: float | None = None) -> Lease:
        """Pin the leading stored ``keys`` under a lease of ``duration`` seconds
        (``config.lease_s`` by default); ``len(lease.entries)`` is how many."""
        return self.books.leases.lease(keys, duration or self.config.lease_s)

    def hold(self, keys: Sequence[BlockKey], duration: float | None = None) -> Pin:
        """:meth:`pin`, as users hold it (``KVStore.pin``)."""
        return Pin(self, self.pin(keys, duration))

    def renew(self, lease: Lease, duration: float | None = None) -> bool:
        """Extend a lease; False if it already ended (released or expired)."""
        return self.books.leases.renew(lease, duration or self.config.lease_s)

    def release(self, lease: Lease) -> None:
        """End a lease (idempotent)."""
        self.books.leases.release(lease)

    def lend(self, keys: Sequence[BlockKey], duration: float | None = None) -> Loan:
        """Pin the stored ``keys`` for zero-copy reads of their memory (see lending.py)."""
        return self.lender.lend(keys, duration)

    def begin_put(self, keys: Sequence[BlockKey]) -> PendingPut:
        """Reserve room for new blocks to be filled in place (see lending.py)."""
        return self.lender.begin_put(keys)

    # -- layer by layer -----------------------------------------------------------------
    def prefetch(
        self, keys: Sequence[BlockKey], views: list[torch.Tensor], order: str, step: int
    ) -> PrefetchHandle:
        """Start loading the stored prefix of ``keys`` into block ``views`` (see prefetch.py)."""
        self.books.check_open()
        if len(views) < len(keys):
            raise InvalidInputError("one view per key")
        self.settle(keys)
        self.finder.discover(keys)  # blocks other processes wrote count as stored
        return self.prefetcher.start(keys, views, order, step)

    def write_layer(
        self, keys: Sequence[BlockKey], layer: int, srcs: Sequence[torch.Tensor]
    ) -> int:
        """Write one layer of each block; return how many blocks this completed."""
        completed, follow = self.layer_writes.write(keys, layer, srcs)
        self.migrations.schedule(follow)
        return completed

    def abort_layers(self, keys: Sequence[BlockKey]) -> int:
        """Give up unfinished layerwise writes of ``keys``; return how many."""
        return self.layer_writes.abort(keys)

    # -- asynchronous saves from GPU tensors (see saves.py) ------------------------------
    def save(self, keys: Sequence[BlockKey], kv: torch.Tensor, donate: bool = False) -> int:
        """Save whole blocks from a CUDA tensor ``kv`` in the background; how many keys
        were queued (a block that then finds no room is counted, not stored).
        ``donate``: the caller never touches ``kv`` again (no snapshot is taken).
        Without room for the staging ring on the device, saves synchronously."""
        saver = self._saver(kv.device)
        if saver is None:
            bt = self.layout.block_tokens
            return self.put(keys, [kv[:, :, i * bt : (i + 1) * bt] for i in range(len(keys))])
        return saver.put(keys, kv, donate)

    def save_layer(
        self, keys: Sequence[BlockKey], layer: int, kv_layer: torch.Tensor, donate: bool = False
    ) -> int:
        """Save ``layer`` of blocks from a CUDA tensor in the background; how many keys
        were queued (synchronously, as :meth:`save`, without a staging ring)."""
        saver = self._saver(kv_layer.device)
        if saver is None:
            return self.write_layer(keys, layer, _split_layer(kv_layer, len(keys)))
        return saver.put_layer(keys, layer, kv_layer, donate)

    def settle(self, keys: Sequence[BlockKey]) -> None:
        """Wait until none of ``keys`` is being saved in the background."""
        if self._savers:
            for saver in list(self._savers.values()):
                if saver is not None:
                    saver.settle(keys)

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Wait until every background save queued so far has landed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._savers_lock:
            savers = list(self._savers.values())
        for saver in savers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if saver is not None and not saver.wait(left):
                return False
        return True

    def _saver(self, device: torch.device) -> Saver | None:
        """The saver of ``device`` (made on first use); None where its staging ring does
        not fit in the device's memory (logged once: saves then copy before returning)."""
        self.books.check_open()
        with self._savers_lock:
            if device in self._savers:
                return self._savers[device]
            try:
                saver: Saver | None = Saver(
                    device, self.config.saves.staging_bytes, self._saver_parts()
                )
            except torch.OutOfMemoryError:
                log.warning(
                    "saves: no room for a %d-byte staging ring on %s; saving synchronously",
                    self.config.saves.staging_bytes,
                    device,
                )
                saver = None
            self._savers[device] = saver
            return saver

    def _saver_parts(self) -> SaverParts:
        bt = self.layout.block_tokens

        def chunks(kv: torch.Tensor, n: int) -> list[torch.Tensor]:
            return [kv[:, :, i * bt : (i + 1) * bt] for i in range(n)]

        def put_blocks(keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
            return self.put(keys, blocks)

        return SaverParts(put_blocks, self.layer_writes, self.migrations.schedule, chunks, bt)

    # -- the end ----------------------------------------------------------------------
    def flush(self, progress: FlushProgress | None = None) -> int:
        """Finish background moves, then copy every block that only memory tiers
        hold into the first persistent tier; return how many were written.

        After ``flush`` (and so after :meth:`close`) every stored block is on a
        medium that outlives the process, unless no persistent tier had room
        or admitted it. ``progress`` is told the bytes to write and written.
        Background saves from GPU tensors are waited for first.
        """
        self.wait_saves()
        return self.migrations.flush(progress=progress)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for background saves from GPU tensors, then for background moves
        (write-through, promotions, evictions) to finish; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.wait_saves(timeout):
            return False
        return self.mover.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Finish background moves, persist what only memory holds, end every
        lease, wait for operations in flight, close every tier. Idempotent."""
        with self._savers_lock:
            savers = list(self._savers.values())
        for saver in savers:  # before the books close: saves still land
            if saver is not None:
                saver.close()
        if not self.books.begin_close():
            return
        self.io.prepare_close()  # an optimisation of the flush: never a reason to fail
        progress = FlushProgress()
        try:
            self.flush(progress=progress)
        except Exception:  # closing must not fail because a tier did
            log.exception("flush at close failed")
        self.close_flush = progress.summary()
        self.prefetcher.close()
        self.mover.close()
        self.io.abort(0, self.books.close())
        self.io.close()


def _hinter(manager: BlockManager) -> Hinter:
    """The manager's hint service: retention sized to a fraction of all tiers' room."""
    hints = manager.config.hints
    capacity = sum(level["capacity_blocks"] for level in manager.books.level_usage())
    manager.retention.max_blocks = max(1, int(hints.max_retained_fraction * capacity))
    parts = HinterParts(manager.exists, manager.warm, manager.demote, manager.forward_hint)
    return Hinter(parts, manager.retention, HintLimits(hints.max_retain_s, hints.max_sessions))


def _restorer(manager: BlockManager, tiers: Sequence[Tier]) -> Restorer:
    """The manager's restore planner over its own lookup, index, speeds and migrations."""
    restore, layout = manager.config.restore, manager.layout
    parts = RestorerParts(
        lookup=manager.lookup,
        where=manager.where,
        speeds=manager.io.speeds_now,
        fast=frozenset(i for i, t in enumerate(tiers) if t.device is not None),
        warm=manager.warm,
        warm_now=manager.warm_now,
        media=tuple(medium_of(t) for t in tiers),
        probe=manager.probes.probe,
        probe_tier=manager.probes.probe_tier,
        find=manager.find,
        later=manager.mover.submit_later,
        # Where CUDA exists the engine's KV is on the GPU, and a prefetch into it reads
        # the chunks of tiers below memory whole before the first layer is handed over.
        staged=cuda_available(),
        thread_reads=lambda: [speed.thread_seconds() for speed in manager.io.speeds],
        observe_loads=manager.io.observe_loads,
    )
    prefill = PrefillSpeed(
        restore.prefill_table,
        restore.prefill_tokens_per_s,
        restore.learn_prefill,
        restore.speed_half_life_s,
        manager.clock,
    )
    chunk = (layout.block_tokens, layout.block_nbytes, layout.num_layers)
    warming = Warming(restore.warm, restore.warm_wait_s, restore.warm_settle_s)
    return Restorer(parts, prefill, chunk, planning=restore.planning, warming=warming)


def _split_layer(kv_layer: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` blocks' views of one layer ``(kv, n * block_tokens, heads, dim)``."""
    step = kv_layer.shape[1] // n
    return [kv_layer[:, i * step : (i + 1) * step] for i in range(n)]
