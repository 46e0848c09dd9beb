"""LMCache 0.5.6 side by side: kvstore's host and disk tiers vs LMCache's CPU and disk backends.

LMCache runs on a CPU when its ``StorageManager`` is driven directly, the way
``LMCacheEngine.store`` / ``retrieve`` drive it (no GPU connector). This script
opens one configured as a user would (``LMCacheEngineConfig``: ``chunk_size``
256, ``local_cpu`` + ``max_local_cpu_size``, ``local_disk`` +
``max_local_disk_size``, ``extra_config.disk_io_threads``) in the same process
as a ``KVStore``, and times both on the same bytes, interleaved in rounds
(round i: a block of reps of each subject in turn); every figure is a median.

Geometry: 8B Llama (32 layers, 8 KV heads, head_dim 128, 256 tokens per chunk,
bf16): 32 MiB per chunk in both (kvstore ``(layers, 2, tokens, heads, dim)``;
LMCache ``KV_2LTD``, ``(2, layers, tokens, heads * dim)``). A rep moves
``--blocks`` chunks in calls of ``--batch-blocks``, from and into the same
prefaulted tensors in kvstore's layout.

- put: kvstore ``store.put(keys, kv)``; LMCache what ``LMCacheEngine.store``
  does: ``StorageManager.allocate`` per chunk, a ``copy_`` of the chunk into
  the memory object (its connector's job), one ``batched_put``. New keys every
  rep (the previous rep's are removed untimed), both into a CPU-only store of
  ``--capacity`` (kvstore ``[host]``; LMCache ``local_cpu: true``, no disk).
  ``memcpy_gbps``: a contiguous torch ``copy_`` of the same bytes, for scale.
- get: kvstore ``store.get(keys, out=buf)``; LMCache what ``retrieve`` does:
  ``batched_get(keys, location)``, copy each chunk into ``buf``,
  ``ref_count_down``. ``lmcache_get_nocopy_ms``: ``batched_get`` and
  ``ref_count_down`` alone (it hands out references; a diagnostic).
- first fill: the same puts into a store opened just before (one per rep,
  ``--first-fill-capacity``), each rep after ``gc.collect()`` and a
  ``--settle-s`` pause (freed memory goes back to the host, as in
  bench_host_tier.py). LMCache pre-touches its whole buffer while it opens
  (``fill_(0)``); kvstore faults its slab in on a background thread, and its
  reps wait for that (``wait_prefault``, untimed): both start on touched
  memory. ``kvstore_put_first_fill_right_after_open_gbps``: kvstore's puts
  with its prefault still running. Open times are reported (``*_open_s``).
- disk get: kvstore with only a disk tier (``--io-threads``, ``page_cache:
  keep``) vs LMCache ``local_cpu: false`` + ``local_disk`` (its ``local_disk``
  preset), ``disk_io_threads`` equal: ``batched_get`` from ``LocalDiskBackend``
  into its pre-touched staging memory, then copied into ``buf`` (``*_nocopy``:
  without that copy, a diagnostic: LMCache has no call that reads into the
  caller's buffer; kvstore's ``get(out=)`` does). Cold: before
  each rep that side's files are fsynced and evicted with
  ``posix_fadvise(DONTNEED)``; warm: in the page cache. kvstore verifies a
  checksum per layer on every read; LMCache does not.
- lookup: ``store.lookup(keys)`` vs ``StorageManager.batched_contains(keys)``
  (what ``LMCacheEngine.lookup`` calls) and a ``contains`` loop (the faster of
  the two is LMCache's figure), ``--lookup-keys`` keys (512: a 128K-token
  prompt), all stored, in small CPU-only stores.

Ratios are kvstore / LMCache (> 1: kvstore faster); ``lmcache_lookup_ratio``
is LMCache's latency over kvstore's. Torch threads are the same for both (one
process); disk threads are ``--io-threads`` on both sides.

Without ``lmcache`` importable, the script re-runs itself with
``.venv-lmcache/bin/python`` (``--lmcache-venv`` or ``$KVSTORE_LMCACHE_VENV``),
or prints ``{"skipped": true, ...}`` and exits 0; ``bash
benchmarks/peers/setup_lmcache.sh`` creates that venv.

Run: ``python benchmarks/bench_lmcache.py [--json] [--quick]``.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (
    Rep,
    base_parser,
    drop_cache,
    emit,
    environment,
    log,
    median,
    run_rounds,
    timed,
)
from _lmcache import (
    GIB,
    LmcApi,
    LmcStore,
    cpu_options,
    disk_options,
    ensure_lmcache,
    host_store,
    kv_keys,
    load_lmcache,
    random_kv,
    same,
    staging,
)

from kvstore import BlockKey, KVLayout, KVStore, StoreConfig
from kvstore.config import parse_size

ROOT = Path(__file__).resolve().parents[1]
VENV_ENV = "KVSTORE_LMCACHE_VENV"
#: kvstore / LMCache, > 1 means kvstore faster (the issue's bars).
TARGETS = {
    "put": 3.0,
    "put_first_fill": 3.0,
    "get": 1.5,
    "disk_get_cold": 1.0,
    "disk_get_warm": 1.0,
}


# -- host: steady state and first fill --------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """What every phase moves: ``blocks`` chunks per rep in calls of ``batch``."""

    layout: KVLayout
    blocks: int
    batch: int

    @property
    def nbytes(self) -> int:
        return self.blocks * self.layout.block_nbytes

    @property
    def nbatches(self) -> int:
        return self.blocks // self.batch


class HostPhase:
    """Put/get into CPU-only stores of both systems, and first fills of fresh ones."""

    def __init__(self, api: LmcApi, sizes: Sizes, capacity: int, fill: int, settle: float):
        self.api, self.sizes, self.fill_capacity, self.settle_s = api, sizes, fill, settle
        layout, batch = sizes.layout, sizes.batch
        self.kv = [random_kv(layout, batch, seed) for seed in range(sizes.nbatches)]
        self.out = [torch.full_like(kv, 1.0) for kv in self.kv]  # written: prefaulted
        self.dst = [torch.full_like(kv, 1.0) for kv in self.kv]
        self.kvs = host_store(layout, capacity)
        self.kvs.engine.datapath.tiers[0].wait_prefault()  # type: ignore[attr-defined]
        self.lmc = LmcStore(api, layout, cpu_options(capacity))
        self._gen = itertools.count(1)
        self.kv_get_keys = [kv_keys(next(self._gen), batch) for _ in self.kv]
        self.lmc_get_keys = [self.lmc.new_keys(batch) for _ in self.kv]
        for kk, lk, kv in zip(self.kv_get_keys, self.lmc_get_keys, self.kv, strict=True):
            assert self.kvs.put(kk, kv) == batch
            self.lmc.put(lk, kv)
        self.kv_put_keys: list[list[BlockKey]] = []
        self.lmc_put_keys: list[list[Any]] = []
        self.open_s: dict[str, list[float]] = {"kvstore": [], "prefault": [], "lmcache": []}

    def kv_put(self) -> float:
        """kvstore: put every batch under new keys (the last rep's deleted first, untimed)."""
        for keys in self.kv_put_keys:
            self.kvs.delete(keys)
        self.kv_put_keys = [kv_keys(next(self._gen), self.sizes.batch) for _ in self.kv]
        start = time.perf_counter()
        for keys, kv in zip(self.kv_put_keys, self.kv, strict=True):
            self.kvs.put(keys, kv)
        return time.perf_counter() - start

    def lmc_put(self) -> float:
        """LMCache: the same puts (the last rep's keys removed first, untimed)."""
        for keys in self.lmc_put_keys:
            self.lmc.remove(keys)
        self.lmc_put_keys = [self.lmc.new_keys(self.sizes.batch) for _ in self.kv]
        start = time.perf_counter()
        for keys, kv in zip(self.lmc_put_keys, self.kv, strict=True):
            self.lmc.put(keys, kv)
        return time.perf_counter() - start

    def kv_get(self) -> None:
        for keys, out in zip(self.kv_get_keys, self.out, strict=True):
            self.kvs.get(keys, out=out)

    def lmc_get(self, copy: bool = True) -> None:
        for keys, out in zip(self.lmc_get_keys, self.out, strict=True):
            self.lmc.get(keys, out if copy else None, "LocalCPUBackend")

    def memcpy(self) -> None:
        """For scale: a contiguous torch ``copy_`` of the same bytes per batch."""
        for dst, src in zip(self.dst, self.kv, strict=True):
            dst.copy_(src)

    def _settle(self) -> None:
        gc.collect()
        time.sleep(self.settle_s)

    def _fill(self, put: Callable[[list[Any], torch.Tensor], object], batches: list[Any]) -> float:
        start = time.perf_counter()
        for keys, kv in zip(batches, self.kv, strict=True):
            put(keys, kv)
        return time.perf_counter() - start

    def kv_first_fill(self, wait: bool) -> Rep:
        """A rep: open a kvstore (``wait``: for its prefault, untimed), time the puts."""

        def rep() -> float:
            self._settle()
            start = time.perf_counter()
            store = host_store(self.sizes.layout, self.fill_capacity)
            opened = time.perf_counter()
            try:
                if wait:
                    store.engine.datapath.tiers[0].wait_prefault()  # type: ignore[attr-defined]
                    self.open_s["kvstore"].append(opened - start)
                    self.open_s["prefault"].append(time.perf_counter() - opened)
                batches = [kv_keys(next(self._gen), self.sizes.batch) for _ in self.kv]
                elapsed = self._fill(store.put, batches)
                assert store.lookup(batches[-1]) == self.sizes.batch, "kvstore lost blocks"
                return elapsed
            finally:
                store.close()

        return rep

    def lmc_first_fill(self) -> float:
        """A rep: open an LMCache storage manager (it pre-touches its memory), time the puts."""
        self._settle()
        lmc = LmcStore(self.api, self.sizes.layout, cpu_options(self.fill_capacity))
        try:
            self.open_s["lmcache"].append(lmc.open_s)
            batches = [lmc.new_keys(self.sizes.batch) for _ in self.kv]
            elapsed = self._fill(lmc.put, batches)
            assert lmc.lookup(batches[-1]) == self.sizes.batch, "LMCache lost chunks"
            return elapsed
        finally:
            lmc.close()

    def subjects(self, reps: int) -> dict[str, tuple[Rep, int]]:
        """Every timed subject: (rep, reps per round); first fills: one per round."""
        return {
            "kv_put": (self.kv_put, reps),
            "lmc_put": (self.lmc_put, reps),
            "kv_get": (timed(self.kv_get), reps),
            "lmc_get": (timed(self.lmc_get), reps),
            "lmc_get_nocopy": (timed(lambda: self.lmc_get(copy=False)), reps),
            "memcpy": (timed(self.memcpy), reps),
            "kv_first_fill": (self.kv_first_fill(wait=True), 1),
            "kv_first_fill_right_after_open": (self.kv_first_fill(wait=False), 1),
            "lmc_first_fill": (self.lmc_first_fill, 1),
        }

    def check(self) -> None:
        """Both handed back exactly what was put (outside any timing)."""
        for out in self.out:
            out.zero_()
        self.kv_get()
        assert all(same(o, kv) for o, kv in zip(self.out, self.kv, strict=True)), "kvstore get"
        for out in self.out:
            out.zero_()
        self.lmc_get()
        assert all(same(o, kv) for o, kv in zip(self.out, self.kv, strict=True)), "LMCache get"

    def close(self) -> None:
        self.kvs.close()
        self.lmc.close()


def run_host(api: LmcApi, sizes: Sizes, args: Any) -> tuple[dict[str, list[float]], HostPhase]:
    """Time the host subjects; returns every rep's seconds and the phase (for open times)."""
    capacity, fill = parse_size(args.capacity), parse_size(args.first_fill_capacity)
    slots = capacity // sizes.layout.block_nbytes
    if 2 * sizes.blocks > 0.9 * slots:  # get set + put set under kvstore's high watermark
        raise SystemExit(f"--capacity holds {slots} blocks; need > {2 * sizes.blocks / 0.9:.0f}")
    log(
        f"host: {sizes.blocks} x {sizes.layout.block_nbytes >> 20} MiB per rep, {args.rounds} "
        f"rounds; first fill into fresh {fill / GIB:.2f} GiB stores, {args.settle_s} s settle"
    )
    phase = HostPhase(api, sizes, capacity, fill, args.settle_s)
    try:
        times = run_rounds(phase.subjects(args.reps), args.rounds)
        phase.check()
    finally:
        phase.close()
    return times, phase


# -- disk ------------------------------------------------------------------------
class DiskPhase:
    """A disk-only kvstore and an LMCache disk backend holding the same chunks."""

    def __init__(self, api: LmcApi, sizes: Sizes, root: Path, io_threads: int) -> None:
        self.sizes, self.root = sizes, root
        layout, batch = sizes.layout, sizes.batch
        self.kv = [random_kv(layout, batch, 100 + seed) for seed in range(sizes.nbatches)]
        self.out = [torch.full_like(kv, 1.0) for kv in self.kv]
        tier = {
            "kind": "disk",
            "path": str(root / "kvstore"),
            "capacity": 4 * sizes.nbytes,
            "io_threads": io_threads,
            "page_cache": "keep",
        }
        self.kvs = KVStore(layout, StoreConfig.from_dict({"tiers": [tier]}, environ={}))
        lmc_staging = staging(batch * layout.block_nbytes)
        self.options = disk_options(root / "lmcache", 4 * sizes.nbytes, lmc_staging, io_threads)
        self.lmc = LmcStore(api, layout, self.options)
        self.kv_keys = [kv_keys(1000 + i, batch) for i in range(sizes.nbatches)]
        self.lmc_keys = [self.lmc.new_keys(batch) for _ in self.kv]
        for kk, lk, kv in zip(self.kv_keys, self.lmc_keys, self.kv, strict=True):
            assert self.kvs.put(kk, kv) == batch
            self.lmc.put(lk, kv)
        for keys in self.lmc_keys:
            self.lmc.wait_written(keys)

    def kv_get(self, cold: bool) -> float:
        """kvstore ``get`` of every batch (``cold``: its files evicted first, untimed)."""
        if cold:
            drop_cache(list((self.root / "kvstore").rglob("*.kvb")))
        start = time.perf_counter()
        for keys, out in zip(self.kv_keys, self.out, strict=True):
            self.kvs.get(keys, out=out)
        return time.perf_counter() - start

    def lmc_get(self, cold: bool, copy: bool = True) -> float:
        """LMCache ``batched_get`` from its disk backend (+ the copy into ``out``)."""
        if cold:
            drop_cache(self.lmc.disk_files())
        start = time.perf_counter()
        for keys, out in zip(self.lmc_keys, self.out, strict=True):
            self.lmc.get(keys, out if copy else None, "LocalDiskBackend")
        return time.perf_counter() - start

    def subjects(self) -> dict[str, tuple[Rep, int]]:
        return {
            "kv_disk_cold": (lambda: self.kv_get(cold=True), 1),
            "lmc_disk_cold": (lambda: self.lmc_get(cold=True), 1),
            "lmc_disk_cold_nocopy": (lambda: self.lmc_get(cold=True, copy=False), 1),
            "kv_disk_warm": (lambda: self.kv_get(cold=False), 1),
            "lmc_disk_warm": (lambda: self.lmc_get(cold=False), 1),
            "lmc_disk_warm_nocopy": (lambda: self.lmc_get(cold=False, copy=False), 1),
        }

    def check(self) -> None:
        """Both read back exactly what was written."""
        for system in ("kvstore", "lmcache"):
            for out in self.out:
                out.zero_()
            if system == "kvstore":
                self.kv_get(cold=True)
            else:
                self.lmc_get(cold=True)
            assert all(same(o, kv) for o, kv in zip(self.out, self.kv, strict=True)), "disk get"

    def close(self) -> None:
        self.kvs.close()
        self.lmc.close()


def run_disk(api: LmcApi, sizes: Sizes, args: Any) -> tuple[dict[str, list[float]], DiskPhase]:
    """Time the disk reads, cold and warm, of both."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-lmcache-bench-", dir=args.dir))
    log(f"disk: {sizes.blocks} chunks per rep under {root}, {args.io_threads} I/O threads each")
    try:
        phase = DiskPhase(api, sizes, root, args.io_threads)
        try:
            times = run_rounds(phase.subjects(), args.rounds)
            phase.check()
        finally:
            phase.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return times, phase


# -- lookup ------------------------------------------------------------------------
def run_lookup(api: LmcApi, n_keys: int, rounds: int, reps: int) -> dict[str, list[float]]:
    """Prefix lookup of ``n_keys`` stored keys: kvstore vs LMCache (small CPU-only stores)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_tokens=256)
    capacity = int(n_keys * layout.block_nbytes / 0.8) + GIB // 64
    log(f"lookup: {n_keys} keys, all stored")
    kvs = host_store(layout, capacity)
    lmc = LmcStore(api, layout, cpu_options(capacity))
    try:
        tokens = torch.randint(0, 128_256, (n_keys * layout.block_tokens,), dtype=torch.int32)
        keys = kvs.hash_tokens(tokens, "bench/llama-3-8b@rev")
        lkeys = lmc.new_keys(n_keys)
        zeros = torch.zeros(layout.tensor_shape(n_keys), dtype=layout.dtype)
        assert kvs.put(keys, zeros) == n_keys
        lmc.put(lkeys, zeros)
        assert kvs.lookup(keys) == lmc.lookup(lkeys) == lmc.lookup_loop(lkeys) == n_keys
        return run_rounds(
            {
                "kv_lookup": (timed(lambda: kvs.lookup(keys)), reps),
                "lmc_lookup_batched": (timed(lambda: lmc.lookup(lkeys)), reps),
                "lmc_lookup_loop": (timed(lambda: lmc.lookup_loop(lkeys)), reps),
            },
            rounds,
        )
    finally:
        kvs.close()
        lmc.close()


# -- report ------------------------------------------------------------------------
def figures(
    sizes: Sizes, host: dict[str, list[float]], disk: dict[str, list[float]]
) -> dict[str, float]:
    """GB/s (median) of every throughput subject."""
    return {name: sizes.nbytes / median(t) / 1e9 for name, t in {**host, **disk}.items()}


def ratios(gbps: dict[str, float], ms: dict[str, float]) -> dict[str, float]:
    """kvstore / LMCache for every bar (lookup: LMCache latency / kvstore latency)."""
    return {
        "lmcache_put_ratio": gbps["kv_put"] / gbps["lmc_put"],
        "lmcache_put_first_fill_ratio": gbps["kv_first_fill"] / gbps["lmc_first_fill"],
        "lmcache_get_ratio": gbps["kv_get"] / gbps["lmc_get"],
        "lmcache_disk_get_cold_ratio": gbps["kv_disk_cold"] / gbps["lmc_disk_cold"],
        "lmcache_disk_get_warm_ratio": gbps["kv_disk_warm"] / gbps["lmc_disk_warm"],
        "lmcache_lookup_ratio": ms["lmcache"] / ms["kvstore"],
    }


def build_result(
    api: LmcApi, sizes: Sizes, times: dict[str, dict[str, list[float]]], phase: HostPhase
) -> dict[str, Any]:
    """The JSON object: ratios first, then each side's raw figures."""
    gbps = figures(sizes, times["host"], times["disk"])
    lk = {name: median(t) * 1e3 for name, t in times["lookup"].items()}
    ms = {
        "kvstore": lk["kv_lookup"],
        "lmcache": min(lk["lmc_lookup_batched"], lk["lmc_lookup_loop"]),
    }
    r = ratios(gbps, ms)
    bars = dict(zip(TARGETS, list(r.values())[:5], strict=True))
    return {
        "benchmark": "lmcache",
        "lmcache_version": api.version,
        **r,
        "kvstore_put_gbps": gbps["kv_put"],
        "lmcache_put_gbps": gbps["lmc_put"],
        "kvstore_put_first_fill_gbps": gbps["kv_first_fill"],
        "lmcache_put_first_fill_gbps": gbps["lmc_first_fill"],
        "kvstore_put_first_fill_right_after_open_gbps": gbps["kv_first_fill_right_after_open"],
        "lmcache_put_first_fill_ratio_right_after_open": gbps["kv_first_fill_right_after_open"]
        / gbps["lmc_first_fill"],
        "kvstore_open_s": median(phase.open_s["kvstore"]),
        "kvstore_prefault_s": median(phase.open_s["prefault"]),
        "lmcache_open_s": median(phase.open_s["lmcache"]),
        "kvstore_get_gbps": gbps["kv_get"],
        "lmcache_get_gbps": gbps["lmc_get"],
        "lmcache_get_nocopy_ms": median(times["host"]["lmc_get_nocopy"]) * 1e3,
        "memcpy_gbps": gbps["memcpy"],
        "kvstore_disk_get_cold_gbps": gbps["kv_disk_cold"],
        "lmcache_disk_get_cold_gbps": gbps["lmc_disk_cold"],
        "kvstore_disk_get_warm_gbps": gbps["kv_disk_warm"],
        "lmcache_disk_get_warm_gbps": gbps["lmc_disk_warm"],
        "lmcache_disk_get_cold_nocopy_gbps": gbps["lmc_disk_cold_nocopy"],
        "lmcache_disk_get_warm_nocopy_gbps": gbps["lmc_disk_warm_nocopy"],
        "kvstore_lookup_ms": ms["kvstore"],
        "lmcache_lookup_ms": ms["lmcache"],
        "lmcache_lookup_batched_ms": lk["lmc_lookup_batched"],
        "lmcache_lookup_loop_ms": lk["lmc_lookup_loop"],
        "targets": dict(TARGETS),
        "meets_target": {name: bars[name] >= bar for name, bar in TARGETS.items()},
    }


def table(result: dict[str, Any]) -> list[list[object]]:
    """The human table."""
    meets, targets = result["meets_target"], result["targets"]
    rows: list[list[object]] = [["figure", "kvstore", "LMCache", "ratio", "target", "meets"]]
    for label, bar, unit in (
        ("put GB/s", "put", "put_gbps"),
        ("put, first fill GB/s", "put_first_fill", "put_first_fill_gbps"),
        ("get GB/s", "get", "get_gbps"),
        ("disk get cold GB/s", "disk_get_cold", "disk_get_cold_gbps"),
        ("disk get warm GB/s", "disk_get_warm", "disk_get_warm_gbps"),
    ):
        kv, lmc = result[f"kvstore_{unit}"], result[f"lmcache_{unit}"]
        rows.append(
            [label, kv, lmc, result[f"lmcache_{bar}_ratio"], f">= {targets[bar]}", meets[bar]]
        )
    rows.append(
        [
            f"lookup ms ({result['lookup_keys']} keys)",
            result["kvstore_lookup_ms"],
            result["lmcache_lookup_ms"],
            result["lmcache_lookup_ratio"],
            "",
            "",
        ]
    )
    rows.append(["memcpy GB/s (for scale)", result["memcpy_gbps"], "", "", "", ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    skip = ensure_lmcache(Path(args.lmcache_venv), Path(__file__), argv)
    if skip is not None:
        print(json.dumps(skip))
        return 0
    api = load_lmcache()
    sizes = Sizes(llama8b(args.layers), args.blocks, args.batch_blocks)
    log(f"LMCache {api.version} vs kvstore, {sizes.nbytes / GIB:.2f} GiB per rep")
    host, phase = run_host(api, sizes, args)
    disk, _ = run_disk(api, sizes, args)
    lookup = run_lookup(api, args.lookup_keys, args.rounds, args.lookup_reps)
    result = build_result(api, sizes, {"host": host, "disk": disk, "lookup": lookup}, phase)
    result.update(settings(args, sizes, api, {**host, **disk, **lookup}))
    emit(result, args.json, table(result))
    return 0


def llama8b(num_layers: int) -> KVLayout:
    """Llama-3-8B's KV layout (32 MiB per 256-token chunk at 32 layers), bf16."""
    return KVLayout(
        num_layers=num_layers, num_kv_heads=8, head_dim=128, block_tokens=256, dtype=torch.bfloat16
    )


def settings(args: Any, sizes: Sizes, api: LmcApi, times: dict[str, list[float]]) -> dict[str, Any]:
    """How the figures were taken."""
    lmc_staging = staging(sizes.batch * sizes.layout.block_nbytes)
    return {
        "block_mib": sizes.layout.block_nbytes / 2**20,
        "blocks_per_rep": sizes.blocks,
        "batch_blocks": sizes.batch,
        "bytes_per_rep": sizes.nbytes,
        "capacity": parse_size(args.capacity),
        "first_fill_capacity": parse_size(args.first_fill_capacity),
        "first_fill_settle_s": args.settle_s,
        "io_threads": args.io_threads,
        "lookup_keys": args.lookup_keys,
        "lmcache_config": {
            "chunk_size": sizes.layout.block_tokens,
            "host": cpu_options(parse_size(args.capacity)),
            "disk": disk_options(Path("<tmp>"), 4 * sizes.nbytes, lmc_staging, args.io_threads),
        },
        "rounds": args.rounds,
        "reps": {name: len(t) for name, t in times.items()},
        "times": times,  # every rep's seconds (bench_peers.py's intervals)
        "environment": {**environment(), "lmcache": api.version},
    }


def parse_args(argv: list[str]) -> Any:
    """Flags; ``--quick`` shrinks sizes and rounds (< 60 s)."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=None, help="chunks per rep (16; quick 2)")
    parser.add_argument("--batch-blocks", type=int, default=None, help="chunks per call (--blocks)")
    parser.add_argument("--layers", type=int, default=None, help="layers per chunk (32; quick 8)")
    parser.add_argument("--capacity", default=None, help="steady-state stores (2GiB; quick 256MiB)")
    parser.add_argument(
        "--first-fill-capacity", default=None, help="fresh stores (4GiB; quick 256MiB)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=None, help="pause before first fills (3; quick 0)"
    )
    parser.add_argument("--reps", type=int, default=3, help="steady reps per subject per round")
    parser.add_argument("--io-threads", type=int, default=4, help="disk threads, both sides")
    parser.add_argument("--lookup-keys", type=int, default=512, help="keys per lookup (512)")
    parser.add_argument("--lookup-reps", type=int, default=20, help="lookup reps per round")
    parser.add_argument("--dir", default=None, help="directory on the disk to test (a temp dir)")
    parser.add_argument(
        "--lmcache-venv",
        default=os.environ.get(VENV_ENV, str(ROOT / ".venv-lmcache")),
        help=f"venv with lmcache, re-run in when it is not importable here (${VENV_ENV})",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.blocks = args.blocks or (2 if quick else 16)
    args.batch_blocks = args.batch_blocks or args.blocks
    if args.blocks % args.batch_blocks:
        raise SystemExit(f"--blocks ({args.blocks}) must be a multiple of --batch-blocks")
    args.layers = args.layers or (8 if quick else 32)
    args.capacity = args.capacity or ("256MiB" if quick else "2GiB")
    args.first_fill_capacity = args.first_fill_capacity or ("256MiB" if quick else "4GiB")
    args.settle_s = args.settle_s if args.settle_s is not None else (0.0 if quick else 3.0)
    args.rounds = args.rounds or (2 if quick else 10)
    if quick:
        args.reps, args.lookup_keys, args.lookup_reps = 1, min(args.lookup_keys, 64), 5
    return args


if __name__ == "__main__":
    sys.exit(main())
