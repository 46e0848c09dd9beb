"""SGLang HiCache storage backend (its L3 tier) on a :class:`~kvstore.store.KVStore`.

Load it through SGLang's ``dynamic`` backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
            "kvstore_config": "/etc/kvstore.yaml", "interface_v1": 1}'

SGLang computes its own page keys (chained sha256 over a page of tokens) and
moves pages between its host memory pool and this backend. A page is stored
as one kvstore block, opaque to the store: its layout is the host pool's flat
page (``1 x 1 x 1 x 1 x page_elements`` of the pool dtype), so the store's
layout fingerprint pins the page geometry, and every block read from disk is
verified like any other. SGLang's keys pass through
:meth:`KVStore.engine_keys` with a namespace of the model, the TP rank (not
for MLA, whose KV every rank shares), the pipeline and context-parallel
stage, and an optional salt, so two models or ranks never share a page.

Every method of the contract is implemented (none returns None where SGLang
expects a value), and none raises into SGLang's prefetch or backup threads:
a failing store shows up as a miss or a failed write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvstore.config import StoreConfig
from kvstore.connectors.settings import Counters
from kvstore.copies import engine_for
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import BlockKey, Namespace
from kvstore.layout import KVLayout
from kvstore.store import KVStore

__all__ = ["KVStoreHiCacheStorage", "page_layout"]

log = logging.getLogger(__name__)


def page_layout(page: torch.Tensor) -> KVLayout:
    """The layout of one opaque page of ``page``'s size and dtype."""
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=page.numel(),
        block_tokens=1,
        dtype=page.dtype,
        kv_factor=1,
    )


class KVStoreHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` whose pages live in kvstore; built as ``cls(storage_config, kwargs)``.

    The store opens when SGLang registers its host memory pool (which fixes
    the page size), or at the first page written if none is registered.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._config = StoreConfig.load(extra.get("kvstore_config"))
        self._model = _model_name(storage_config, extra.get("model_id"))
        self._tp = _tp_fields(storage_config)
        salt = extra.get("salt")
        if salt is not None and not isinstance(salt, str):
            raise ConfigError(f"salt: expected a string, got {salt!r}")
        self._salt = salt
        self._lock = threading.Lock()
        self._store: KVStore | None = None
        self._namespace: Namespace | None = None
        self.counters = Counters("sglang")
        self._stats = StorageStats()
        self.mem_pool_host: Any = None

    # -- the store ----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Remember SGLang's host pool and open the store for its page size."""
        self.mem_pool_host = mem_pool_host
        self._open(mem_pool_host.get_dummy_flat_data_page())

    def _open(self, page: torch.Tensor) -> KVStore:
        with self._lock:
            if self._store is None:
                layout = page_layout(page)
                self._store = KVStore(layout, self._config)
                self._namespace = Namespace(
                    model=self._model, layout=layout, salt=self._salt, **self._tp
                )
            return self._store

    def _keys(self, keys: Sequence[str]) -> list[BlockKey]:
        assert self._store is not None and self._namespace is not None
        return self._store.engine_keys(keys, self._namespace)

    def _page(self, page: torch.Tensor) -> torch.Tensor:
        """``page`` (flat or not) as a one-block tensor of the store's layout."""
        assert self._store is not None
        shape = self._store.layout.tensor_shape(1)
        if page.numel() != shape[-1] or page.dtype != self._store.layout.dtype:
            raise KVStoreError(
                f"page of {page.numel()} {page.dtype} does not match the store's pages of "
                f"{shape[-1]} {self._store.layout.dtype}"
            )
        return page.reshape(shape)

    def _read(self, keys: Sequence[str], targets: Sequence[torch.Tensor]) -> int:
        """Read pages into ``targets`` (in place) up to the first miss; return how many."""
        store = self._store
        if store is None or not keys:
            return 0
        block_keys = self._keys(keys)
        for i, (key, target) in enumerate(zip(block_keys, targets, strict=True)):
            direct = target.is_contiguous() and target.dtype == store.layout.dtype
            buffer = (
                target
                if direct
                else torch.empty_like(target, memory_format=torch.contiguous_format)
            )
            if not store.get_prefix([key], self._page(buffer)):
                return i
            if not direct:
                engine_for(target.device).copy_all([(target, buffer)])
        return len(block_keys)

    def _write(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """Store ``pages`` under ``keys``; return how many are stored afterwards."""
        if not keys:
            return 0
        store = self._open(pages[0])
        block_keys = self._keys(keys)
        return sum(store.put([k], self._page(p)) for k, p in zip(block_keys, pages, strict=True))

    # -- the HiCacheStorage contract ------------------------------------------------------
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """The page of ``key`` (in ``target_location`` when given), or None."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages of ``keys`` up to the first miss (in ``target_locations`` if given), then None."""
        store = self._store
        if store is None:
            return [None] * len(keys)
        if target_locations is None:
            shape = (store.layout.head_dim,)
            target_locations = [torch.empty(shape, dtype=store.layout.dtype) for _ in keys]
        with self._guard("get", len(keys)) as done:
            done[0] = self._read(keys, list(target_locations))
        n = done[0]
        return [*target_locations[:n], *([None] * (len(keys) - n))]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one page; True if it is stored afterwards."""
        return self.batch_set([key], None if value is None else [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store pages; True if every one is stored afterwards."""
        if values is None or len(values) != len(keys):
            self.counters.add("set_bad_input")
            return False
        with self._guard("set", len(keys)) as done:
            done[0] = self._write(keys, list(values))
        return done[0] == len(keys)

    def exists(self, key: str) -> bool:
        """Whether the page of ``key`` is stored."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading ``keys`` whose pages are stored and worth loading (restore
        planning: pages only on a tier too slow to beat recomputing them are left out,
        and copied up in the background for the next request)."""
        if self._store is None or not keys:
            return 0
        try:
            page = getattr(self.mem_pool_host, "page_size", None)
            if isinstance(page, int) and page > 0:
                return self._store.plan(self._keys(keys), chunk_tokens=page).load
            return self._store.lookup(self._keys(keys))
        except Exception:  # a failing store is a miss, never an error in SGLang's thread
            log.exception("kvstore: existence check failed")
            self.counters.add("errors")
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load pages straight into the registered host pool at ``host_indices`` (one index
        per token; page ``i`` starts at ``host_indices[i * page_size]``)."""
        pool = self.mem_pool_host
        results = [False] * len(keys)
        if pool is None or self._store is None:
            self.counters.add("v1_without_pool" if pool is None else "get_pages_missed", len(keys))
            return results
        with self._guard("get", len(keys)) as done:
            for i, key in enumerate(keys):
                index = host_indices[i * pool.page_size]
                page = pool.get_data_page(index, flat=True)
                # A view of the pool (page-major layouts) is filled in place: zero-copy.
                in_place = _window_of_larger_buffer(page)
                if not self._read([key], [page]):
                    break
                if not in_place:
                    pool.set_from_flat_data_page(index, page)
                results[i] = True
                done[0] += 1
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``."""
        pool = self.mem_pool_host
        if pool is None:
            self.counters.add("v1_without_pool", len(keys))
            return [False] * len(keys)
        results = [False] * len(keys)
        with self._guard("set", len(keys)) as done:
            for i, key in enumerate(keys):
                page = pool.get_data_page(host_indices[i * pool.page_size], flat=True)
                results[i] = self._write([key], [page]) == 1
                done[0] += int(results[i])
        return results

    def clear(self) -> None:
        """Delete every page of this page geometry from the store's tiers."""
        store = self._store
        if store is None:
            return
        self.counters.add("cleared_pages", store.clear())

    def get_stats(self) -> StorageStats:
        """Pages and bandwidth of the loads and stores since the last call (SGLang's
        ``StorageMetrics`` fields), plus kvstore's own counters."""
        with self._lock:
            stats, self._stats = self._stats, StorageStats()
        stats.counters = self.counters.snapshot()
        if self._store is not None:
            stats.counters["blocks"] = self._store.stats()["blocks"]
        return stats

    def close(self) -> None:
        """Close the store (flushing memory-only pages to its persistent tier)."""
        if self._store is not None:
            self._store.close()

    @contextmanager
    def _guard(self, op: str, pages: int) -> Iterator[list[int]]:
        """Count an operation's pages and bandwidth; turn any error into a miss."""
        done = [0]
        start = time.perf_counter()
        try:
            yield done
        except Exception:  # SGLang's prefetch/backup threads must never see an exception
            log.exception("kvstore: %s of %d pages failed", op, pages)
            self.counters.add("errors")
        elapsed = time.perf_counter() - start
        self.counters.add(f"{op}_pages", done[0])
        self.counters.add(f"{op}_pages_missed", pages - done[0])
        nbytes = done[0] * (self._store.layout.block_nbytes if self._store is not None else 0)
        with self._lock:
            pgs, bw = (
                (self._stats.prefetch_pgs, self._stats.prefetch_bandwidth)
                if op == "get"
                else (self._stats.backup_pgs, self._stats.backup_bandwidth)
            )
            pgs.append(done[0])
            bw.append(nbytes / elapsed / 1e9 if elapsed > 0 else 0.0)


@dataclass
class StorageStats:
    """What ``get_stats`` returns: SGLang's ``StorageMetrics`` fields and our counters."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)


def _window_of_larger_buffer(page: torch.Tensor) -> bool:
    """Whether ``page`` is a contiguous window of a larger buffer (the pool's memory),
    so filling it fills the pool; False for a page of its own (a gathered copy,
    even one seen through a reshaping view), which must be written back."""
    own = page.numel() * page.element_size()
    return page.is_contiguous() and (
        page.storage_offset() > 0 or page.untyped_storage().nbytes() > own
    )


def _model_name(storage_config: Any, override: Any) -> str:
    """The namespace's model id: the model plus any pipeline / context-parallel stage."""
    if override is not None and (not isinstance(override, str) or not override):
        raise ConfigError(f"model_id: expected a non-empty string, got {override!r}")
    parts = [override or getattr(storage_config, "model_name", None) or "unnamed-model"]
    for name in ("pp", "attn_cp"):
        size = getattr(storage_config, f"{name}_size", 1) or 1
        if size > 1:
            parts.append(f"{name}={getattr(storage_config, f'{name}_rank', 0)}/{size}")
    return "|".join(parts)


def _tp_fields(storage_config: Any) -> dict[str, Any]:
    """TP rank and size, except for MLA models, whose KV every rank holds whole."""
    if getattr(storage_config, "is_mla_model", False):
        return {}
    return {"tp_rank": int(storage_config.tp_rank), "tp_size": int(storage_config.tp_size)}
