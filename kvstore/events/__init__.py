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

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.events._deps import EventsUnavailableError

if TYPE_CHECKING:
    from kvstore.events.book import TokenBook
    from kvstore.events.publisher import EventPublisher
    from kvstore.events.source import StoreEvents

__all__ = ["EventPublisher", "EventsUnavailableError", "StoreEvents", "TokenBook"]

_LAZY = {
    "TokenBook": "kvstore.events.book",
    "EventPublisher": "kvstore.events.publisher",
    "StoreEvents": "kvstore.events.source",
}


def __getattr__(name: str) -> Any:
    """Load the public classes on first use (pyzmq and msgspec only then)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.events' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
