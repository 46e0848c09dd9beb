"""kvstore as a secondary tier of vLLM's offloading connector (``TieringOffloadingSpec``).

vLLM keeps a CPU primary tier and cascades chunks to its ``secondary_tiers``; this
module is such a tier, loaded out of tree::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVStoreTier",
          "module_path": "kvstore.connectors.vllm_offload",
          "config": "/etc/kvstore.yaml"}]}}'

**Blocks.** A vLLM chunk (row ``c`` of the primary tier's memoryview, ``block_size_bytes``
long) is one opaque kvstore block of that many ``uint8``; every copy leaving process
memory carries kvstore's checksum and is verified when read. Keys: the ``OffloadKey``
(block hash + group index) goes through :func:`kvstore.keys.engine_keys` in a namespace
of the model, vLLM's run identity (dtype, hash size, KV groups, parallelism and rank, as
vLLM's own file tier names its directory) and an optional ``salt``, so two models, ranks
or layouts never share a block.

**Jobs.** Stores and loads run on the tier's own threads (``io_threads``), loads first,
copying straight between the primary memory (wrapped with ``torch.frombuffer``, no copy)
and the store. A block that is absent, unreadable or fails its checksum fails its job
(``successful_keys`` lists the blocks that did load) and is never handed to vLLM.

**Lookups** never wait on I/O; they read kvstore's in-memory index:

- a block being stored or loaded by this tier: RETRY;
- held by a tier of this machine (host memory, local disk): HIT;
- held only by a remote tier (S3, a kvstore-server, the cluster): with ``fetch_remote``
  (default) and a local tier in the store, a background copy into the first local tier
  starts and the answer is RETRY until it lands (HIT), fails (MISS) or takes longer than
  ``retry_timeout_s`` (MISS); otherwise HIT, loaded straight from the remote tier;
- held only by a remote tier whose read of the chunk is expected to take longer than
  recomputing its tokens (restore planning, ``restore:`` in the store config: the
  tier's live read speed against the engine's declared prefill speed): MISS, and the
  background copy into the first local tier still starts, so the next request hits;
- unknown to the index, with a shared tier (a disk directory other processes write,
  S3, a server) and ``discover`` (default): a background existence check starts and the
  answer is RETRY until it ends (HIT or MISS) or ``retry_timeout_s`` passes (MISS). A
  remote tier that is down is a miss after at most ``retry_timeout_s``, never a hang.

vLLM asks again for every chunk of a waiting request at every step, so a key answered
HIT from a tier of this machine is answered from a cache (two dict lookups) until
kvstore's change feed, drained once per step (``on_schedule_end``), says its block left
this machine; a load that fails drops it too.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    RequestOffloadingContext,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from kvstore.connectors.vllm_offload_jobs import (
    JobOutcome,
    JobPool,
    TierCounters,
    block_layout,
    load_blocks,
    primary_blocks,
    store_blocks,
    store_config,
)
from kvstore.datapath.contracts import Medium as StoreMedium
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey, Namespace, engine_keys
from kvstore.store import KVStore

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

__all__ = ["KVStoreTier", "KVStoreTierMetrics"]

log = logging.getLogger(__name__)

#: How long a finished probe's verdict stands before a lookup asks again (seconds).
PROBE_TTL_S = 2.0
#: How long a block whose load failed is a MISS before a lookup trusts the index again
#: (a remote tier that is down keeps its index entries: no promotion loop meanwhile).
FAILED_TTL_S = 30.0


class KVStoreTierMetrics:
    """Prometheus names of the tier's own metrics (label ``tier``: the tier type)."""

    READ_BYTES = "vllm:kv_offload_kvstore_read_bytes"
    READ_TIME = "vllm:kv_offload_kvstore_read_seconds"
    WRITE_BYTES = "vllm:kv_offload_kvstore_write_bytes"
    WRITE_TIME = "vllm:kv_offload_kvstore_write_seconds"
    LOOKUP_HITS = "vllm:kv_offload_kvstore_lookup_hits"
    LOOKUP_MISSES = "vllm:kv_offload_kvstore_lookup_misses"
    LOOKUP_RETRIES = "vllm:kv_offload_kvstore_lookup_retries"
    LOAD_FAILURES = "vllm:kv_offload_kvstore_load_failed_blocks"
    STORE_FAILURES = "vllm:kv_offload_kvstore_store_failed_blocks"
    REMOTE_FETCHES = "vllm:kv_offload_kvstore_remote_fetches"
    PLANNED_MISSES = "vllm:kv_offload_kvstore_planned_misses"
    STORED_BLOCKS = "vllm:kv_offload_kvstore_stored_blocks"

    #: counter name -> (attribute of TierCounters, documentation)
    COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        READ_BYTES: ("read_bytes", "Bytes kvstore loaded into vLLM's primary tier."),
        READ_TIME: ("read_seconds", "Seconds kvstore load jobs ran."),
        WRITE_BYTES: ("write_bytes", "Bytes kvstore stored from vLLM's primary tier."),
        WRITE_TIME: ("write_seconds", "Seconds kvstore store jobs ran."),
        LOOKUP_HITS: ("hits", "Chunk lookups kvstore answered HIT."),
        LOOKUP_MISSES: ("misses", "Chunk lookups kvstore answered MISS."),
        LOOKUP_RETRIES: ("retries", "Chunk lookups kvstore answered RETRY."),
        LOAD_FAILURES: ("load_failures", "Chunks a kvstore load job failed to load."),
        STORE_FAILURES: ("store_failures", "Chunks a kvstore store job failed to store."),
        REMOTE_FETCHES: ("fetches", "Chunks fetched from a remote kvstore tier."),
        PLANNED_MISSES: (
            "planned_misses",
            "Chunks on a remote tier answered MISS because recomputing them is faster.",
        ),
    }


@dataclass
class _Job:
    keys: list[OffloadKey]
    is_load: bool


@dataclass
class _Probe:
    """A background existence check or remote fetch of one key (set by a pool thread)."""

    started: float
    found: bool | None = None  # None while it runs
    ended: float = 0.0


@dataclass
class _Settings:
    """The tier's own keys, checked."""

    io_threads: int = 8
    enable_kv_events: bool = True
    fetch_remote: bool = True
    discover: bool = True
    retry_timeout_s: float = 1.0
    namespace: str | None = None
    salt: str | None = None
    locality: str | None = None
    store: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, keys: dict[str, Any]) -> _Settings:
        """Split a tier entry into the tier's settings and the store's config keys."""
        names = set(cls.__dataclass_fields__) - {"store"}
        own = {k: keys.pop(k) for k in list(keys) if k in names}
        for name in ("namespace", "salt", "locality"):
            if own.get(name) is not None and not isinstance(own[name], str):
                raise ConfigError(f"KVStoreTier.{name}: expected a string, got {own[name]!r}")
        if own.get("locality") is not None:
            Locality(own["locality"])  # raises ValueError naming the value
        return cls(**own, store=keys)


class KVStoreTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier whose chunks live in a :class:`~kvstore.store.KVStore`.

    Built by vLLM's ``SecondaryTierFactory`` from a ``secondary_tiers`` entry; its keys
    besides ``type``/``module_path``: ``config`` (a kvstore YAML path or mapping) and/or
    inline store keys (``tiers``, ``replication``, ``lease_s``, ...), and the tier's own
    ``namespace`` (default: vLLM's model name), ``salt``, ``io_threads`` (8),
    ``fetch_remote`` (true), ``discover`` (true), ``retry_timeout_s`` (1.0),
    ``enable_kv_events`` (true; effective when vLLM's KV events are on), ``locality``
    (LOCAL or REMOTE; default from the store's tiers).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **keys: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        settings = _Settings.of(dict(keys))
        self._settings = settings
        layout = block_layout(self.block_size_bytes)
        self._blocks = primary_blocks(primary_kv_view, layout)
        self._store = KVStore(layout, store_config(settings.store))
        self._manager = self._store.engine.datapath
        try:
            self._namespace = _namespace(offloading_spec, layout, settings)
            tiers = self._manager.tiers
            self._local = frozenset(i for i, t in enumerate(tiers) if t.local)
            self._first_local = min(self._local) if self._local else None
            self._shared = any(t.shared for t in tiers)
            default = Locality.LOCAL if self._local else Locality.REMOTE
            self.locality = Locality(settings.locality) if settings.locality else default
            self._events = settings.enable_kv_events and _events_on(offloading_spec)
            # Always watched: the feed also says which cached HIT answers went stale.
            self._feed = self._manager.watch()
            self._pool = JobPool(settings.io_threads)
            self._chunk_tokens = _chunk_tokens(offloading_spec)
        except BaseException:
            self._store.close()
            raise
        self._jobs: dict[int, _Job] = {}
        self._inflight: dict[OffloadKey, int] = {}
        self._probes: dict[OffloadKey, _Probe] = {}
        self._failed: dict[OffloadKey, float] = {}  # key -> when its load failed
        self._names: dict[BlockKey, OffloadKey] = {}
        # Keys answered HIT from a tier of this machine, and their blocks: answered again
        # without the index until the feed says the block left (checked each step).
        self._hit: dict[OffloadKey, BlockKey] = {}
        self._hit_blocks: dict[BlockKey, OffloadKey] = {}
        self._changes: dict[BlockKey, tuple[StoreMedium, StoreMedium]] = {}
        self._answers = {"hits": 0, "misses": 0, "retries": 0}  # the scheduler's thread only
        self._rejected: list[JobOutcome] = []
        self._counters = TierCounters()
        self._closed = False

    # -- metrics --------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The tier's Prometheus metrics, labelled by tier type."""
        metrics: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
            for name, (_, doc) in KVStoreTierMetrics.COUNTERS.items()
        }
        metrics[KVStoreTierMetrics.STORED_BLOCKS] = OffloadingGaugeMetadata(
            documentation="Chunks the kvstore tier holds.", labelnames=("tier",)
        )
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The tier's counters since the last call, and the blocks it holds now."""
        values = self._counters.take()
        for name, count in self._answers.items():
            values[name] = values.get(name, 0) + count
            self._answers[name] = 0
        stats = OffloadingConnectorStats()
        label = (self.tier_type,)
        for name, (attr, _) in KVStoreTierMetrics.COUNTERS.items():
            if values.get(attr):
                stats.increase_counter(name, values[attr], labelvalues=label)
        if not self._closed:
            stats.set_gauge(KVStoreTierMetrics.STORED_BLOCKS, len(self._manager), label)
        return stats

    # -- keys -----------------------------------------------------------------------
    def block_key(self, key: OffloadKey) -> BlockKey:
        """The kvstore key of ``key`` (in this tier's namespace)."""
        return engine_keys([bytes(key)], self._namespace)[0]

    def _keys(self, keys: Iterable[OffloadKey]) -> list[BlockKey]:
        return engine_keys([bytes(k) for k in keys], self._namespace)

    @property
    def store(self) -> KVStore:
        """The kvstore store behind this tier."""
        return self._store

    # -- lookups --------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading (vLLM's default)."""
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT, MISS or RETRY from kvstore's in-memory index (see the module doc)."""
        if key in self._hit and key not in self._inflight:  # the scheduler asks every step
            self._answers["hits"] += 1
            return LookupResult.HIT
        result = self._lookup(key, req_context)
        name = {LookupResult.HIT: "hits", LookupResult.MISS: "misses"}.get(result, "retries")
        self._answers[name] += 1
        return result

    def _lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        if self._closed:
            return LookupResult.MISS
        if key in self._inflight:
            return LookupResult.RETRY
        failed = self._failed.get(key)
        if failed is not None:
            if time.monotonic() - failed < FAILED_TTL_S:
                return LookupResult.MISS
            del self._failed[key]
        block = self.block_key(key)
        levels = self._manager.where(block)
        if levels:
            if self._events:
                self._names[block] = key
            remote_only = not self._local.intersection(levels)
            fetch = self._settings.fetch_remote and self._first_local is not None
            if remote_only and not self._pays(key, levels[0], req_context):
                if fetch:  # recomputed now; the background fetch warms it for next time
                    self._probe(key, block, fetch=True)
                self._counters.add(planned_misses=1)
                return LookupResult.MISS
            if remote_only and fetch:
                return self._probe(key, block, fetch=True)
            self._probes.pop(key, None)
            if not remote_only:
                self._hit[key] = block
                self._hit_blocks[block] = key
            return LookupResult.HIT
        if self._settings.discover and self._shared:
            return self._probe(key, block, fetch=False)
        return LookupResult.MISS

    def _pays(self, key: OffloadKey, level: int, req_context: ReqContext | None) -> bool:
        """Whether loading ``key``'s chunk from remote tier ``level`` beats recomputing it
        (restore planning; true when it cannot tell: its position or the prefill speed
        unknown, or planning off)."""
        end = req_context.get_offload_key_position(key) if req_context is not None else None
        if end is None or self._chunk_tokens is None:
            return True
        tokens = (max(0, end - self._chunk_tokens), end)
        return self._manager.chunk_pays(level, self.block_size_bytes, tokens) is not False

    def _probe(self, key: OffloadKey, block: BlockKey, fetch: bool) -> LookupResult:
        """RETRY while a background check (or fetch) of ``key`` runs, within the timeout;
        then the verdict: HIT if found, MISS if not or if it ran too long."""
        now = time.monotonic()
        probe = self._probes.get(key)
        if probe is not None and probe.found is not None and now - probe.ended > PROBE_TTL_S:
            probe = None  # stale verdict: ask again
        if probe is None:
            probe = self._probes[key] = _Probe(started=now)
            run = functools.partial(self._check, block, fetch)
            if not self._pool.submit(-1, run, done=functools.partial(_settle, probe)):
                probe.found, probe.ended = False, now
        if probe.found is None:
            if now - probe.started < self._settings.retry_timeout_s:
                return LookupResult.RETRY
            return LookupResult.MISS
        # A fetch that landed or a check that found the key: the index says which tier.
        return LookupResult.HIT if probe.found else LookupResult.MISS

    def _check(self, block: BlockKey, fetch: bool) -> list[bool]:
        """On a pool thread: copy ``block`` into the first local tier, or ask the
        shared tiers whether they hold it."""
        if fetch:
            assert self._first_local is not None
            landed = self._manager.promote([block], self._first_local) == 1
            self._counters.add(fetches=int(landed))
            return [landed or bool(self._local.intersection(self._manager.where(block)))]
        return self._manager.exists([block])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """No-op: kvstore's policies see a block's use when it is read."""
        return

    # -- jobs -----------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a store of the job's primary chunks into kvstore (non-blocking)."""
        keys = list(job_metadata.keys)
        blocks = self._keys(keys)
        if self._events:
            self._names.update(zip(blocks, keys, strict=True))
        views = [self._blocks[int(c)] for c in job_metadata.chunk_ids]
        run = functools.partial(store_blocks, self._manager, blocks, views)
        self._submit(job_metadata.job_id, keys, run, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a load of the job's keys into its primary chunks (non-blocking)."""
        keys = list(job_metadata.keys)
        outs = [self._blocks[int(c)] for c in job_metadata.chunk_ids]
        run = functools.partial(load_blocks, self._manager, self._keys(keys), outs)
        self._submit(job_metadata.job_id, keys, run, is_load=True)

    def _submit(self, job_id: int, keys: list[OffloadKey], run: Any, is_load: bool) -> None:
        self._jobs[job_id] = _Job(keys, is_load)
        for key in keys:
            self._inflight[key] = self._inflight.get(key, 0) + 1
        nbytes = len(keys) * self.block_size_bytes
        if not self._pool.submit(job_id, run, nbytes=nbytes, is_load=is_load):
            self._rejected.append(JobOutcome(job_id, [], nbytes, 0.0, is_load))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Results of the jobs finished since the last call."""
        outcomes = self._rejected + self._pool.finished()
        self._rejected = []
        return [self._result(outcome) for outcome in outcomes]

    def _result(self, outcome: JobOutcome) -> JobResult:
        job = self._jobs.pop(outcome.job_id)
        for key in job.keys:
            left = self._inflight.pop(key) - 1
            if left:
                self._inflight[key] = left
        ok = outcome.ok if len(outcome.ok) == len(job.keys) else [False] * len(job.keys)
        good = [k for k, fine in zip(job.keys, ok, strict=True) if fine]
        nbytes = len(good) * self.block_size_bytes
        if job.is_load:
            now = time.monotonic()
            bad = [k for k, fine in zip(job.keys, ok, strict=True) if not fine]
            self._failed.update((k, now) for k in bad)
            for k in bad:
                self._forget_hit(k)
            self._counters.add(
                read_bytes=nbytes,
                read_seconds=outcome.seconds,
                load_failures=len(job.keys) - len(good),
            )
        else:
            self._counters.add(
                write_bytes=nbytes,
                write_seconds=outcome.seconds,
                store_failures=len(job.keys) - len(good),
            )
        success = len(good) == len(job.keys)
        partial = job.is_load and not success and bool(good)
        return JobResult(
            job_id=outcome.job_id,
            success=success,
            successful_keys=tuple(good) if partial else None,
            transfer_time=outcome.seconds,
            transfer_bytes=nbytes,
        )

    def has_pending_work(self) -> bool:
        """Whether jobs or background checks are still running (the engine keeps stepping)."""
        return bool(self._jobs) or self._pool.busy > 0

    def _forget_hit(self, key: OffloadKey) -> None:
        block = self._hit.pop(key, None)
        if block is not None:
            self._hit_blocks.pop(block, None)

    def _drain(self) -> None:
        """Take kvstore's changes: cached HITs of blocks that left this machine go; with
        events on, the changes wait for :meth:`take_events` (merged: first before, last now)."""
        for block, (before, now) in self._feed.drain().items():
            if now not in (StoreMedium.MEMORY, StoreMedium.DISK):
                key = self._hit_blocks.pop(block, None)
                if key is not None:
                    self._hit.pop(key, None)
            if self._events:
                was = self._changes.get(block)
                self._changes[block] = (before if was is None else was[0], now)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Check cached HITs against kvstore's changes; forget old verdicts now and then."""
        if not self._closed:
            self._drain()
        now = time.monotonic()
        if len(self._probes) > 4096:
            self._probes = {
                k: p
                for k, p in self._probes.items()
                if p.found is None or now - p.ended <= PROBE_TTL_S
            }
        if len(self._failed) > 4096:
            self._failed = {k: t for k, t in self._failed.items() if now - t < FAILED_TTL_S}

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (results stay to be collected)."""
        self._pool.wait_idle()

    # -- events ---------------------------------------------------------------------
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks kvstore stored (``removed=False``) or dropped (``removed=True``) since
        the last call: LOCAL for memory and local disk, REMOTE for shared remote tiers."""
        if not self._events or self._closed:
            return []
        self._drain()
        changes, self._changes = self._changes, {}
        return _events({b: c for b, c in changes.items() if c[0] != c[1]}, self._names)

    # -- the end --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish the running jobs, fail the queued ones, close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown()
        self._manager.unwatch(self._feed)
        self._store.close()
        self._blocks = self._blocks.new_empty(0)  # let vLLM unmap its primary memory


def _chunk_tokens(spec: Any) -> int | None:
    """Prompt tokens one offloaded chunk holds (None: the spec does not say)."""
    per_block = getattr(spec, "tokens_per_block", None)
    blocks = getattr(spec, "blocks_per_chunk", None)
    if not isinstance(per_block, (tuple, list)) or not per_block:
        return None
    if not all(isinstance(n, int) and n > 0 for n in per_block):
        return None
    if not isinstance(blocks, int) or blocks <= 0:
        return None
    return int(max(per_block)) * blocks


def _settle(probe: _Probe, outcome: JobOutcome) -> None:
    """A pool thread's verdict on a probe (a failed check is a miss)."""
    probe.ended = time.monotonic()
    probe.found = bool(outcome.ok) and all(outcome.ok)


def _events_on(spec: Any) -> bool:
    config = getattr(spec, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))


def _namespace(spec: Any, layout: Any, settings: _Settings) -> Namespace:
    """The model and vLLM's run identity (as vLLM's own file tier names its directory)."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=spec, blocks_per_file=1, parallel_agnostic=True
    )
    identity = repr(sorted(mapper.get_run_config().items())) + f"|rank={mapper.rank}"
    salt = identity if settings.salt is None else f"{identity}|{settings.salt}"
    model = settings.namespace or spec.config.model.name
    return Namespace(model=model, layout=layout, salt=salt)


_LOCALITY = {
    StoreMedium.MEMORY: Locality.LOCAL,
    StoreMedium.DISK: Locality.LOCAL,
    StoreMedium.SHARED: Locality.REMOTE,
}


def _events(
    changes: dict[BlockKey, tuple[StoreMedium, StoreMedium]],
    names: dict[BlockKey, OffloadKey],
) -> list[OffloadingEvent]:
    """Store and removal events from kvstore's changes (keys this tier never named
    are skipped: blocks of an earlier run nobody looked up)."""
    grouped: dict[tuple[bool, Locality], list[OffloadKey]] = {}
    for block, (before, now) in changes.items():
        key = names.get(block)
        if key is None:
            continue
        was, will = _LOCALITY.get(before), _LOCALITY.get(now)
        if was == will:
            continue  # memory <-> disk: still on this machine
        if was is not None:
            grouped.setdefault((True, was), []).append(key)
        if will is not None:
            grouped.setdefault((False, will), []).append(key)
        else:
            names.pop(block, None)
    return [
        OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=removed, locality=locality)
        for (removed, locality), keys in grouped.items()
    ]
