"""KV events of the vLLM connector: what its workers stored in kvstore, for vLLM's publisher.

vLLM's scheduler collects ``connector.take_events()`` every step and publishes
them with its own KV events (``--kv-events-config``), so routers that follow
vLLM's stream (Dynamo's KV router, llm-d's precise prefix-cache scorer) learn
which prompts kvstore holds for this engine, beside what its GPU holds.

Engine-independent (no vLLM import): the connector hands in plain values and
turns the events into vLLM's classes.

- A chunk its workers saved, or a lookup found, is a ``BlockStored`` at the medium of the store's
  shared tier (``STORAGE``; locality ``LOCAL`` for a disk, ``REMOTE`` for S3,
  Redis, a server or a cluster), carrying the chunk's tokens, in blocks of the
  engine's block size. Saves are synchronous in the step that plans them, so
  the events of a step's saves go out with that step.
- A chunk announced earlier that a lookup finds gone (evicted or deleted by
  any process) is a ``BlockRemoved``.
- Block hashes are kvstore's stable ones (:mod:`kvstore.events.blocks`), not
  vLLM's: those change with every restart unless ``PYTHONHASHSEED`` is fixed,
  and sharing them would let a GPU eviction of a block remove kvstore's copy
  from a router's view. Consumers index the tokens, not the hashes.
- With ``events.token_journal`` set, the tokens of announced chunks are kept
  in that file; after a restart the connector announces again every chunk the
  store still holds (:meth:`ConnectorEvents.restore`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.config import EventsConfig
from kvstore.datapath.contracts import Medium
from kvstore.events import BlockMapper, TokenBook, parent_first
from kvstore.keys import BlockKey

__all__ = ["ConnectorEvents"]

#: ``exists(keys) -> which are stored`` (the scheduler's view of the shared tiers).
ExistsFn = Callable[[list[BlockKey]], list[bool]]


class ConnectorEvents:
    """The scheduler side's record of announced chunks and the events not yet taken.

    ``chunk_tokens``: tokens per kvstore chunk; ``config``: the store config's
    ``events`` section (its ``block_size`` is the engine's block size);
    ``medium``: where saved chunks live, as a router weighs them.

    Lock: ``_lock`` guards ``_pending`` and ``_announced`` (vLLM calls the
    scheduler side from one thread, but lookups may come from another).
    """

    def __init__(self, chunk_tokens: int, config: EventsConfig, medium: Medium) -> None:
        self.mapper = BlockMapper(chunk_tokens, config)
        self.book = TokenBook(chunk_tokens, config.token_journal)
        self.medium = medium
        self._announced: set[BlockKey] = set()
        self._pending: list[Any] = []
        self._lock = threading.Lock()

    def held(self, keys: Sequence[BlockKey], tokens: Sequence[int]) -> None:
        """The store holds a prompt's first ``len(keys)`` chunks (found by a lookup, or
        saved by the workers), ``tokens`` being their token ids: announce those not
        announced yet, parents first (a router drops a block whose parent it lacks)."""
        if not keys:
            return
        with self._lock:
            new = [k for k in keys if k not in self._announced]
        if new:
            self.book.record(keys, tokens, None)
            self._announce(new)

    def gone(self, keys: Sequence[BlockKey]) -> None:
        """Chunks a lookup found missing: those announced become ``BlockRemoved``."""
        with self._lock:
            lost = [k for k in keys if k in self._announced]
            self._announced.difference_update(lost)
            if lost:
                self._pending.append(self.mapper.removed(lost, self.medium))
        if lost:
            self.book.forget(lost)

    def restore(self, exists: ExistsFn) -> int:
        """Announce again what the journal knows and the store still holds (after a
        restart); forget the rest. Returns how many chunks were announced."""
        known = self.book.keys()
        if not known:
            return 0
        held = [k for k, ok in zip(known, exists(known), strict=True) if ok]
        self.book.retain(held)
        self._announce(held)
        return len(held)

    def _announce(self, keys: list[BlockKey]) -> None:
        events = []
        for key in parent_first(keys, self.book.parent):
            entry = self.book.get(key)
            if entry is not None:
                events.append(self.mapper.stored(key, entry[0], entry[1], self.medium))
        with self._lock:
            self._announced.update(keys)
            self._pending.extend(events)

    def take(self) -> list[Any]:
        """The events since the last call (kvstore's structs; vLLM's have the same fields)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def close(self) -> None:
        """Close the journal."""
        self.book.close()
