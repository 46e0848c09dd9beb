"""The machinery behind :class:`~kvstore.connectors.vllm_offload.KVStoreTier`, free of vLLM.

- :func:`block_layout` and :func:`primary_blocks`: one vLLM chunk is one opaque kvstore
  block of ``block_size_bytes`` ``uint8``; the primary tier's memoryview is wrapped once
  (``torch.frombuffer``, no copy) and chunk ``c`` is the view of row ``c``.
- :func:`store_config`: the store's :class:`~kvstore.config.StoreConfig` from the tier's own
  keys (a YAML ``config`` path and/or inline top-level keys), through kvstore.config only.
- :class:`JobPool`: the threads that run loads, stores and background probes, loads
  first; it keeps every job's result until it is collected, and never loses one
  (a job cancelled by :meth:`JobPool.shutdown` reports a failure).
- :func:`load_blocks` / :func:`store_blocks`: the copies, run on the pool's threads.
- :class:`TierCounters`: what :meth:`KVStoreTier.get_stats` reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.config import StoreConfig
from kvstore.datapath.contracts import DataPath
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout

__all__ = [
    "JobOutcome",
    "JobPool",
    "TierCounters",
    "block_layout",
    "load_blocks",
    "primary_blocks",
    "store_blocks",
    "store_config",
]

log = logging.getLogger(__name__)

#: Keys of a tier entry that are the tier's own, not the store's config.
TIER_KEYS = frozenset(
    {
        "config",
        "namespace",
        "salt",
        "io_threads",
        "enable_kv_events",
        "locality",
        "fetch_remote",
        "discover",
        "retry_timeout_s",
    }
)


def block_layout(block_size_bytes: int) -> KVLayout:
    """The layout of one opaque vLLM chunk: ``block_size_bytes`` raw bytes (uint8)."""
    if block_size_bytes <= 0:
        raise ConfigError(f"block_size_bytes must be > 0, got {block_size_bytes}")
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=block_size_bytes,
        block_tokens=1,
        dtype=torch.uint8,
        kv_factor=1,
    )


def primary_blocks(view: memoryview, layout: KVLayout) -> torch.Tensor:
    """The primary tier's memory as ``(num_chunks, *layout.block_shape)`` uint8, no copy.

    Row ``c`` is chunk ``c`` (``view[c]``: vLLM's rows are ``strides[0]`` bytes apart
    and contiguous). A read-only buffer is refused: loads write into it.
    """
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if flat.readonly:
        raise ConfigError("the primary tier's memoryview is read-only")
    nbytes = layout.block_nbytes
    if len(flat) % nbytes:
        raise ConfigError(f"primary view of {len(flat)} bytes is not whole chunks of {nbytes}")
    whole = torch.frombuffer(flat, dtype=torch.uint8)
    return whole.view(len(flat) // nbytes, *layout.block_shape)


def store_config(keys: Mapping[str, Any]) -> StoreConfig:
    """The store's config from a tier entry: ``config`` (a YAML path or a mapping) with
    the entry's other store keys (``tiers``, ``replication``, ``lease_s``, ...) over it.

    The tier's own keys (:data:`TIER_KEYS`) are left out. With neither, kvstore's usual
    source applies (``$KVSTORE_CONFIG``, else the embedded default).
    """
    inline = {k: v for k, v in keys.items() if k not in TIER_KEYS}
    source = keys.get("config")
    if source is None and not inline:
        return StoreConfig.load(None)
    if source is None:
        return StoreConfig.load(inline)
    base = StoreConfig.load(source)
    if not inline:
        return base
    merged = base.to_dict()  # the environment is already in it, where it applies
    merged.update(inline)
    return StoreConfig.from_dict(merged, environ={})


@dataclass
class JobOutcome:
    """What a finished job reports: which of its keys succeeded, bytes and seconds."""

    job_id: int
    ok: list[bool]
    nbytes: int
    seconds: float
    is_load: bool


def load_blocks(
    manager: DataPath, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]
) -> list[bool]:
    """Copy ``keys`` into ``outs`` (one block view each); which loaded.

    A block that is absent, unreadable or fails its checksum is a ``False`` (its bytes
    in ``outs`` are unspecified, never reported as data); the others still load.
    """
    ok = [False] * len(keys)
    i = 0
    while i < len(keys):
        try:
            got = manager.get(keys[i:], outs[i:], prefix=True)
        except Exception:  # a tier failing is a miss, never an exception into vLLM
            log.exception("kvstore load of %d blocks failed", len(keys) - i)
            got = 0
        ok[i : i + got] = [True] * got
        i += got + 1  # the block at i + got failed: go on after it
    return ok


def store_blocks(
    manager: DataPath, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]
) -> list[bool]:
    """Store ``blocks`` under ``keys`` (keys already stored are not rewritten); which are
    stored afterwards."""
    try:
        manager.put(keys, blocks)
    except Exception:
        log.exception("kvstore store of %d blocks failed", len(keys))
    return [manager.contains(k) for k in keys]


@dataclass
class _Task:
    job_id: int
    run: Callable[[], list[bool]]
    nbytes: int
    is_load: bool
    #: Called with the outcome on the worker thread (background probes use it).
    done: Callable[[JobOutcome], None] | None = None


@dataclass
class _Queues:
    loads: deque[_Task] = field(default_factory=deque)
    other: deque[_Task] = field(default_factory=deque)

    def ready(self) -> bool:
        """Whether a task waits."""
        return bool(self.loads or self.other)

    def pop(self) -> _Task | None:
        if self.loads:
            return self.loads.popleft()
        if self.other:
            return self.other.popleft()
        return None

    def clear(self) -> list[_Task]:
        dropped = [*self.loads, *self.other]
        self.loads.clear()
        self.other.clear()
        return dropped


class JobPool:
    """``threads`` workers running jobs, loads before anything else.

    Finished jobs (those with no ``done`` callback) queue up for :meth:`finished`;
    :meth:`wait_idle` blocks until nothing runs or waits; :meth:`shutdown` lets the
    running jobs finish and reports every queued one as failed.
    """

    def __init__(self, threads: int, name: str = "kvstore-vllm") -> None:
        if threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {threads}")
        self._queues = _Queues()
        self._cond = threading.Condition()
        self._busy = 0  # jobs queued or running
        self._stop = False
        self._finished: deque[JobOutcome] = deque()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        job_id: int,
        run: Callable[[], list[bool]],
        *,
        nbytes: int = 0,
        is_load: bool = False,
        done: Callable[[JobOutcome], None] | None = None,
    ) -> bool:
        """Queue a job; False (and nothing queued) once the pool is shut down."""
        task = _Task(job_id, run, nbytes, is_load, done)
        with self._cond:
            if self._stop:
                return False
            (self._queues.loads if is_load else self._queues.other).append(task)
            self._busy += 1
            self._cond.notify()
        return True

    def finished(self) -> list[JobOutcome]:
        """The outcomes of jobs finished since the last call."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    @property
    def busy(self) -> int:
        """Jobs queued or running."""
        return self._busy

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    def shutdown(self) -> None:
        """Fail the queued jobs, let the running ones finish, stop the threads."""
        with self._cond:
            self._stop = True
            dropped = self._queues.clear()
            self._cond.notify_all()
        for task in dropped:
            self._complete(task, JobOutcome(task.job_id, [], task.nbytes, 0.0, task.is_load))
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._queues.ready())
                task = self._queues.pop()
            if task is None:  # stopping, and nothing left
                return
            self._run(task)
            del task  # hold no view of vLLM's memory while idle

    def _run(self, task: _Task) -> None:
        start = time.perf_counter()
        try:
            ok = task.run()
        except Exception:
            log.exception("kvstore vLLM tier job %d failed", task.job_id)
            ok = []
        seconds = time.perf_counter() - start
        self._complete(task, JobOutcome(task.job_id, ok, task.nbytes, seconds, task.is_load))

    def _complete(self, task: _Task, outcome: JobOutcome) -> None:
        if task.done is not None:
            try:
                task.done(outcome)
            except Exception:
                log.exception("kvstore vLLM tier callback of job %d failed", task.job_id)
        else:
            self._finished.append(outcome)
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()


@dataclass
class TierCounters:
    """Counters of one tier since the last :meth:`take` (thread-safe)."""

    values: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **amounts: float) -> None:
        """Add to counters by name."""
        with self.lock:
            for name, amount in amounts.items():
                self.values[name] = self.values.get(name, 0) + amount

    def take(self) -> dict[str, float]:
        """The counters, reset to zero."""
        with self.lock:
            values, self.values = self.values, {}
        return values
