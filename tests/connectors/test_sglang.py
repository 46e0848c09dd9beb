"""The SGLang HiCache storage backend against SGLang's real ``HiCacheStorage`` class.

Needs the ``sglang`` package (scripts/setup-vllm.sh installs sglang 0.5.23 into
.venv-vllm without its CUDA dependencies: enough to import its storage ABC and backend
factory). In a venv without it these tests skip; test_vllm_e2e.py runs them in .venv-vllm.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

hicache = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed in this venv"
)
factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from kvstore.connectors.sglang import KVStoreHiCacheStorage, StorageStats  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 4, 2, 2, 8
PAGE_ELEMS = LAYERS * 2 * PAGE * HEADS * DIM


class HostPool:
    """The host-pool surface the backend uses: page accessors of SGLang's HostKVCache.

    ``page_first`` pages are contiguous views of the pool (filled in place); ``layer_first``
    pages are gathered copies written back with ``set_from_flat_data_page``.
    """

    def __init__(self, layout: str, pages: int = 8) -> None:
        self.layout, self.page_size = layout, PAGE
        shape = (
            (pages, PAGE_ELEMS) if layout == "page_first" else (LAYERS, pages, PAGE_ELEMS // LAYERS)
        )
        self.buffer = torch.zeros(shape, dtype=torch.bfloat16)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_ELEMS, dtype=torch.bfloat16)

    def get_data_page(self, index: Any, flat: bool = True) -> torch.Tensor:
        page = int(index) // PAGE
        if self.layout == "page_first":
            return self.buffer[page]
        return self.buffer[:, page].flatten()

    def set_from_flat_data_page(self, index: Any, data: torch.Tensor) -> None:
        page = int(index) // PAGE
        if self.layout == "page_first":
            self.buffer[page].copy_(data)
        else:
            self.buffer[:, page] = data.view(LAYERS, -1)

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randn(self.buffer.shape, generator=gen).to(torch.bfloat16))


def storage_config(tmp_path: Path, **over: Any) -> Any:
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 2,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": True,
        "is_page_first_layout": True,
        "model_name": "org/model",
        "extra_config": {
            "backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang",
            "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1,
            "kvstore_config": {
                "tiers": [
                    {"kind": "host", "capacity": "8MiB"},
                    {"kind": "disk", "path": str(tmp_path / "l3"), "capacity": "64MiB"},
                ]
            },
        },
    }
    fields.update(over)
    return hicache.HiCacheStorageConfig(**fields)


def backend(tmp_path: Path, pool: HostPool | None = None, **over: Any) -> KVStoreHiCacheStorage:
    """Created the way SGLang creates a ``dynamic`` backend, then given its host pool."""
    made = factory.StorageBackendFactory.create_backend(
        "dynamic", storage_config(tmp_path, **over), None
    )
    assert isinstance(made, KVStoreHiCacheStorage)
    made.register_mem_pool_host(pool or HostPool("page_first"))
    return made


def page(seed: int) -> torch.Tensor:
    return torch.randn(PAGE_ELEMS, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_it_is_a_real_hicache_storage_with_every_method_implemented() -> None:
    assert issubclass(KVStoreHiCacheStorage, hicache.HiCacheStorage)
    assert not getattr(KVStoreHiCacheStorage, "__abstractmethods__", None)
    base = hicache.HiCacheStorage
    for name in (
        "get",
        "set",
        "batch_get",
        "batch_set",
        "exists",
        "batch_exists",
        "clear",
        "get_stats",
        "batch_get_v1",
        "batch_set_v1",
    ):
        assert getattr(KVStoreHiCacheStorage, name) is not getattr(base, name), name


def test_pages_round_trip_through_the_generic_interface(tmp_path: Path) -> None:
    b = backend(tmp_path)
    keys = ["k0", "k1", "k2"]
    assert b.batch_set(keys, [page(i) for i in range(3)]) is True
    assert b.set("k3", page(3)) is True
    got = b.batch_get(["k0", "k1", "missing", "k3"])
    assert torch.equal(got[0], page(0)) and torch.equal(got[1], page(1))
    assert got[2] is None and got[3] is None  # after the first miss: None (SGLang stops there)
    target = torch.empty(PAGE_ELEMS, dtype=torch.bfloat16)
    assert b.get("k2", target) is target and torch.equal(target, page(2))
    assert b.get("nope") is None
    assert b.exists("k1") and not b.exists("nope")
    assert b.batch_exists(["k0", "k1", "k2", "nope", "k3"]) == 3
    b.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_pages_move_between_host_pools_of_two_processes(tmp_path: Path, layout: str) -> None:
    src = HostPool(layout)
    src.fill(seed=5)
    writer = backend(tmp_path, src)
    indices = torch.arange(8 * PAGE)  # one index per token; page i starts at i * PAGE
    keys = [f"p{i}" for i in range(6)]
    assert writer.batch_set_v1(keys, indices[: 6 * PAGE]) == [True] * 6
    writer.close()  # flushes to the disk tier: the next process finds the pages there
    dst = HostPool(layout)
    reader = backend(tmp_path, dst)
    order = torch.cat([torch.arange(PAGE) + p * PAGE for p in (7, 6, 5, 4, 3, 2)])
    assert reader.batch_exists(keys) == 6
    assert reader.batch_get_v1(keys, order) == [True] * 6
    for i, p in enumerate((7, 6, 5, 4, 3, 2)):
        assert torch.equal(dst.get_data_page(p * PAGE), src.get_data_page(i * PAGE))
    assert reader.batch_get_v1(["p0", "gone", "p2"], indices[: 3 * PAGE]) == [True, False, False]
    reader.close()


def test_pages_are_namespaced_by_model_and_rank_but_mla_is_shared(tmp_path: Path) -> None:
    a = backend(tmp_path)
    a.batch_set(["k"], [page(1)])
    a.close()
    assert backend(tmp_path).exists("k")
    assert not backend(tmp_path, tp_rank=1).exists("k")
    assert not backend(tmp_path, model_name="org/other").exists("k")
    m0 = backend(tmp_path, is_mla_model=True)
    m0.batch_set(["mla"], [page(2)])
    m0.close()
    assert backend(tmp_path, is_mla_model=True, tp_rank=1).exists("mla")


def test_failures_are_misses_never_exceptions_or_none(tmp_path: Path) -> None:
    b = backend(tmp_path)
    b.batch_set(["k"], [page(1)])
    b.close()  # every store call now fails
    assert b.batch_get(["k"]) == [None]
    assert b.batch_set(["k"], [page(1)]) is False
    assert b.batch_exists(["k"]) == 0
    assert b.batch_get_v1(["k"], torch.arange(PAGE)) == [False]
    assert b.batch_set(["k"], None) is False  # no values: a failed write
    assert b.counters.snapshot()["errors"] >= 3
    fresh = KVStoreHiCacheStorage(storage_config(tmp_path), {})
    assert fresh.batch_get_v1(["k"], torch.arange(PAGE)) == [False]  # no host pool yet
    assert fresh.batch_exists(["k"]) == 0 and fresh.get("k") is None
    with pytest.raises(NotImplementedError):  # v2 (hybrid pools) stays the base's: it raises
        fresh.batch_exists_v2(["k"])


def test_pages_of_the_wrong_size_are_refused(tmp_path: Path) -> None:
    b = backend(tmp_path)
    assert b.batch_set(["k"], [torch.zeros(PAGE_ELEMS + 1, dtype=torch.bfloat16)]) is False
    assert not b.exists("k")
    b.close()


def test_clear_and_stats(tmp_path: Path) -> None:
    b = backend(tmp_path)
    b.batch_set(["a", "b"], [page(1), page(2)])
    b.batch_get(["a", "b"])
    stats = b.get_stats()
    assert isinstance(stats, StorageStats)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
    assert stats.counters["blocks"] == 2 and stats.counters["set_pages"] == 2
    assert b.get_stats().prefetch_pgs == []  # per interval
    b.clear()
    assert b.batch_exists(["a", "b"]) == 0
    b.close()


def test_pages_move_between_two_backends_through_a_server(tmp_path: Path, kv_server: Any) -> None:
    """The backend with a kvstore-server as its only tier: what one SGLang process
    stores, another finds, with no other change than the config."""
    server = kv_server()
    extra = dict(storage_config(tmp_path).extra_config)
    extra["kvstore_config"] = {"tiers": [{"kind": "remote", "address": server.address}]}
    src = HostPool("page_first")
    src.fill(seed=9)
    writer = backend(tmp_path, src, extra_config=extra)
    keys = [f"s{i}" for i in range(4)]
    assert writer.batch_set_v1(keys, torch.arange(4 * PAGE)) == [True] * 4
    writer.close()
    dst = HostPool("page_first")
    reader = backend(tmp_path, dst, extra_config=extra)
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, torch.arange(4 * PAGE)) == [True] * 4
    assert torch.equal(dst.buffer[:4], src.buffer[:4])
    reader.close()


def test_pages_on_a_tier_too_slow_to_pay_are_left_out_then_warmed(tmp_path: Path) -> None:
    config = storage_config(tmp_path).extra_config["kvstore_config"]
    config["tiers"][1].update(read_gbps=1e-6, read_latency_ms=5000)  # declared hopeless
    config["restore"] = {"prefill_tokens_per_s": 1e6}
    extra = {**storage_config(tmp_path).extra_config, "kvstore_config": config}
    writer = backend(tmp_path, extra_config=extra)
    keys = ["p0", "p1", "p2"]
    assert writer.batch_set(keys, [page(i) for i in range(3)]) is True
    writer.close()  # flushes the pages to disk
    reader = backend(tmp_path, extra_config=extra)  # a new process: host memory empty
    assert reader.batch_exists(keys) == 0  # loading from that disk loses to recomputing
    deadline = time.monotonic() + 10  # meanwhile the pages are warmed into host memory
    while reader.batch_exists(keys) != 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reader.batch_exists(keys) == 3
    got = reader.batch_get(keys)
    assert all(torch.equal(g, page(i)) for i, g in enumerate(got))
    reader.close()
    off = {**extra, "kvstore_config": {**config, "restore": {"planning": False}}}
    again = backend(tmp_path, extra_config=off)
    assert again.batch_exists(keys) == 3  # planning off: every stored page is a hit
    again.close()
