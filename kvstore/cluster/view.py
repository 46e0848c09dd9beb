"""A copy of one store's shared index in this process's memory, fed by Redis's change stream.

Lookups (:meth:`IndexView.holders`, :meth:`IndexView.lookup`) read a dict and
never wait on the network: a 512-chunk prompt is looked up in tens of
microseconds instead of a Redis round trip per node. A follower thread reads
the store's change stream (``XREAD BLOCK``) and applies each change in order;
every ``heartbeat_s`` it re-reads the live nodes and checks that the stream
has not lost entries past the position it had then. It loads a fresh
:class:`~kvstore.cluster.index.Snapshot` when it starts, when the stream was
trimmed past its position (it fell behind), and when Redis was unreachable
(it may have restarted empty). While Redis is away the copy goes on answering
from what it last knew: the index is a hint that every fetch verifies.

Layout: each key maps to one int. Bit 0 says the key is in shared storage
(S3); each node has a slot ``s`` (from 1): bit ``2s`` says it holds the key,
bit ``2s + 1`` that the nearest copy is in memory. A node whose entries are
replaced (it re-registered, left, or was away past its lease) gets a new slot,
so its old bits are void at once without a scan; the copy is rebuilt when
void slots pile up. Live nodes are a mask over slots, refreshed every
heartbeat: a node whose lease ran out drops out of every answer.

Threads: the follower thread is the only writer. ``_lock`` guards the slot
tables and the live mask; ``_bits`` is replaced whole on a reload (with the
live nodes, under the lock: the slots are numbered anew) and otherwise changed
one key at a time, so readers need no lock for it once they hold the table
that goes with the nodes they read (:meth:`IndexView.lookup`; a reader may
see a change half applied across keys, as it could across two reads of Redis).

The copy trails Redis: by the stream's lag, and while a node registers again
(its reset entry voids its old slot; its keys follow in the next entries). A
get that finds no holder in the copy asks Redis before it gives up
(:class:`~kvstore.cluster.tier.ClusterTier`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.cluster.index import Change, ClusterIndex, NodeInfo, Snapshot
from kvstore.datapath.contracts import Medium
from kvstore.errors import TierError
from kvstore.keys import BlockKey

__all__ = ["Holding", "IndexView"]

log = logging.getLogger(__name__)

_SHARED = 1
_SPARE_SLOTS = 64  # void slots tolerated (beyond the live ones) before a rebuild
_SNAPSHOT_TRIES = 3  # snapshots retaken while nodes register during a reload


@dataclass(frozen=True)
class Holding:
    """One node's copy of a block: the node and the medium of its nearest copy."""

    node: NodeInfo
    medium: Medium


class IndexView:
    """The shared index of one (namespace, layout) in memory (see the module docstring)."""

    def __init__(self, index: ClusterIndex, namespace: str, fp: str) -> None:
        self.index = index
        self.namespace = namespace
        self.fp = fp
        self._heartbeat_s = index.config.heartbeat_s
        self._lock = threading.Lock()  # guards _slots, _nodes, _live_mask, _next_slot
        self._bits: dict[BlockKey, int] = {}
        self._slots: dict[str, int] = {}
        self._nodes: dict[int, NodeInfo] = {}  # live slot -> node
        self._live_mask = 0
        self._next_slot = 1
        self._position = "0-0"
        self._checked_at = "0-0"  # the position at the last check (or load)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._synced = False
        self.reloads = 0
        self.changes_applied = 0

    # -- life ----------------------------------------------------------------------------
    def start(self) -> None:
        """Load the index now (TierError if Redis is unreachable: the follower keeps
        trying), then follow the stream on a daemon thread."""
        try:
            self._reload()
        finally:
            self._thread = threading.Thread(
                target=self._follow, name=f"kvstore-index-{self.namespace}", daemon=True
            )
            self._thread.start()

    @property
    def synced(self) -> bool:
        """True while the copy follows the stream (False until loaded, or after an error
        until reloaded)."""
        return self._synced

    def close(self) -> None:
        """Stop following (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- lookups ---------------------------------------------------------------------
    def nodes(self) -> dict[str, NodeInfo]:
        """The live nodes, by id."""
        with self._lock:
            return {info.node_id: info for info in self._nodes.values()}

    def live(self) -> tuple[dict[int, NodeInfo], int]:
        """Live slots -> nodes, and the mask of their "holds" bits (for :meth:`bits`)."""
        with self._lock:
            return dict(self._nodes), self._live_mask

    def bits(self, keys: Sequence[BlockKey]) -> list[int]:
        """Each key's bits (see the module docstring); 0 for keys nobody holds."""
        return _get_bits(self._bits, keys)

    def lookup(self, keys: Sequence[BlockKey]) -> tuple[dict[int, NodeInfo], int, list[int]]:
        """:meth:`live` and :meth:`bits` taken together: a reload numbers the slots anew,
        and bits read after it must not be paired with nodes read before it."""
        with self._lock:
            nodes, live, table = dict(self._nodes), self._live_mask, self._bits
        return nodes, live, _get_bits(table, keys)

    def held(self, keys: Sequence[BlockKey], which: Callable[[NodeInfo], bool]) -> list[bool]:
        """Which keys some live node that ``which`` accepts holds (one mask test a key)."""
        nodes, _, bits = self.lookup(keys)
        mask = sum(1 << (2 * slot) for slot, info in nodes.items() if which(info))
        return [bool(b & mask) for b in bits]

    def holders(self, keys: Sequence[BlockKey]) -> list[list[Holding]]:
        """For each key, the live nodes that hold it (memory before disk)."""
        nodes, live, table = self.lookup(keys)
        out: list[list[Holding]] = []
        for bits in table:
            held = bits & live
            found: list[Holding] = []
            while held:
                low = held & -held
                slot = low.bit_length() // 2
                medium = Medium.MEMORY if bits & (low << 1) else Medium.DISK
                found.append(Holding(nodes[slot], medium))
                held ^= low
            found.sort(key=lambda h: -h.medium)
            out.append(found)
        return out

    def shared(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which keys some node found in shared storage (S3)."""
        return [bool(b & _SHARED) for b in self.bits(keys)]

    # -- following ------------------------------------------------------------------
    def _follow(self) -> None:
        checked = time.monotonic()
        block_ms = max(1, min(1000, round(self._heartbeat_s * 500)))
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self._reload()
                elif time.monotonic() - checked >= self._heartbeat_s:
                    checked = time.monotonic()
                    self._check()
                changes = self.index.read_changes(self.namespace, self.fp, self._position, block_ms)
                for position, change in changes:
                    self._apply(change)
                    self._position = position
                self.changes_applied += len(changes)
            except TierError as exc:
                if self._synced:
                    log.warning("cluster index copy: %s; reloading when Redis is back", exc)
                self._synced = False
                self._stop.wait(min(1.0, self._heartbeat_s))

    def _check(self) -> None:
        """Refresh the live nodes; reload if the stream no longer keeps the position of
        the last check (entries after it may have gone before this copy read them: it
        fell behind), or is gone (Redis restarted empty)."""
        self._set_live(self.index.live_nodes())
        # Trimming keeps the newest entries: once the oldest kept one is newer than
        # where this copy stood at the last check, what lay between may be lost to it.
        start = self.index.stream_start(self.namespace, self.fp)
        behind = start is not None and self._checked_at != "0-0" and _older(self._checked_at, start)
        gone = start is None and self._position != "0-0"
        self._checked_at = self._position
        if behind or gone or self._void_slots() > _SPARE_SLOTS + len(self._nodes):
            self._synced = False

    def _reload(self) -> None:
        """Load a snapshot of the nodes that are live once its stream position is read.

        A node registers by a heartbeat, then its entries (a reset, then its keys). One
        that was not live when the list was read, but registered before the snapshot
        read the stream's position, is in neither the snapshot nor the stream after that
        position: its entries would be missing from the copy until it registered again.
        So the live nodes are read again after the snapshot, and the snapshot retaken
        while that names a node it left out."""
        live = self.index.live_nodes()
        for _ in range(_SNAPSHOT_TRIES):
            snap = self.index.snapshot(self.namespace, self.fp, list(live))
            after = self.index.live_nodes()
            complete = after.keys() <= live.keys()
            live = after if complete else {**live, **after}
            if complete:
                break
        self._load(snap, live)
        self.reloads += 1
        self._synced = complete  # still short of a node: reload again at once

    def _load(self, snap: Snapshot, live: dict[str, NodeInfo]) -> None:
        bits: dict[BlockKey, int] = dict.fromkeys(snap.shared, _SHARED)
        with self._lock:
            self._slots, self._next_slot = {}, 1
            for node, held in snap.held.items():
                slot = self._new_slot(node)
                for key, medium in held.items():
                    bits[key] = bits.get(key, 0) | _slot_bits(slot, medium)
            self._position = self._checked_at = snap.position
            # The slots were numbered anew: the bits and the live nodes change together,
            # or a reader could pair a new slot's bits with the node of its old number.
            self._bits = bits
            self._live_locked(live)

    def _set_live(self, live: dict[str, NodeInfo]) -> None:
        with self._lock:
            self._live_locked(live)

    def _live_locked(self, live: dict[str, NodeInfo]) -> None:
        nodes = {self._slot(n): info for n, info in live.items()}
        self._nodes = nodes
        self._live_mask = sum(1 << (2 * s) for s in nodes)

    def _apply(self, change: Change) -> None:
        with self._lock:
            slot = self._new_slot(change.node) if change.reset else self._slot(change.node)
            if change.reset and change.node in {i.node_id for i in self._nodes.values()}:
                self._nodes = {
                    (slot if i.node_id == change.node else s): i for s, i in self._nodes.items()
                }
                self._live_mask = sum(1 << (2 * s) for s in self._nodes)
        clear = ~_slot_bits(slot, Medium.MEMORY)
        bits = self._bits
        for key, medium, shared in zip(change.keys, change.media, change.shared, strict=True):
            value = (bits.get(key, 0) & clear) | _slot_bits(slot, medium)
            value = value | _SHARED if shared > 0 else value & ~_SHARED if shared < 0 else value
            if value:
                bits[key] = value
            else:
                bits.pop(key, None)

    def _slot(self, node: str) -> int:
        slot = self._slots.get(node)
        return slot if slot is not None else self._new_slot(node)

    def _new_slot(self, node: str) -> int:
        slot = self._slots[node] = self._next_slot
        self._next_slot += 1
        return slot

    def _void_slots(self) -> int:
        with self._lock:
            return self._next_slot - 1 - len(self._slots)


def _get_bits(table: dict[BlockKey, int], keys: Sequence[BlockKey]) -> list[int]:
    return list(map(table.get, keys, itertools.repeat(0, len(keys))))  # in C


def _slot_bits(slot: int, medium: Medium) -> int:
    if medium == Medium.MEMORY:
        return 3 << (2 * slot)
    if medium == Medium.DISK:
        return 1 << (2 * slot)
    return 0


def _older(position: str, than: str) -> bool:
    """Whether stream position ``position`` comes before ``than``."""
    a, _, b = position.partition("-")
    c, _, d = than.partition("-")
    return (int(a), int(b or 0)) < (int(c), int(d or 0))
