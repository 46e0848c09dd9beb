"""What a :class:`~kvstore.store.KVStore` holds for its KV events (``events:`` in its config).

The store opens one :class:`StoreEventsOwner` when its config enables events,
or when its owner hands it a publisher to share (a kvstore-server publishes
the stores of all its namespaces through one socket). It keeps the token book
(with its journal), the thread publishing the store's changes, and the
publisher if the store opened its own.
"""

from __future__ import annotations

import contextlib

import numpy as np

from kvstore.config import EventsConfig
from kvstore.datapath.contracts import DataPath
from kvstore.events.book import TokenBook
from kvstore.events.publisher import EventPublisher
from kvstore.events.source import StoreEvents
from kvstore.keys import ChunkTokens

__all__ = ["StoreEventsOwner"]


class StoreEventsOwner:
    """The book, the publishing thread and (unless shared) the publisher of one store.

    ``publisher``: a publisher to share (not closed here); None: open one from
    ``config``. Starting binds the sockets and announces what the store holds
    (blocks its disk kept, with tokens from the journal).
    """

    def __init__(
        self, manager: DataPath, config: EventsConfig, publisher: EventPublisher | None
    ) -> None:
        self.book = TokenBook(manager.layout.block_tokens, config.token_journal)
        self._owns_publisher = publisher is None
        self.publisher = EventPublisher(config) if publisher is None else publisher
        try:
            self.source = StoreEvents(manager, self.book, self.publisher, config).start()
        except BaseException:
            self._close_owned()
            raise

    def note(self, tokens: ChunkTokens) -> None:
        """Record the tokens of chunks about to be put (their events carry them)."""
        ids = np.frombuffer(tokens.tokens, dtype="<i4")
        self.book.record(tokens.keys, ids, tokens.parent)

    def cleared(self) -> None:
        """The store was cleared: ``AllBlocksCleared`` (then what is left, if shared)."""
        self.source.cleared()

    def close(self) -> None:
        """Publish the last changes and stop; close the publisher if it is this store's."""
        try:
            self.source.close()
        finally:
            self._close_owned()

    def _close_owned(self) -> None:
        if self._owns_publisher:
            with contextlib.suppress(Exception):
                self.publisher.close()
        self.book.close()
