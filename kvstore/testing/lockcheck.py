"""A tier that checks the data path's lock rule: no tier call while the books' lock is held.

:class:`LockCheckedTier` forwards every call to a real tier and, before each,
asks ``held()`` -- the store's :meth:`~kvstore.datapath.books.Books.held_by_me` -- whether
the calling thread holds the books' lock. A call made under the lock is
recorded in ``violations`` (the method and where it was called from) instead
of being trusted; ``calls`` counts the calls by method, so a test can show it
really exercised each one.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvstore.keys import BlockKey
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["LockCheckedTier"]


class LockCheckedTier(Tier):
    """A real tier whose every call asserts that the books' lock is free.

    ``held`` starts as "never held" (the tier is built before the store that
    owns the lock); set it to ``store.engine.datapath.books.held_by_me`` once the
    store exists. ``_lock`` guards ``calls`` and ``violations``.
    """

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner.config, inner.layout)
        self.inner = inner
        self.kind = inner.kind
        self.persistent = inner.persistent
        self.shared = inner.shared
        self.local = inner.local
        self.promotable = inner.promotable
        self.held: Callable[[], bool] = lambda: False
        self.calls: dict[str, int] = {}
        self.violations: list[str] = []
        self._lock = threading.Lock()

    def _check(self, method: str) -> None:
        under_lock = self.held()
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            if under_lock:
                where = "".join(traceback.format_stack(limit=8)[:-2])
                self.violations.append(f"{self.kind}.{method} under the books' lock:\n{where}")

    @property
    def capacity_blocks(self) -> int:
        return self.inner.capacity_blocks

    @property
    def device(self) -> torch.device | None:
        return self.inner.device

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        self._check("put")
        return self.inner.put(keys, blocks)

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        self._check("get")
        return self.inner.get(keys, outs, layers)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self._check("delete")
        self.inner.delete(keys)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._check("contains")
        return self.inner.contains(keys)

    def stored_keys(self) -> Iterator[BlockKey]:
        self._check("stored_keys")
        return self.inner.stored_keys()

    def view(self, key: BlockKey) -> torch.Tensor | None:
        self._check("view")
        return self.inner.view(key)

    def reserve(self, keys: Sequence[BlockKey]) -> list[torch.Tensor | None]:
        self._check("reserve")
        return self.inner.reserve(keys)

    def commit(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._check("commit")
        return self.inner.commit(keys)

    def abort(self, keys: Sequence[BlockKey]) -> None:
        self._check("abort")
        self.inner.abort(keys)

    def stats(self) -> dict[str, Any]:
        self._check("stats")
        return self.inner.stats()

    def prepare_close(self) -> None:
        self._check("prepare_close")
        self.inner.prepare_close()

    def close(self) -> None:
        self._check("close")
        self.inner.close()
