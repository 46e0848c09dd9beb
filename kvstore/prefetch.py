"""Asynchronous, layer-by-layer loads (prefetch) and stores (layerwise writes).

**Prefetch.** ``KVStore.prefetch(keys, out)`` pins the stored prefix of
``keys`` under a lease and loads it into ``out`` on a background thread, a
step of ``layers_per_step`` layers at a time for every block (``order="layer"``)
-- so an engine can run layer ``i`` while layer ``i+1`` is still arriving --
or a block at a time (``order="block"``), so a partial prefix is usable
early. Each block comes from its fastest verified copy, falling back to slower
ones. On a GPU the copies run on the handle's own CUDA stream (the engine's
stream is not blocked); without one, on the thread -- same API.

**Layerwise writes.** ``KVStore.put_layer(keys, layer, kv_layer)`` takes one
layer of several blocks at a time, as prefill produces them. The first layer
of a block reserves its room (a slot in the first memory tier, written in
place, else a host staging buffer); the block becomes visible to ``lookup``
only when every layer has arrived. A write abandoned half way (a request that
was aborted) expires after ``lease_s`` and gives its room back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.config import PrefetchConfig
from kvstore.errors import BlockNotFoundError, InvalidInputError, KVStoreError
from kvstore.index import WRITING, Entry, Move
from kvstore.keys import BlockKey
from kvstore.leases import Lease

if TYPE_CHECKING:
    from kvstore.manager import BlockManager

__all__ = ["LayerWrites", "Partial", "PrefetchHandle", "Prefetcher"]


class PrefetchHandle:
    """A background load of ``len(keys)`` blocks into ``out``. Thread-safe.

    ``valid_blocks`` is the length of the prefix that can still be (or has
    been) loaded: it starts at the number of blocks stored when the prefetch
    began and drops if a block turns out missing or corrupt. ``blocks_ready``
    is how many leading blocks are fully loaded now.
    """

    def __init__(
        self, keys: Sequence[BlockKey], valid: int, num_layers: int, config: PrefetchConfig
    ) -> None:
        self.keys = list(keys)
        self.num_layers = num_layers
        self.config = config
        self.out: torch.Tensor | None = None  # the destination (set by KVStore.prefetch)
        # One lock guards every field below; layer waiters and whole-load waiters
        # wait on separate conditions so that wait() sleeps through per-layer progress.
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._end = threading.Condition(lock)
        self._valid = valid
        self._layers_done = 0
        self._blocks_done = 0
        self._done = False
        self._cancelled = False
        self._error: KVStoreError | None = None

    # -- progress (called by the loader) -------------------------------------
    def _progress(self, layers_done: int, blocks_done: int, failed_at: int | None) -> None:
        with self._cond:
            if failed_at is not None and failed_at < self._valid:
                self._valid = failed_at
                key = self.keys[failed_at].hex()
                self._error = BlockNotFoundError(f"block {failed_at} ({key}) failed to load")
            self._layers_done = max(self._layers_done, layers_done)
            self._blocks_done = max(self._blocks_done, min(blocks_done, self._valid))
            self._cond.notify_all()

    def _finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
            self._end.notify_all()

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        with self._cond:
            return self._cancelled

    # -- the consumer's side ---------------------------------------------------
    @property
    def done(self) -> bool:
        """True when the load finished (completely, after a failure, or cancelled)."""
        with self._cond:
            return self._done

    @property
    def valid_blocks(self) -> int:
        """Length of the prefix that is (or will be) loaded correctly."""
        with self._cond:
            return self._valid

    @property
    def blocks_ready(self) -> int:
        """Leading blocks fully loaded, every layer, now."""
        with self._cond:
            return self._blocks_done

    @property
    def error(self) -> KVStoreError | None:
        """Why ``valid_blocks`` is shorter than expected (a vanished or corrupt block)."""
        with self._cond:
            return self._error

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until ``layer`` of every valid block is in place; False on timeout.

        Also returns (True) when the load ended early: check ``valid_blocks``.
        """
        if not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer {layer} out of range [0, {self.num_layers})")
        with self._cond:
            return self._cond.wait_for(lambda: self._layers_done > layer or self._done, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load ends; False on timeout."""
        with self._end:
            return self._end.wait_for(lambda: self._done, timeout)

    def cancel(self) -> None:
        """Stop loading after the step in flight; the lease is released when it ends."""
        with self._cond:
            self._cancelled = True

    def result(self, num_tokens: int | None = None) -> int:
        """Apply the store's prefetch policy; return the usable prefix, in blocks.

        ``best_effort`` takes what is ready now and cancels the rest;
        ``wait_complete`` waits for everything; ``timeout`` waits up to the
        deadline for ``num_tokens`` tokens (default: the whole prefix), then
        takes what is ready.
        """
        policy = self.config.policy
        if policy == "wait_complete":
            self.wait()
        elif policy == "timeout":
            tokens = num_tokens if num_tokens is not None else 0
            self.wait(self.config.deadline_s(tokens))
        if not self.done:
            self.cancel()
        return self.blocks_ready

    def __enter__(self) -> PrefetchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
        self.wait()


class Prefetcher:
    """Runs prefetches for one manager on ``config.threads`` threads."""

    def __init__(self, manager: BlockManager, config: PrefetchConfig) -> None:
        self.m = manager
        self.config = config
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-prefetch")
        self._live: set[PrefetchHandle] = set()
        self._lock = threading.Lock()  # guards _live

    def start(
        self, keys: Sequence[BlockKey], views: list[torch.Tensor], order: str, step: int
    ) -> PrefetchHandle:
        """Pin the stored prefix of ``keys`` and load it into the block ``views``."""
        lease = self.m.pin(keys)
        handle = PrefetchHandle(keys, len(lease.entries), self.m.layout.num_layers, self.config)
        with self._lock:
            self._live.add(handle)
        self._pool.submit(self._run, handle, lease, views, (order, step))
        return handle

    def _run(
        self,
        handle: PrefetchHandle,
        lease: Lease,
        views: list[torch.Tensor],
        plan: tuple[str, int],
    ) -> None:
        # An engine that made ``out`` under torch.inference_mode() (vLLM does) gets an
        # "inference tensor": copying into it in place is refused outside that mode, and
        # the mode is per thread. The loader runs in the mode its destination was made in.
        inference = bool(views) and views[0].is_inference()
        try:
            device = views[0].device if views else torch.device("cpu")
            with torch.inference_mode(inference):
                if device.type == "cuda":  # copies on a side stream: the engine's runs on
                    with torch.cuda.stream(torch.cuda.Stream(device)):  # type: ignore[no-untyped-call]
                        self._load(handle, lease, views, plan)
                else:
                    self._load(handle, lease, views, plan)
        finally:
            self.m.release(lease)
            handle._finish()
            with self._lock:
                self._live.discard(handle)

    def _load(
        self,
        handle: PrefetchHandle,
        lease: Lease,
        views: list[torch.Tensor],
        plan: tuple[str, int],
    ) -> None:
        order, step = plan
        layers = self.m.layout.num_layers
        if order == "layer":
            for first in range(0, layers, step):
                last = min(layers, first + step)
                if not self._step(handle, lease, views, (0, handle.valid_blocks), (first, last)):
                    return
            handle._progress(layers, handle.valid_blocks, None)
        else:
            for first in range(0, handle.valid_blocks, step):
                span = (first, min(handle.valid_blocks, first + step))
                if not self._step(handle, lease, views, span, None):
                    return

    def _step(
        self,
        handle: PrefetchHandle,
        lease: Lease,
        views: list[torch.Tensor],
        blocks: tuple[int, int],
        layers: tuple[int, int] | None,
    ) -> bool:
        """Load one step; False when the load must stop (cancelled or nothing left)."""
        lo, hi = blocks[0], min(blocks[1], handle.valid_blocks)
        if handle.cancelled or lo >= hi:
            return False
        if lease.expiry - self.m.clock() < self.m.config.lease_s / 2:  # rarely: keep it alive
            self.m.renew(lease)
        outs = [v if layers is None else v[layers[0] : layers[1]] for v in views[lo:hi]]
        ok = self.m.read(handle.keys[lo:hi], lease.entries[lo:hi], outs, layers)
        bad = next((lo + i for i, good in enumerate(ok) if not good), None)
        if layers is None:
            handle._progress(0, bad if bad is not None else hi, bad)
        else:
            handle._progress(layers[1], 0, bad)
        return True

    def close(self) -> None:
        """Cancel live prefetches and stop the threads."""
        with self._lock:
            live = list(self._live)
        for handle in live:
            handle.cancel()
        self._pool.shutdown(wait=True)


@dataclass(eq=False)
class Partial:
    """A block arriving layer by layer."""

    key: BlockKey
    entry: Entry
    view: torch.Tensor | None  # where the layers go; None while room is being made
    reserved: bool  # view is a reserved slot of tier 0 (else host staging)
    missing: int  # bit l: layer l not written yet
    expiry: float
    writers: int = 0  # copies in flight into view


class LayerWrites:
    """Blocks being written layer by layer. Fields are guarded by the manager's lock."""

    def __init__(self, manager: BlockManager) -> None:
        self.m = manager
        self._partials: dict[BlockKey, Partial] = {}

    def write(self, keys: Sequence[BlockKey], layer: int, srcs: Sequence[torch.Tensor]) -> int:
        """Write ``layer`` of each block; return how many blocks this completed."""
        m = self.m
        with m._cond:
            m._check_open()
            self._reap()
            parts, new = self._claim(keys)
        if new:
            self._make_room(new)
        with m._cond:
            while any(p.view is None for p in parts):
                m._cond.wait()
            for part in parts:
                part.writers += 1
        try:
            for part, src in zip(parts, self._sources(keys, parts, srcs), strict=True):
                assert part.view is not None
                part.view[layer].copy_(src)
        finally:
            with m._cond:
                done = self._mark(parts, layer)
        return self._complete(done)

    def begin(self, keys: Sequence[BlockKey]) -> list[Partial | None]:
        """Whole-block two-step store, step 1: room for each new key (None for keys
        stored, being written, or listed twice). Each part has a ``view`` to fill
        and counts as a writer until :meth:`finish`."""
        m = self.m
        with m._cond:
            m._check_open()
            self._reap()
            _, new = self._claim(keys)
        if new:
            self._make_room(new)
        with m._cond:
            for part in new:
                part.writers += 1
        fresh = {p.key: p for p in new}
        return [fresh.pop(key, None) for key in keys]

    def finish(self, parts: list[Partial], ok: list[bool]) -> int:
        """Step 2: publish the parts whose ``ok`` is true, abort the others; return
        how many blocks were stored."""
        m = self.m
        with m._cond:
            done, failed = [], []
            for part, good in zip(parts, ok, strict=True):
                part.writers -= 1
                if self._partials.get(part.key) is not part:
                    continue  # aborted meanwhile (the store is closing)
                if good:
                    part.missing = 0
                    del self._partials[part.key]
                    done.append(part)
                else:
                    failed.append(part)
            self._abort(failed)
        return self._complete(done)

    @staticmethod
    def _sources(
        keys: Sequence[BlockKey], parts: list[Partial], srcs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        by_key = dict(zip(keys, srcs, strict=True))
        return [by_key[p.key] for p in parts]

    def _claim(self, keys: Sequence[BlockKey]) -> tuple[list[Partial], list[Partial]]:
        """The partial writes for ``keys`` (creating new ones). Lock held."""
        m = self.m
        parts, new = [], []
        expiry = m.clock() + m.config.lease_s
        full = (1 << m.layout.num_layers) - 1
        for key in dict.fromkeys(keys):
            part = self._partials.get(key)
            entry = m._index.get(key)
            if part is None and entry is None:
                entry = m._index[key] = Entry(WRITING, pins=1)
                m.heat.touch(entry)
                part = self._partials[key] = Partial(key, entry, None, False, full, expiry)
                new.append(part)
            if part is not None:  # else stored already, or being written by a plain put
                part.expiry = expiry
                parts.append(part)
        return parts, new

    def _make_room(self, new: list[Partial]) -> None:
        """Reserve slots in tier 0 for new blocks (host staging where it has none)."""
        m = self.m
        level = m._levels[0]
        grant = 0
        try:
            with m._cond:
                grant, victims = m._reserve(level, len(new))
            if victims:
                m._moves.evict_victims(level, victims)
            m._wait_room(level)
        finally:
            self._assign_views(new, grant)

    def _assign_views(self, new: list[Partial], grant: int) -> None:
        """Hand each new block its reserved slot, or a staging buffer; wake waiters."""
        m = self.m
        level = m._levels[0]
        with m._cond:
            views = level.tier.reserve([p.key for p in new[:grant]]) if grant else []
            for i, part in enumerate(new):
                view = views[i] if i < len(views) else None
                if i < grant and view is None:
                    level.resident -= 1  # the tier could not hand out memory: give the room back
                part.reserved = view is not None
                part.view = view if view is not None else self._staging()
            m._cond.notify_all()

    def _staging(self) -> torch.Tensor:
        return torch.empty(self.m.layout.block_shape, dtype=self.m.layout.dtype)

    def _mark(self, parts: list[Partial], layer: int) -> list[Partial]:
        """Record ``layer`` as written; return (and forget) completed blocks. Lock held."""
        done = []
        for part in parts:
            part.writers -= 1
            part.missing &= ~(1 << layer)
            if not part.missing and self._partials.get(part.key) is part:
                del self._partials[part.key]
                done.append(part)
        return done

    def _complete(self, done: list[Partial]) -> int:
        """Publish completed blocks: commit reserved slots, place staged ones."""
        if not done:
            return 0
        m = self.m
        level = m._levels[0]
        moves = {id(p): Move(p.key, p.entry, p.view) for p in done if p.view is not None}
        reserved = [moves[id(p)] for p in done if p.reserved]
        staged = [moves[id(p)] for p in done if not p.reserved]
        with m._cond:
            ok = level.tier.commit([mv.key for mv in reserved]) if reserved else []
        landed = m._commit_writes(level, reserved, ok) if reserved else set()
        left = m._place(0, staged) if staged else []
        failed = [mv for mv in reserved if id(mv) not in landed] + left
        with m._cond:
            m._unpin([p.entry for p in done])
            m._drop_unwritten(failed)
            m.counters.blocks_stored += len(done) - len(failed)
            m.counters.bytes_written_in_place += len(landed) * m.layout.block_nbytes
        return len(done) - len(failed)

    def _reap(self, now: float | None = None) -> None:
        """Abort partial writes past their expiry (nobody is copying into them). Lock held."""
        m = self.m
        now = m.clock() if now is None else now
        dead = [p for p in self._partials.values() if p.expiry <= now and not p.writers]
        self._abort(dead)
        m.counters.layer_writes_expired += len(dead)

    def _abort(self, parts: list[Partial]) -> None:
        m = self.m
        level = m._levels[0]
        reserved = [p.key for p in parts if p.reserved]
        if reserved:
            level.tier.abort(reserved)
            level.resident -= len(reserved)
        for part in parts:
            del self._partials[part.key]
            part.entry.pins -= 1
            if part.entry.state == WRITING and m._index.get(part.key) is part.entry:
                del m._index[part.key]
        m._cond.notify_all()

    def abort_keys(self, keys: Sequence[BlockKey]) -> int:
        """Abort the partial writes of ``keys`` that no copy is in flight into. Lock held."""
        parts = [p for k in dict.fromkeys(keys) if (p := self._partials.get(k)) and not p.writers]
        self._abort(parts)
        return len(parts)

    def abort_all(self) -> None:
        """Abort every partial write (at close). Lock held."""
        self._abort([p for p in self._partials.values() if not p.writers])

    def pending(self) -> int:
        """Blocks partially written. Lock held."""
        return len(self._partials)
