"""The data path's front door: the value types that code outside it (the server, cluster,
events and connectors) may hold. Like vLLM's ``kv_offload/base.py``, this module holds only
such types; nothing here reaches into a store.

- :class:`Medium`: where the nearest copy of a block is, as a cluster publishes it.
- :class:`ChangeFeed`: the keys whose :class:`Medium` changed, for a watcher outside the
  store (``store.engine.datapath.watch()``).
- :class:`DataPath`: what such code may ask of a store's data path (``KVStore.engine.datapath``):
  its tiers, what is where, the change feed, moves between tiers, and the engine-facing
  reads and writes that skip the store's argument checks.
- The objects a store hands out, as their holders see them: :class:`Pin`
  (``KVStore.pin``), :class:`Loan` and :class:`PendingPut` (``KVStore.engine.lend``,
  ``KVStore.engine.begin_put``), :class:`PrefetchHandle` (``KVStore.prefetch``) and its
  :class:`Step` records. The data path's classes of those names subclass these.
- :class:`EngineSide`: what an integration (a connector, the server, a cluster node, the
  CLI) asks of a store beyond its public face (``KVStore.engine``): the data path, the
  restore planner's feedback, KV-event tokens, zero-copy loans and in-place puts.
- What the data path asks of parts given to it from outside: :class:`QuotaSeat`, an
  owner accounting's seat (:mod:`kvstore.datapath.quota`'s ``QuotaHook``) asked while a
  tier grants room, and :class:`QuotaSeats`, the accounting that hands seats out; and
  what a store asks of the data path's hint service (:class:`Hinting`).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence, Sized
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvstore.keys import BlockKey

if TYPE_CHECKING:
    import torch

    from kvstore.errors import KVStoreError
    from kvstore.hints import Hint, HintAnswer
    from kvstore.keys import ChunkTokens
    from kvstore.layout import KVLayout
    from kvstore.restore import LoadSample, PlannedLoad, RestorePlan
    from kvstore.tiers.base import LayerRange, Tier

__all__ = [
    "ChangeFeed",
    "DataPath",
    "EngineSide",
    "Hinting",
    "Loan",
    "Medium",
    "PendingPut",
    "Pin",
    "PrefetchHandle",
    "QuotaLevel",
    "QuotaSeat",
    "QuotaSeats",
    "Seat",
    "Step",
]


class Medium(enum.IntEnum):
    """Where the nearest copy of a block is, as a cluster publishes it (best last).

    ``MEMORY``: a memory tier of this machine (host DRAM, GPU); ``DISK``: a
    persistent tier of this machine; ``SHARED``: only a persistent tier of
    another machine that every node reads (S3, Redis, a server); ``NONE``: no
    copy at all.
    """

    NONE = 0
    SHARED = 1
    DISK = 2
    MEMORY = 3


class ChangeFeed:
    """Keys whose nearest copy changed :class:`Medium` (gained their first copy in a
    tier of this machine, moved between memory and disk, or lost them).

    For a watcher outside the store (a cluster node publishing what it holds):
    :class:`Index` records each change under the books' lock; :meth:`drain`
    hands over the net change since the last drain, ``(medium before, medium
    now)`` per key (a key added and removed meanwhile has equal ends).

    A feed made with ``shared_copies`` also records when a key gains or loses its
    copy in a shared persistent tier (S3) while its nearest copy stays where it was
    -- a block written through to the bucket -- and hands those over with
    :meth:`drain_shared` (a cluster node tells the shared index what the bucket
    holds as soon as it holds it). ``_lock`` guards ``_state`` and ``_shared``
    (drains come from the watcher's thread).
    """

    def __init__(self, shared_copies: bool = False) -> None:
        self.shared_copies = shared_copies
        self._state: dict[BlockKey, tuple[Medium, Medium]] = {}
        self._shared: dict[BlockKey, tuple[bool, bool]] = {}
        self._lock = threading.Lock()

    def record(
        self, key: BlockKey, before: Medium, now: Medium, shared: tuple[bool, bool] = (False, False)
    ) -> None:
        """``key``'s nearest copy went from ``before`` to ``now``; ``shared``: whether it
        had, and has, a copy in a shared persistent tier (kept by ``shared_copies``
        feeds only)."""
        if before == now and not (self.shared_copies and shared[0] != shared[1]):
            return
        with self._lock:
            first = self._state.get(key)
            self._state[key] = (before if first is None else first[0], now)
            if self.shared_copies and shared[0] != shared[1]:
                had = self._shared.get(key)
                self._shared[key] = (shared[0] if had is None else had[0], shared[1])

    def drain(self) -> dict[BlockKey, tuple[Medium, Medium]]:
        """``(medium before, medium now)`` of each key that changed since the last drain
        (keys that came back to where they were are left out)."""
        return {k: v for k, v in self.drain_shared()[0].items() if v[0] != v[1]}

    def drain_shared(
        self,
    ) -> tuple[dict[BlockKey, tuple[Medium, Medium]], dict[BlockKey, int]]:
        """What :meth:`drain` hands over, with the keys whose shared copy changed (their
        ends may be equal), and per such key +1 (it gained its shared copy) or -1 (lost
        it); keys whose shared copy came back to where it was are left out."""
        with self._lock:
            state, self._state = self._state, {}
            shared, self._shared = self._shared, {}
        moved = {k: +1 if now else -1 for k, (had, now) in shared.items() if had != now}
        return {k: v for k, v in state.items() if v[0] != v[1] or k in moved}, moved


class QuotaLevel(Protocol):
    """What an owner accounting reads of a tier's books (the data path's ``Level``)."""

    @property
    def kind(self) -> str:
        """The tier's kind (its pool)."""

    @property
    def resident(self) -> int:
        """Blocks in the tier, room reserved included."""

    @property
    def leaving(self) -> int:
        """Of ``resident``, blocks on their way out (evicted, their room not free yet)."""

    @property
    def policy(self) -> Sized:
        """The tier's eviction policy: ``len`` is the count of blocks it holds."""


class QuotaSeat(Protocol):
    """One store's seat at an owner accounting across stores that share tiers: what the
    data path asks of it while a tier grants room (under :attr:`lock`, taken inside the
    books' lock)."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The accounting's lock, held while a tier grants room."""

    def must_evict(self, level: QuotaLevel, n: int) -> int:
        """Own blocks of ``level`` to free before ``n`` more fit."""

    def refuse(self, n: int) -> None:
        """Count ``n`` blocks the quota kept out."""


#: The seat type an accounting hands out (its own class, which the data path sees as a
#: :class:`QuotaSeat`).
Seat = TypeVar("Seat", bound=QuotaSeat)
_SeatOut = TypeVar("_SeatOut", bound=QuotaSeat, covariant=True)


class QuotaSeats(Protocol[_SeatOut]):
    """An owner accounting that seats stores (:class:`kvstore.datapath.quota.QuotaLedger`)."""

    def hook(self, owner: str, levels: Sequence[QuotaLevel], block_nbytes: int) -> _SeatOut:
        """A seat for a store of ``owner`` whose tiers' books are ``levels``."""


class Hinting(Protocol):
    """What a store asks of its data path's hint service (``KVStore.hint``)."""

    def apply(self, keys: Sequence[BlockKey] | None, session: str | None, hint: Hint) -> HintAnswer:
        """Carry out ``hint`` on ``keys`` (None: the keys of ``session``'s last hint)."""

    def snapshot(self) -> dict[str, Any]:
        """Counters, and the blocks retained now, as ``stats()`` shows them."""


class DataPath(Protocol):
    """What code outside the data path (the server, cluster, events, connectors) may ask of
    a store's: ``KVStore.engine.datapath``. Keys are the store's; nothing here checks arguments
    as :class:`~kvstore.KVStore` does, so callers hand well-formed keys and views."""

    @property
    def layout(self) -> KVLayout:
        """The store's KV layout."""

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""

    @property
    def close_flush(self) -> dict[str, Any] | None:
        """What the close's flush did (None before a close)."""

    def __len__(self) -> int:
        """Blocks stored."""

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored."""

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether it is stored (anywhere, not only as a prefix)."""

    def where(self, key: BlockKey) -> list[int]:
        """The tiers (levels, fastest first) that hold ``key``."""

    def stored_keys(self, local: bool = False) -> list[BlockKey]:
        """Every stored key (``local``: only those with a copy in this machine's tiers)."""

    def stored_media(self) -> list[tuple[BlockKey, Medium]]:
        """Each key held here or in a shared tier, with the :class:`Medium` of its nearest
        copy."""

    def shared_keys(self) -> list[BlockKey]:
        """Each readable key with a copy in a shared persistent tier (S3), wherever its
        nearest copy is."""

    def watch(self, shared_copies: bool = False) -> ChangeFeed:
        """A new :class:`ChangeFeed` of this store's changes (one per watcher);
        ``shared_copies``: it records shared copies too (:meth:`ChangeFeed.drain_shared`)."""

    def unwatch(self, feed: ChangeFeed) -> None:
        """Stop ``feed``."""

    def promote(self, keys: Sequence[BlockKey], tier: int = 0) -> int:
        """Copy ``keys`` into tier ``tier`` now; how many landed."""

    def persist(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Write ``keys`` to the first persistent tier now; which are there afterwards."""

    def drop_local(self, keys: Sequence[BlockKey]) -> int:
        """Give up this machine's copies of ``keys`` (shared tiers keep theirs); how many."""

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
        prefix: bool = False,
        partial: bool = False,
    ) -> int:
        """Copy blocks into ``outs``; how many leading blocks were loaded."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Store ``blocks`` under ``keys``; how many were stored."""

    def chunk_pays(self, level: int, nbytes: int, tokens: tuple[int, int]) -> bool | None:
        """Whether reading one chunk from tier ``level`` beats recomputing ``tokens``;
        None when restore planning cannot tell."""

    def use_quota(self, ledger: QuotaSeats[Seat], owner: str) -> Seat:
        """Grant room in every tier through ``owner``'s seat at ``ledger`` from now on;
        the seat."""

    def pinned_blocks(self) -> int:
        """Blocks pinned right now (loans, reservations, reads and writes in flight): what
        a leak check expects back at 0 once its clients are gone."""


class EngineSide(Protocol):
    """What an integration asks of a store beyond its public face: ``KVStore.engine``.

    The connectors (vLLM, SGLang), the server, a cluster node and the CLI use it; an
    application calling ``put`` / ``get`` / ``plan`` does not. Like :class:`DataPath`,
    it is a protocol, so ``mypy`` refuses a call past it."""

    @property
    def datapath(self) -> DataPath:
        """The store's data path: its tiers, what is where, the change feed, moves."""

    def note_tokens(self, tokens: ChunkTokens) -> None:
        """Record which tokens the chunks ``tokens.keys`` hold, for KV events (this store's
        publisher and a kvstore-server behind a remote tier); before they are put."""

    def note_prefill_step(self, tokens: int, seconds: float) -> None:
        """One engine step computed ``tokens`` in ``seconds``: what a learned prefill
        speed is fitted to (ignored when ``restore`` declares one)."""

    def waited(self, plan: RestorePlan, waited_s: float) -> None:
        """The engine waited ``waited_s`` for a load of ``plan`` under compute: the
        tiers' prices follow what it cost."""

    def planned_load(self, plan: RestorePlan) -> PlannedLoad[str]:
        """What ``plan`` expects of its load, per tier id, for a process that loads it
        (vLLM's workers), whose samples come back through :meth:`observe_loads`."""

    def observe_loads(self, loads: Mapping[str, LoadSample]) -> None:
        """Restores another process loaded (``{tier id: LoadSample}``)."""

    def read_totals(self) -> dict[str, tuple[float, float, int]]:
        """Every read so far per tier (``kind:n``): ``(bytes, seconds, calls)``."""

    def observe_reads(self, reads: Mapping[str, tuple[float, float, int]]) -> None:
        """Feed another process's :meth:`read_totals` into this store's tier speeds."""

    def restore_speeds(self) -> dict[str, Any]:
        """What a cluster node publishes for routers: per kind of medium the live
        ``[GB/s, ms a call]`` of the fastest tier of that kind, and
        ``prefill_tokens_per_s`` (None: unknown)."""

    def lend(self, keys: Sequence[BlockKey], lease_s: float | None = None) -> Loan:
        """Pin the stored blocks among ``keys`` and lend views of the host memory holding
        them; ``loan.release()`` when done (the lease ends it otherwise)."""

    def begin_put(self, keys: Sequence[BlockKey]) -> PendingPut:
        """Reserve room for new blocks, to fill in place and then commit."""

    def reencrypt(self) -> int:
        """Rewrite blocks sealed under older keys with the active key, in the background;
        how many blocks are queued to be checked."""


class Pin(Protocol):
    """A lease as users hold it: ``with store.pin(keys) as pin: ...``.

    ``count`` leading keys are pinned (those stored when pinned): they are
    not evicted or deleted until :meth:`release`, or until the lease expires
    (``lease_s``; :meth:`renew` extends it).
    """

    @property
    def count(self) -> int:
        """How many leading keys are pinned."""

    @property
    def active(self) -> bool:
        """False once released or expired."""

    def renew(self, seconds: float | None = None) -> bool:
        """Extend the lease; False if it already ended."""

    def release(self) -> None:
        """Unpin now (idempotent)."""

    def __enter__(self) -> Pin:
        """The pin itself."""

    def __exit__(self, *exc: object) -> None:
        """:meth:`release`."""


class Loan(Protocol):
    """Stored blocks lent out for zero-copy reads (``KVStore.engine.lend``), pinned under one
    lease until :meth:`release` or the lease's end.

    ``found[i]``: key ``i`` is stored and pinned. ``views[i]``: its bytes in host memory
    (a tensor of ``layout.block_shape``, valid until the release), or None when only
    slower tiers hold it (:meth:`read_into` then makes a verified read).
    """

    layout: KVLayout
    keys: list[BlockKey]
    found: list[bool]
    views: list[torch.Tensor | None]

    def read_into(self, i: int, out: torch.Tensor, layers: LayerRange = None) -> bool:
        """Verified read of lent block ``i`` (or its ``layers``) into ``out``; False if
        every copy failed (the block is then no longer stored)."""

    def read_many(
        self, idxs: list[int], outs: list[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        """:meth:`read_into` for several blocks in one batch per tier (one round trip
        to a disk's thread pool, a peer or S3 for all of them)."""

    def renew(self) -> bool:
        """Extend the lease by the store's ``lease_s``; False if it already ended."""

    @property
    def released(self) -> bool:
        """True once released (the views must not be used any more)."""

    def release(self) -> None:
        """Unpin the blocks (idempotent). The views must not be used afterwards."""

    def __enter__(self) -> Loan:
        """The loan itself."""

    def __exit__(self, *exc: object) -> None:
        """:meth:`release`."""


class PendingPut(Protocol):
    """Room for new whole blocks (``KVStore.engine.begin_put``), filled in place, then committed.

    ``views[i]``: where block ``i`` goes (``layout.block_shape``, contiguous), or None
    when key ``i`` is already stored or being written (nothing to do). The blocks become
    visible to lookups at :meth:`commit`, never before.
    """

    keys: list[BlockKey]
    views: list[torch.Tensor | None]

    def commit(self, ok: Sequence[bool] | None = None) -> int:
        """Publish the blocks whose ``ok[i]`` is true (all by default); abort the others.

        Returns how many blocks this put stored. Idempotent: a second call (or
        one after :meth:`abort`) stores nothing.
        """

    def abort(self) -> None:
        """Give back every reserved room; nothing is stored (idempotent)."""

    def __enter__(self) -> PendingPut:
        """The put itself."""

    def __exit__(self, *exc: object) -> None:
        """:meth:`abort` (a no-op after a commit)."""


@dataclass(frozen=True)
class Step:
    """One step of a prefetch, as it happened: blocks ``[first_block, last_block)``,
    layers ``[first_layer, last_layer)``, and when it began and ended
    (``time.perf_counter()`` seconds)."""

    first_block: int
    last_block: int
    first_layer: int
    last_layer: int
    began: float
    ended: float


class PrefetchHandle(Protocol):
    """A background load of ``len(keys)`` blocks into ``out`` (``KVStore.prefetch``).
    Thread-safe.

    ``valid_blocks`` is the length of the prefix that can still be (or has
    been) loaded: it starts at the number of blocks stored when the prefetch
    began and drops if a block turns out missing or corrupt. ``blocks_ready``
    is how many leading blocks are fully loaded now. ``steps`` records each
    finished step (for timelines). ``load_s``: seconds from the start to the
    loader's end (None until it ended).
    """

    keys: list[BlockKey]
    num_layers: int
    out: torch.Tensor | None
    load_s: float | None

    @property
    def waited_s(self) -> float:
        """Seconds callers of the waits below were blocked so far: what a load under
        compute cost the engine (``KVStore.engine.waited`` prices the tiers by it)."""

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""

    @property
    def done(self) -> bool:
        """True when the load finished (completely, after a failure, or cancelled)."""

    @property
    def valid_blocks(self) -> int:
        """Length of the prefix that is (or will be) loaded correctly."""

    @property
    def blocks_ready(self) -> int:
        """Leading blocks fully loaded, every layer, now."""

    @property
    def error(self) -> KVStoreError | None:
        """Why ``valid_blocks`` is shorter than expected (a vanished or corrupt block)."""

    @property
    def steps(self) -> list[Step]:
        """The steps finished so far, in the order they finished."""

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until ``layer`` of every valid block is in place; False on timeout.

        Also returns (True) when the load ended early: check ``valid_blocks``.
        """

    def wait_layer_on(self, layer: int, stream: object | None = None) -> None:
        """Make ``stream`` (None: the current stream) wait until ``layer`` of every
        valid block is in place, without waiting on the CPU for the copies.

        With a CUDA destination this is a GPU-side wait (``stream.wait_event``):
        the calling thread blocks only until the layer's copies are *queued*,
        and at that point ``valid_blocks`` is final for the layer (blocks from
        slower tiers are read and verified before their copies are queued). An
        engine calls it before running layer ``layer`` on ``stream``. On CPU it
        is :meth:`wait_layer` (nothing to wait on but the thread). Returns when
        the load ended early too: check ``valid_blocks``.
        """

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load ends; False on timeout."""

    def cancel(self) -> None:
        """Stop loading after the step in flight; the lease is released when it ends."""

    def result(self, num_tokens: int | None = None) -> int:
        """Apply the store's prefetch policy; return the usable prefix, in blocks.

        ``best_effort`` takes what is ready now and cancels the rest;
        ``wait_complete`` waits for everything; ``timeout`` waits up to the
        deadline for ``num_tokens`` tokens (default: the whole prefix), then
        takes what is ready.
        """

    def __enter__(self) -> PrefetchHandle:
        """The handle itself."""

    def __exit__(self, *exc: object) -> None:
        """:meth:`cancel`, then :meth:`wait`."""
