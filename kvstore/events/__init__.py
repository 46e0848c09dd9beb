"""KV events: kvstore's block changes, published the way vLLM publishes its KV cache events.

Consumers that speak vLLM's ``KVEventBatch`` over ZMQ (NVIDIA Dynamo's KV
router and standalone indexer, llm-d's precise prefix-cache scorer) can route
requests to the worker whose kvstore holds their prefix. docs/events.md has
the details; in short::

    from kvstore.events import EventPublisher, StoreEvents, TokenBook
    from kvstore.config.events import EventsConfig

    config = EventsConfig(
        enabled=True, endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558"
    )                                             # this host only; tcp://* warns (unauthenticated)
    book = TokenBook(store.layout.block_tokens, journal=config.token_journal)
    publisher = EventPublisher(config)            # binds on start()
    events = StoreEvents(store, book, publisher).start()   # also starts the publisher

    book.record(keys, token_ids, parent=None)     # the writer: tokens of the chunks it puts
    store.put(keys, kv)                           # -> BlockStored (tokens from the book)
    store.clear(); events.cleared()               # -> AllBlocksCleared
    events.close(); publisher.close(); book.close()

The three constructors:

- ``TokenBook(block_tokens, journal=None)``: key -> (parent key, tokens);
  ``record(keys, tokens, parent)``, ``get(key)``, ``forget(keys)``; thread-safe;
  with a journal file it survives restarts. Needs nothing optional.
- ``EventPublisher(config)``: the ZMQ PUB socket (and ROUTER replay socket);
  ``start()``, ``publish(events)`` (never blocks), ``publish_snapshot()``,
  ``add_source(fn)``, ``close()``, ``bound_endpoint``. One publisher may serve
  several stores.
- ``StoreEvents(store, book, publisher, config=None)``: the thread turning a
  store's change feed into batches; ``start()``, ``flush()``, ``cleared()``,
  ``snapshot()``, ``stats()``, ``close()``.

Importing this package imports neither pyzmq nor msgspec: the names above load
on first use, and :class:`EventPublisher` / :class:`StoreEvents` (and
:mod:`kvstore.events.format`) raise :class:`EventsUnavailableError` (a
:class:`~kvstore.errors.ConfigError`) saying ``pip install 'kvstore-tiers[events]'``
when they are missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.events._deps import EventsUnavailableError
from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.events.blocks import LOCAL, REMOTE, BlockMapper, medium_of, parent_first
    from kvstore.events.book import TokenBook
    from kvstore.events.format import (
        MEDIUM_CPU,
        MEDIUM_GPU,
        MEDIUM_STORAGE,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        Event,
        EventBatch,
        KVCacheEvent,
        KVEventBatch,
        decode_batch,
        encode_batch,
    )
    from kvstore.events.owner import StoreEventsOwner
    from kvstore.events.publisher import END_SEQ, SNAPSHOT_BATCH_EVENTS, EventPublisher, Source
    from kvstore.events.source import StoreEvents

__all__ = [
    "AllBlocksCleared",
    "BlockMapper",
    "BlockRemoved",
    "BlockStored",
    "END_SEQ",
    "Event",
    "EventBatch",
    "EventPublisher",
    "EventsUnavailableError",
    "KVCacheEvent",
    "KVEventBatch",
    "LOCAL",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "REMOTE",
    "SNAPSHOT_BATCH_EVENTS",
    "Source",
    "StoreEvents",
    "StoreEventsOwner",
    "TokenBook",
    "decode_batch",
    "encode_batch",
    "medium_of",
    "parent_first",
]

_EXPORTS = {
    "AllBlocksCleared": "kvstore.events.format",
    "BlockMapper": "kvstore.events.blocks",
    "BlockRemoved": "kvstore.events.format",
    "BlockStored": "kvstore.events.format",
    "END_SEQ": "kvstore.events.publisher",
    "Event": "kvstore.events.format",
    "EventBatch": "kvstore.events.format",
    "EventPublisher": "kvstore.events.publisher",
    "KVCacheEvent": "kvstore.events.format",
    "KVEventBatch": "kvstore.events.format",
    "LOCAL": "kvstore.events.blocks",
    "MEDIUM_CPU": "kvstore.events.format",
    "MEDIUM_GPU": "kvstore.events.format",
    "MEDIUM_STORAGE": "kvstore.events.format",
    "REMOTE": "kvstore.events.blocks",
    "SNAPSHOT_BATCH_EVENTS": "kvstore.events.publisher",
    "Source": "kvstore.events.publisher",
    "StoreEvents": "kvstore.events.source",
    "StoreEventsOwner": "kvstore.events.owner",
    "TokenBook": "kvstore.events.book",
    "decode_batch": "kvstore.events.format",
    "encode_batch": "kvstore.events.format",
    "medium_of": "kvstore.events.blocks",
    "parent_first": "kvstore.events.blocks",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
