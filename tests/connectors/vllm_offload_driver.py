"""Drives :class:`kvstore.connectors.vllm_offload.KVStoreTier` through vLLM's own
``TieringOffloadingManager`` with a CPU primary tier (run with .venv-vllm's python).

``python vllm_offload_driver.py WORKDIR`` runs every scenario and prints one JSON line:
``{scenario: {check: value}}``; tests/connectors/test_vllm_offload.py asserts on it.
Helpers here are shared with benchmarks/bench_vllm_tier.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

MODULE = "kvstore.connectors.vllm_offload"
CHUNK = 64 * 1024  # bytes per chunk in the tests (a multiple of the page size)
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_spec(events: bool = True, model: str = "test-model") -> Any:
    """A spec like vLLM's tests build: a real OffloadingConfig on a mock."""
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    spec.blocks_per_chunk = 1
    spec.tokens_per_block = (16,)
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=events, self_describing_kv_events=False
    )
    return spec


def key(n: int) -> OffloadKey:
    """The OffloadKey of chunk ``n``: block hash ``n % 2**32`` in KV group ``n >> 32`` (0
    for the small numbers most scenarios use; :func:`grouped` names the others)."""
    return make_offload_key((n & 0xFFFFFFFF).to_bytes(8, "big"), n >> 32)


def grouped(block_hash: int, group: int) -> int:
    """The chunk number of ``block_hash`` in KV group ``group`` (:func:`key`)."""
    return group << 32 | block_hash


def number(k: OffloadKey) -> int:
    """The chunk number of ``k`` (the inverse of :func:`key`)."""
    return grouped(int.from_bytes(k[:8], "big"), get_offload_group_idx(k))


def chunk_bytes(n: int, size: int = CHUNK) -> np.ndarray:
    """Deterministic content of key ``n``."""
    return np.random.default_rng(n).integers(0, 256, size, dtype=np.uint8)


class Harness:
    """A TieringOffloadingManager: CPU primary of ``chunks`` rows and one secondary tier."""

    def __init__(
        self, tier_config: dict[str, Any], chunks: int = 16, size: int = CHUNK, **spec: Any
    ) -> None:
        self.size = size
        self.region = SharedOffloadRegion(
            engine_id=f"kvs-{uuid.uuid4().hex[:12]}",
            num_chunks=chunks,
            rank=None,
            kv_bytes_per_chunk=size,
            cpu_page_size=size,
        )
        self.primary = CPUPrimaryTierOffloadingManager(
            num_chunks=chunks, mmap_region=self.region, enable_events=True
        )
        view = self.primary.get_kv_memoryview()
        self.rows = np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(chunks, size)
        self.tier: SecondaryTierManager = SecondaryTierFactory.create_secondary_tier(
            dict(tier_config), view, make_spec(**spec)
        )
        self.manager = TieringOffloadingManager(self.primary, [self.tier])
        self.results: list[JobResult] = []
        finished = self.tier.get_finished_jobs

        def recording() -> list[JobResult]:
            out = list(finished())
            self.results.extend(out)
            return out

        self.tier.get_finished_jobs = recording  # type: ignore[method-assign]
        self._req = 0

    def request(self) -> ReqContext:
        self._req += 1
        ctx = ReqContext(req_id=f"r{self._req}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self, until: Callable[[], bool] | None = None, timeout: float = 20.0) -> None:
        """Engine steps until ``until()`` (default: no pending work)."""
        done = until or (lambda: not self.manager.has_pending_work())
        deadline = time.monotonic() + timeout
        while True:
            self.manager.on_schedule_end(END)
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the tier did not finish in time")
            time.sleep(0.002)

    def store(self, ns: list[int]) -> None:
        """GPU -> primary (fake) for keys ``ns``, then the cascade to the tier."""
        ctx = self.request()
        keys = [key(n) for n in ns]
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[int(cid)] = chunk_bytes(number(k), self.size)
        self.manager.complete_store(out.keys_to_store, ctx)
        self.step()
        self.manager.on_request_finished(ctx)
        self.step()

    def lookups(
        self, ns: list[int], timeout: float = 20.0, positions: bool = False
    ) -> list[LookupResult]:
        """Look up each key of a new request until none answers RETRY / HIT_PENDING
        (``positions``: the request says where each key ends, 16 tokens a chunk)."""
        ctx = self.request()
        if positions:
            for i, n in enumerate(ns):
                ctx.set_offload_key_position(key(n), 16 * (i + 1))
        pending = {LookupResult.RETRY, LookupResult.HIT_PENDING}
        deadline = time.monotonic() + timeout
        while True:
            results = [self.manager.lookup(key(n), ctx) for n in ns]
            self.manager.on_schedule_end(END)
            if not pending.intersection(results) or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        self.manager.on_request_finished(ctx)
        self.step()
        return results

    def loaded_equal(self, ns: list[int]) -> list[bool]:
        """Whether the primary holds each key's exact bytes."""
        ctx = self.request()
        spec = self.manager.prepare_load([key(n) for n in ns], ctx)
        ok = [
            bool(np.array_equal(self.rows[int(c)], chunk_bytes(n, self.size)))
            for n, c in zip(ns, spec.chunk_ids, strict=True)
        ]
        self.manager.complete_load([key(n) for n in ns], ctx)
        self.manager.on_request_finished(ctx)
        return ok

    def events(self) -> list[tuple[bool, str, list[int]]]:
        return [
            (e.removed, e.locality.value, sorted(int.from_bytes(k[:8], "big") for k in e.keys))
            for e in self.manager.take_events()
            if e.ownership is None and e.medium.value == "STORAGE"
        ]

    def close(self) -> None:
        del self.rows  # vLLM unmaps the primary memory at shutdown
        self.manager.shutdown()


def disk_tier(path: Path, capacity: int = 64 * CHUNK, **extra: Any) -> dict[str, Any]:
    """A KVStoreTier entry with one kvstore disk tier (checksums always on)."""
    disk = {"kind": "disk", "path": str(path), "capacity": capacity, "io_threads": 2}
    return {"type": "KVStoreTier", "module_path": MODULE, "tiers": [disk], **extra}


def block_files(path: Path) -> Iterator[Path]:
    return path.rglob("*.kvb")


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:  # one flipped byte, as tests/tiers/test_disk.py does
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- scenarios -----------------------------------------------------------------------
def scenario_roundtrip(work: Path) -> dict[str, Any]:
    h = Harness(disk_tier(work / "disk"))
    try:
        h.store([1, 2, 3])
        stored = h.events()
        store_ok = [r.success for r in h.results]
        h.manager.reset_cache()  # the primary forgets: the chunks must come from kvstore
        first = h.lookups([1, 2, 3, 99])
        return {
            "store_jobs_ok": store_ok,
            "events": stored,
            "lookups": [r.name for r in first],
            "equal": h.loaded_equal([1, 2, 3]),
            "stats": h.manager.get_stats().reduce(),
        }
    finally:
        h.close()


def scenario_groups(work: Path) -> dict[str, Any]:
    """A hybrid model's chunks: one block hash in each of four KV cache groups (an
    attention group and three Mamba state groups, as vLLM's offloading keys them), each
    group's row its own bytes."""
    h = Harness(disk_tier(work / "disk"))
    try:
        chunks = [grouped(b, g) for b in (40, 41) for g in range(4)]
        h.store(chunks)
        h.manager.reset_cache()
        looked = h.lookups([*chunks, grouped(40, 4)])  # a group never stored
        return {
            "lookups": [r.name for r in looked],
            "equal": h.loaded_equal(chunks),
            "store_jobs_ok": [r.success for r in h.results],
        }
    finally:
        h.close()


def scenario_eviction(work: Path) -> dict[str, Any]:
    h = Harness(disk_tier(work / "disk", capacity=4 * CHUNK), chunks=16)
    try:
        events = []
        for first in range(10, 18, 2):
            h.store([first, first + 1])
            events += h.events()
        # An eviction the last stores set off runs in the background: let it finish, so
        # that its events are in before the lookups (a loaded machine once lost one).
        h.tier.store.flush()  # type: ignore[attr-defined]
        events += h.events()
        h.manager.reset_cache()
        looked = h.lookups(list(range(10, 18)))
        return {"events": events, "lookups": [r.name for r in looked]}
    finally:
        h.close()


def scenario_restart(work: Path) -> dict[str, Any]:
    h = Harness(disk_tier(work / "disk"))
    h.store([5, 6])
    h.close()
    h = Harness(disk_tier(work / "disk"))
    try:
        looked = h.lookups([5, 6])
        return {"lookups": [r.name for r in looked], "equal": h.loaded_equal([5, 6])}
    finally:
        h.close()


def scenario_corrupt(work: Path) -> dict[str, Any]:
    h = Harness(disk_tier(work / "disk"))
    try:
        h.store([7, 8])
        name = h.tier.block_key(key(8)).hex()  # type: ignore[attr-defined]
        bad = next((work / "disk").rglob(f"{name}.kvb"))
        flip_byte(bad)
        h.manager.reset_cache()
        h.results.clear()
        looked = h.lookups([7, 8])
        loads = [
            (r.success, [int.from_bytes(k[:8], "big") for k in r.successful_keys or []])
            for r in h.results
        ]
        return {
            "lookups": [r.name for r in looked],
            "loads": loads,
            "equal_good": h.loaded_equal([7]),
            "again": [r.name for r in h.lookups([8])],
            "file_left": os.path.exists(bad),
        }
    finally:
        h.close()


def s3_entry(server: Any, **extra: Any) -> dict[str, Any]:
    """A kvstore S3 tier on ``server`` that gives up quickly when it is down."""
    return {
        "kind": "s3",
        "bucket": server.bucket,
        "endpoint_url": server.url,
        "prefix": uuid.uuid4().hex[:8],
        "connect_timeout": 0.5,
        "read_timeout": 1.0,
        "deadline": 2.0,
        "max_attempts": 2,
        "retry_interval": 0.5,
        "codec": "raw",
        **extra,
    }


class MotoProcess:
    """moto's S3 server as a child process of ``python`` (a venv that has moto), with
    one bucket; this venv needs only boto3 (the kvstore S3 tier's client)."""

    def __init__(self, python: str, bucket: str = "kvstore-vllm-tier") -> None:
        from kvstore.cli.servers import DUMMY_AWS_ENV, HOST, free_port

        os.environ.update(DUMMY_AWS_ENV)
        self.bucket, self.port = bucket, free_port()
        self.url = f"http://{HOST}:{self.port}"
        args = [python, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.1)
        try:
            import boto3

            client = boto3.session.Session().client(
                "s3", endpoint_url=self.url, region_name=DUMMY_AWS_ENV["AWS_DEFAULT_REGION"]
            )
            client.create_bucket(Bucket=bucket)
            client.close()
        except BaseException:  # never leave the server behind
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def scenario_s3(work: Path) -> dict[str, Any]:
    if not MOTO_PYTHON:
        return {"skipped": "no --moto-python given"}
    server = MotoProcess(MOTO_PYTHON)
    out: dict[str, Any] = {}
    try:
        host = {"kind": "host", "capacity": 16 * CHUNK, "prefault": False}
        entry = {"type": "KVStoreTier", "module_path": MODULE, "retry_timeout_s": 10.0}
        h = Harness({**entry, "tiers": [host, s3_entry(server)]})
        try:
            h.store([21, 22])
            store = h.tier.store  # type: ignore[attr-defined]
            store.flush()
            blocks = [h.tier.block_key(key(n)) for n in (21, 22)]  # type: ignore[attr-defined]
            out["dropped_local"] = store.engine.datapath.drop_local(blocks)
            out["events"] = h.events()
            h.manager.reset_cache()
            out["fetch_lookups"] = [r.name for r in h.lookups([21, 22])]
            out["fetch_equal"] = h.loaded_equal([21, 22])
        finally:
            h.close()
        h = Harness({**entry, "retry_timeout_s": 1.0, "tiers": [s3_entry(server)]})
        try:
            h.store([31, 32])
            out["down_store_ok"] = [r.success for r in h.results]
            server.stop()
            h.manager.reset_cache()
            h.results.clear()
            start = time.monotonic()
            out["down_lookups"] = [r.name for r in h.lookups([31, 32, 33])]
            out["down_seconds"] = round(time.monotonic() - start, 2)
            out["down_loads"] = [r.success for r in h.results]
        finally:
            h.close()
    finally:
        server.stop()
    return out


def scenario_planned(work: Path) -> dict[str, Any]:
    """Restore planning: chunks only on an S3 tier declared too slow to beat recomputing
    them are a MISS at once, and the background fetch warms them for the next request."""
    if not MOTO_PYTHON:
        return {"skipped": "no --moto-python given"}
    server = MotoProcess(MOTO_PYTHON)
    out: dict[str, Any] = {}
    try:
        host = {"kind": "host", "capacity": 16 * CHUNK, "prefault": False}
        slow = s3_entry(server, read_gbps=1e-6, read_latency_ms=5000.0)
        entry = {"type": "KVStoreTier", "module_path": MODULE, "retry_timeout_s": 10.0}
        restore = {"prefill_tokens_per_s": 1e6}
        h = Harness({**entry, "tiers": [host, slow], "restore": restore})
        try:
            h.store([41, 42])
            store = h.tier.store  # type: ignore[attr-defined]
            store.flush()
            blocks = [h.tier.block_key(key(n)) for n in (41, 42)]  # type: ignore[attr-defined]
            out["dropped_local"] = store.engine.datapath.drop_local(blocks)
            h.manager.reset_cache()
            start = time.monotonic()
            out["planned_lookups"] = [r.name for r in h.lookups([41, 42], positions=True)]
            out["planned_seconds"] = round(time.monotonic() - start, 2)
            store.engine.datapath.mover.drain(10.0)
            h.step(lambda: all(0 in store.engine.datapath.where(b) for b in blocks))
            out["warmed"] = [0 in store.engine.datapath.where(b) for b in blocks]
            h.manager.reset_cache()
            out["next_lookups"] = [r.name for r in h.lookups([41, 42], positions=True)]
            out["next_equal"] = h.loaded_equal([41, 42])
            out["restore"] = store.stats()["restore"]
        finally:
            h.close()
        h = Harness({**entry, "tiers": [host, slow], "restore": {**restore, "planning": False}})
        try:
            h.store([51])
            store = h.tier.store  # type: ignore[attr-defined]
            store.flush()
            store.engine.datapath.drop_local([h.tier.block_key(key(51))])  # type: ignore[attr-defined]
            h.manager.reset_cache()
            out["off_lookups"] = [r.name for r in h.lookups([51], positions=True)]
        finally:
            h.close()
    finally:
        server.stop()
    return out


def run(work: Path, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        start = time.monotonic()
        try:
            out[name] = globals()[f"scenario_{name}"](work / name)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        out[name]["seconds"] = round(time.monotonic() - start, 2)
    return out


SCENARIOS = ["roundtrip", "groups", "eviction", "restart", "corrupt", "s3", "planned"]

MOTO_PYTHON = ""

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--moto-python" in args:
        at = args.index("--moto-python")
        MOTO_PYTHON = args[at + 1]
        del args[at : at + 2]
    workdir = Path(args[0])
    chosen = args[1:] or SCENARIOS
    print(json.dumps(run(workdir, chosen)), flush=True)
