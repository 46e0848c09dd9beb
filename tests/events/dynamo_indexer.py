"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime
1.6.1 in ``.venv-dynamo``; ``bash scripts/setup-dynamo.sh``) as a test fixture.

:class:`DynamoIndexer` starts it on a free HTTP port, subscribes it to ZMQ publishers
(``--workers`` at start, or :meth:`DynamoIndexer.register` later), queries it and stops
it (its whole process group). What follows was read from Dynamo's Rust sources
(lib/kv-router: services/indexer, zmq_wire, protocols) and checked against 1.6.1 here;
a publisher that wants its events counted must follow it.

CLI: ``--port`` (8090), ``--threads`` (4), and for workers subscribed at start
``--workers "id[:dp_rank]=tcp://host:port,..."`` with ``--block-size``, ``--model-name``
(default) and ``--routing-group`` (default); also ``--peers``, ``--access-log``.
HTTP API (JSON): ``GET /health`` (200 once serving); ``POST /register``
``{instance_id, endpoint, model_name, block_size, [routing_group, dp_rank,
replay_endpoint]}`` -> 201; ``POST /unregister`` ``{instance_id, model_name, [dp_rank]}``;
``GET /workers`` (each listener's ``status``: "active" once subscribed); ``POST /query``
``{token_ids, model_name, [routing_group, lora_name]}`` -> ``{"instances": {"<worker>":
{"longest_matched", "gpu", "cpu", "disk", "dp": {"<rank>": gpu tokens}}}, "scores": {gpu
tokens per worker and rank}, "frequencies": [...]}``, 404 while no worker of that model
and routing group is registered; ``POST /query_by_hash``; ``GET /dump``; ``GET /metrics``.
All counts are tokens (matched blocks x block size); workers with no match are absent
from ``instances``. One index per (model_name, routing_group), with its own block size.

Wire: multipart ``[topic, seq (8 bytes big-endian), msgpack KVEventBatch]``; any topic (it
subscribes to ""). Events may be msgspec-tagged maps (vLLM's current ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``) or the older ``array_like`` tuples. A batch that
does not decode is dropped whole (e.g. ``bytes`` block hashes: send ints, as vLLM does
with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default; any i64/u64 works).
``data_parallel_rank`` in the batch sets the dp rank.

Sequence numbers (per listener): any first seq is accepted; a seq above last+1 is a gap:
with a ``replay_endpoint`` it asks that ROUTER, DEALER frames ``[b"", start seq]`` (from 0
when the first seq it sees is > 0) and takes replies ``[b"", topic, seq, batch]`` until an
empty batch frame, vLLM's protocol; without one it logs "batches lost" and goes on. A seq
<= the last one applied is stale and DROPPED silently: a restarted publisher must not
start again at 0 against a running indexer. There is no replay at start when the first
seq is 0, and a batch published before the SUB socket has subscribed (ZMQ's slow joiner)
is lost: wait for ``/workers`` status "active" (the helper does) or use an XPUB socket
and wait for its subscription message.

Hashing: the query cuts ``token_ids`` into whole blocks of the indexer's block size (a
tail is ignored) and hashes each block on its own, XXH3-64 (seed 1337, or 1337 + xxh3(lora
name) with a LoRA) of its tokens as u32 little-endian; it matches those along the tree.
A ``BlockStored`` is indexed by the same hash of its own ``token_ids`` (one slice of
``block_size`` tokens per entry of ``block_hashes``). The publisher's ``block_hashes`` are
opaque ids: they only link children to parents (``parent_block_hash``) and name blocks in
``BlockRemoved``. So ``token_ids`` must be the real tokens; the event's ``block_size``
must equal the indexer's (else the whole event is dropped); token_ids shorter than
``len(block_hashes) * block_size`` index only the whole blocks before the shortfall;
``lora_name`` must match the query's (and, per the source, ``extra_keys`` carrying a
cache salt or multimodal hashes change the hash too: send None); a block hash repeated
in one event (or equal to the parent) drops the event. ``parent_block_hash=None`` puts
a block at the start of a sequence (token position 0), so the blocks of one prompt must
be chained through their parents; a second "root" is only found by a query that starts
with its tokens.

Parents: on the GPU tier a block whose parent this worker (and dp rank) does not hold on
the GPU is DROPPED (WARN "Failed to find parent block"), and not retried when the parent
arrives later: publish parents first. On the CPU and disk tiers a block is kept under its
parent HASH, which may live on any tier or arrive later: the walk continues from the block
it matched last (on whatever tier) to a lower-tier block whose ``parent_block_hash`` is
that block's hash. So a block must carry the same hash on every tier (vLLM's does: it is
a content hash), and a disk block whose parent is a GPU block continues the GPU prefix.

Media (case-sensitive): None, "GPU", "DEVICE" -> gpu; "CPU", "CPU_PINNED", "CPU_TIER1" ->
cpu; "STORAGE", "DISK", "NVME", "CPU_TIER2", "EXTERNAL", "NETWORK", "SHARED" -> disk; any
other string ("gpu", "storage", ...) drops the event. Each tier is indexed separately:
``BlockRemoved`` acts only on the tier its ``medium`` names (None = GPU); a block stored
on two tiers stays on the other. Counts are cumulative along one walk: ``gpu`` is the
prefix matched on the GPU, ``cpu`` continues it on the CPU tier, ``disk`` continues that
on disk, and ``longest_matched`` is ``disk``; the walk never returns to a faster tier
(GPU, GPU, CPU, STORAGE blocks: gpu 32, cpu 48, disk 64; a CPU block after a disk one
counts nowhere). Removing a block cuts off everything after it. Re-storing a block is
idempotent, and one ``BlockRemoved`` removes it; ``AllBlocksCleared`` empties the worker.

Timing: events are applied asynchronously after they arrive (poll: :meth:`wait_for`), in
order within a tier but not across tiers: a CPU store was seen before a disk store
published earlier, and a GPU removal before an earlier disk store.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_VENV = ROOT / ".venv-dynamo"
DYNAMO_PYTHON = DYNAMO_VENV / "bin" / "python"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LIVE: set[DynamoIndexer] = set()


def dynamo_marks(timeout_s: int = 60) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark``: skip without the venv, engine, and a whole-module timeout."""
    return [
        pytest.mark.engine,
        pytest.mark.skipif(
            not DYNAMO_PYTHON.exists(),
            reason=(
                ".venv-dynamo is absent: run `bash scripts/setup-dynamo.sh` (scripts/test.sh does)"
            ),
        ),
        pytest.mark.timeout(timeout_s),
    ]


class DynamoIndexerError(RuntimeError):
    """The indexer failed to start, died, or answered an HTTP error."""


@dataclass(frozen=True)
class WorkerMatch:
    """One worker's answer to ``/query``, in tokens (matched blocks x block size).

    ``gpu`` is the prefix matched on the GPU tier; ``cpu`` and ``disk`` continue it on the
    CPU and disk tiers, so ``gpu <= cpu <= disk == longest_matched``. ``dp`` is ``gpu`` per
    data-parallel rank.
    """

    longest_matched: int = 0
    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    dp: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> WorkerMatch:
        return cls(
            longest_matched=int(raw.get("longest_matched", 0)),
            gpu=int(raw.get("gpu", 0)),
            cpu=int(raw.get("cpu", 0)),
            disk=int(raw.get("disk", 0)),
            dp={int(rank): int(n) for rank, n in raw.get("dp", {}).items()},
        )


NO_MATCH = WorkerMatch()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DynamoIndexer:
    """``python -m dynamo.indexer`` from .venv-dynamo, on a free port, for one test scope.

    ``workers`` maps worker ids (``"id"`` or ``"id:dp_rank"`` keys also work) to ZMQ PUB
    endpoints subscribed at start, under ``model_name`` with ``block_size``; more can be
    added with :meth:`register`. Use as a context manager, or :meth:`start` /
    :meth:`stop`; a process still running at interpreter exit is killed.
    """

    def __init__(
        self,
        block_size: int = 16,
        workers: Mapping[int | str, str] | None = None,
        *,
        model_name: str = "default",
        threads: int = 1,
        startup_timeout: float = 30.0,
        python: Path = DYNAMO_PYTHON,
    ) -> None:
        self.block_size = block_size
        self.workers = dict(workers or {})
        self.model_name = model_name
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.python = python
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DynamoIndexer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> DynamoIndexer:
        if not self.python.exists():
            raise DynamoIndexerError(f"{self.python} is absent: run bash scripts/setup-dynamo.sh")
        for attempt in range(3):  # the free port may be taken before the indexer binds it
            self._spawn()
            try:
                self._wait_ready()
                return self
            except DynamoIndexerError as e:
                log = self.log()
                self.stop()
                if "Address already in use" in log and attempt < 2:
                    continue
                raise DynamoIndexerError(f"{e}\n--- indexer output ---\n{log[-4000:]}") from None
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        self.port = _free_port()
        cmd = [
            str(self.python),
            "-m",
            "dynamo.indexer",
            "--port",
            str(self.port),
            "--threads",
            str(self.threads),
            "--model-name",
            self.model_name,
        ]
        if self.workers:
            cmd += ["--block-size", str(self.block_size)]
            cmd += ["--workers", ",".join(f"{w}={ep}" for w, ep in self.workers.items())]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  closed in stop()
        env = {**os.environ, "NO_COLOR": "1"}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() kills all of it
            env=env,
        )
        _LIVE.add(self)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            self._check_alive()
            try:
                self._http("GET", "/health", timeout=1.0)
                break
            except (OSError, DynamoIndexerError):
                if time.monotonic() > deadline:
                    raise DynamoIndexerError(
                        f"dynamo.indexer not ready on port {self.port} "
                        f"after {self.startup_timeout} s"
                    ) from None
                time.sleep(0.05)
        for key in self.workers:
            wid, _, rank = str(key).partition(":")
            self._wait_active(int(wid), int(rank or 0), deadline)

    def _check_alive(self) -> None:
        if self.proc is None:
            raise DynamoIndexerError("dynamo.indexer is not running")
        rc = self.proc.poll()
        if rc is not None:
            raise DynamoIndexerError(f"dynamo.indexer exited with {rc}")

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 5 s; idempotent."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._log is not None:
            self._last_log = self.log()
            self._log.close()
            self._log = None

    def log(self) -> str:
        """What the indexer has written so far (stdout and stderr, colours stripped)."""
        if self._log is None:
            return getattr(self, "_last_log", "")
        self._log.flush()
        self._log.seek(0)
        return _ANSI.sub("", self._log.read().decode(errors="replace"))

    # -- HTTP ------------------------------------------------------------------------

    def _http(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise DynamoIndexerError(
                f"{method} {path} -> {e.code}: {e.read().decode(errors='replace')}"
            ) from None
        return json.loads(raw) if raw.strip() else None

    def register(
        self,
        worker_id: int,
        endpoint: str,
        *,
        model_name: str | None = None,
        block_size: int | None = None,
        dp_rank: int | None = None,
        replay_endpoint: str | None = None,
        routing_group: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        """Subscribe to another publisher; returns once its listener is active."""
        body: dict[str, Any] = {
            "instance_id": worker_id,
            "endpoint": endpoint,
            "model_name": model_name or self.model_name,
            "block_size": block_size or self.block_size,
        }
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        if routing_group is not None:
            body["routing_group"] = routing_group
        self._http("POST", "/register", body)
        self._wait_active(worker_id, dp_rank or 0, time.monotonic() + timeout)

    def unregister(self, worker_id: int, *, model_name: str | None = None) -> None:
        self._http(
            "POST",
            "/unregister",
            {"instance_id": worker_id, "model_name": model_name or self.model_name},
        )

    def _wait_active(self, worker_id: int, dp_rank: int, deadline: float) -> None:
        status = None
        while True:
            self._check_alive()
            for w in self.workers_info():
                if w.get("instance_id") == worker_id:
                    status = w.get("listeners", {}).get(str(dp_rank), {}).get("status")
            if status == "active":
                return
            if time.monotonic() > deadline:
                raise DynamoIndexerError(
                    f"worker {worker_id} dp_rank {dp_rank}: listener {status!r}, not active"
                )
            time.sleep(0.02)

    def workers_info(self) -> list[dict[str, Any]]:
        """``GET /workers``, as is."""
        return list(self._http("GET", "/workers"))

    def dump(self) -> dict[str, Any]:
        """``GET /dump``: every indexer's tree, as store events."""
        return dict(self._http("GET", "/dump"))

    def query_raw(
        self,
        token_ids: list[int],
        model_name: str = "default",
        lora_name: str | None = None,
        routing_group: str | None = None,
    ) -> dict[str, Any]:
        """``POST /query``, as is."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "model_name": model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if routing_group is not None:
            body["routing_group"] = routing_group
        return dict(self._http("POST", "/query", body))

    def query(
        self,
        token_ids: list[int],
        model_name: str = "default",
        lora_name: str | None = None,
        routing_group: str | None = None,
    ) -> dict[int, WorkerMatch]:
        """Each worker holding a prefix of ``token_ids``: worker id -> :class:`WorkerMatch`.
        Workers that match nothing are absent. DynamoIndexerError (404) while no worker of
        ``model_name`` is registered."""
        raw = self.query_raw(token_ids, model_name, lora_name, routing_group)
        return {int(w): WorkerMatch.from_json(m) for w, m in raw.get("instances", {}).items()}

    def wait_for(
        self,
        token_ids: list[int],
        worker_id: int,
        check: Callable[[WorkerMatch], bool],
        *,
        model_name: str = "default",
        timeout: float = 10.0,
    ) -> WorkerMatch:
        """Poll ``query`` until ``check(match of worker_id)`` holds (events are applied
        asynchronously); returns that match, AssertionError with the last one on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.query(token_ids, model_name).get(worker_id, NO_MATCH)
            if check(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {worker_id}: still {got} after {timeout} s")
            self._check_alive()
            time.sleep(0.02)


@atexit.register
def _stop_all() -> None:  # pragma: no cover - only for leaks
    for indexer in list(_LIVE):
        indexer.stop()
