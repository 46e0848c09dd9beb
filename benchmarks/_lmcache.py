"""The two stores bench_lmcache.py drives: LMCache's ``StorageManager``, and kvstore.

``LmcStore`` opens one ``StorageManager`` the way ``LMCacheEngine`` builds it (from an
``LMCacheEngineConfig``) and does what ``LMCacheEngine.store`` / ``retrieve`` / ``lookup``
do with it, without a GPU connector; ``cpu_options`` / ``disk_options`` are the configs
it is opened with. LMCache lives in its own venv (``.venv-lmcache``), so its classes are
imported at run time (``load_lmcache``) and are ``Any`` here; ``ensure_lmcache`` re-runs
the calling script under that venv when ``lmcache`` does not import. The kvstore side:
``host_store``, ``kv_keys``, and the bytes both are timed on (``random_kv``, ``same``;
``drop_cache`` is in _common.py). The phases, timing and output are in bench_lmcache.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import log

from kvstore import BlockKey, KVLayout, KVStore, StoreConfig

#: Set in the re-run under LMCache's venv; not a ``KVSTORE_*`` name, which the store it opens
#: would read as a setting (and refuse).
REEXEC_ENV = "BENCH_LMCACHE_REEXEC"
SETUP = "run bash benchmarks/peers/setup_lmcache.sh"
GIB = 1024**3


# -- finding LMCache -----------------------------------------------------------
def skipped(reason: str) -> dict[str, Any]:
    """The result when LMCache cannot run here."""
    return {"benchmark": "lmcache", "skipped": True, "reason": reason}


def ensure_lmcache(venv: Path, script: Path, argv: list[str]) -> dict[str, Any] | None:
    """None if lmcache imports here; else re-run ``script`` under ``venv`` (no return) or skip."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # quiet its INFO and warnings
    try:
        importlib.import_module("lmcache")
        return None
    except ImportError as exc:
        missing = f"lmcache does not import in {sys.executable} ({exc})"
    python = venv / "bin" / "python"
    if os.environ.get(REEXEC_ENV) or not python.exists():
        where = "" if python.exists() else f"; {python} does not exist"
        return skipped(f"{missing}{where}: {SETUP}")
    log(f"{missing}; re-running with {python}")
    os.environ[REEXEC_ENV] = "1"
    os.execv(python, [str(python), str(script.resolve()), *argv])


# -- driving its StorageManager --------------------------------------------------
@dataclass(frozen=True)
class LmcApi:
    """The LMCache classes this benchmark drives (imported at run time: another venv)."""

    version: str
    config_cls: Any
    metadata_cls: Any
    event_manager_cls: Any
    storage_manager_cls: Any
    key_cls: Any
    kv_2ltd: Any


def load_lmcache() -> LmcApi:
    """Import LMCache's storage layer."""
    mod = importlib.import_module
    return LmcApi(
        version=importlib.metadata.version("lmcache"),
        config_cls=mod("lmcache.v1.config").LMCacheEngineConfig,
        metadata_cls=mod("lmcache.v1.metadata").LMCacheMetadata,
        event_manager_cls=mod("lmcache.v1.event_manager").EventManager,
        storage_manager_cls=mod("lmcache.v1.storage_backend.storage_manager").StorageManager,
        key_cls=mod("lmcache.utils").CacheEngineKey,
        kv_2ltd=mod("lmcache.v1.memory_management").MemoryFormat.KV_2LTD,
    )


def cpu_options(capacity: int) -> dict[str, Any]:
    """LMCache config for a CPU-only cache of ``capacity`` bytes (its GB are GiB)."""
    return {"local_cpu": True, "max_local_cpu_size": capacity / GIB, "local_disk": None}


def staging(batch_nbytes: int) -> int:
    """LMCache's CPU memory in the disk configuration (it reads into it): two batches, >= 1 GiB."""
    return max(GIB, 2 * batch_nbytes)


def disk_options(path: Path, capacity: int, staging: int, io_threads: int) -> dict[str, Any]:
    """LMCache config for a disk cache (its ``local_disk`` preset: no CPU hot cache)."""
    return {
        "local_cpu": False,
        "max_local_cpu_size": staging / GIB,
        "local_disk": f"file://{path}/",
        "max_local_disk_size": capacity / GIB,
        "extra_config": {"disk_io_threads": io_threads},
    }


class LmcStore:
    """One LMCache ``StorageManager``, as ``LMCacheEngine`` builds it, driven directly."""

    def __init__(self, api: LmcApi, layout: KVLayout, options: dict[str, Any]) -> None:
        self.api, self.layout = api, layout
        heads, dim, step = layout.num_kv_heads, layout.head_dim, layout.block_tokens
        self.metadata = api.metadata_cls(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=layout.dtype,
            kv_shape=(layout.num_layers, layout.kv_factor, step, heads, dim),
            role="worker",
        )
        config = api.config_cls.from_defaults(chunk_size=step, **options)
        start = time.perf_counter()
        self.sm = api.storage_manager_cls(config, self.metadata, api.event_manager_cls())
        self.open_s = time.perf_counter() - start
        self.shapes, self.dtypes = self.metadata.get_shapes(), self.metadata.get_dtypes()
        self.chunk_shape = (layout.kv_factor, layout.num_layers, step, heads, dim)
        self._ids = itertools.count(1)

    def new_keys(self, n: int) -> list[Any]:
        """``n`` keys never used before."""
        dtype = self.layout.dtype
        return [self.api.key_cls("bench", 1, 0, next(self._ids), dtype) for _ in range(n)]

    def _chunk(self, kv: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` of ``kv`` (kvstore's layout) as a ``KV_2LTD`` view."""
        step = self.layout.block_tokens
        return kv[:, :, i * step : (i + 1) * step].transpose(0, 1)

    def put(self, keys: list[Any], kv: torch.Tensor) -> None:
        """``LMCacheEngine.store``'s steps: allocate per chunk, copy it in, ``batched_put``."""
        objs = []
        for i in range(len(keys)):
            obj = self.sm.allocate(self.shapes, self.dtypes, fmt=self.api.kv_2ltd, busy_loop=False)
            if obj is None:
                raise RuntimeError("LMCache could not allocate a chunk: its CPU memory is full")
            obj.tensor.view(self.chunk_shape).copy_(self._chunk(kv, i))
            objs.append(obj)
        self.sm.batched_put(keys, objs)

    def get(self, keys: list[Any], out: torch.Tensor | None, location: str) -> None:
        """``retrieve``'s steps: ``batched_get``, copy into ``out``, ``ref_count_down``."""
        objs = self.sm.batched_get(keys, location=location)
        for i, obj in enumerate(objs):
            if obj is None:
                raise RuntimeError(f"LMCache lost chunk {i} of {len(keys)} ({location})")
            if out is not None:
                self._chunk(out, i).copy_(obj.tensor.view(self.chunk_shape))
            obj.ref_count_down()

    def lookup(self, keys: list[Any]) -> int:
        """Prefix hit, as ``LMCacheEngine.lookup`` asks it: ``batched_contains``."""
        return int(self.sm.batched_contains(keys)[0])

    def lookup_loop(self, keys: list[Any]) -> int:
        """Prefix hit by one ``contains`` per key."""
        n = 0
        for key in keys:
            if self.sm.contains(key) is None:
                break
            n += 1
        return n

    def remove(self, keys: list[Any]) -> None:
        """Drop ``keys`` (their memory goes back to the allocator)."""
        self.sm.batched_remove(keys)

    def disk(self) -> Any:
        """The ``LocalDiskBackend``."""
        return self.sm.storage_backends["LocalDiskBackend"]

    def wait_written(self, keys: list[Any], timeout: float = 300.0) -> None:
        """Wait for the disk backend's asynchronous writes of ``keys`` to land."""
        disk, deadline = self.disk(), time.monotonic() + timeout
        while disk.batched_contains(keys) < len(keys) or disk.disk_worker.put_tasks:
            if time.monotonic() > deadline:
                raise RuntimeError("LMCache did not finish writing its disk files")
            time.sleep(0.01)

    def disk_files(self) -> list[Path]:
        """The chunk files of the disk backend."""
        return list(Path(self.disk().path).glob("*.pt"))

    def close(self) -> None:
        """Close the storage manager (its backends, threads and memory)."""
        self.sm.close()


# -- kvstore side --------------------------------------------------------------
def host_store(layout: KVLayout, capacity: int, prefault: bool = True) -> KVStore:
    """A kvstore with one host tier of ``capacity`` bytes."""
    tier = {"kind": "host", "capacity": capacity, "prefault": prefault}
    return KVStore(layout, StoreConfig.from_dict({"tiers": [tier]}, environ={}))


def kv_keys(tag: int, n: int) -> list[BlockKey]:
    """``n`` distinct 16-byte kvstore keys for generation ``tag``."""
    return [BlockKey(tag.to_bytes(8, "little") + i.to_bytes(8, "little")) for i in range(n)]


def random_kv(layout: KVLayout, blocks: int, seed: int) -> torch.Tensor:
    """Random (incompressible) KV of ``blocks`` chunks in kvstore's layout."""
    gen = torch.Generator().manual_seed(seed)
    shape = layout.tensor_shape(blocks)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two KV tensors."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))
