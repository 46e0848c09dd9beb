"""kvstore-server put/get GB/s over TCP, a Unix socket and shared memory vs raw baselines.

One run starts, each in a process of its own:

- a ``kvstore-server`` (:class:`~kvstore.cli.kvserver.KVStoreServerProcess`;
  tiers: ``--host-capacity`` (2 GiB) of host memory per store -- one store per
  block size -- over a disk tier in a temp dir; the working set stays in memory);
- a raw socket peer (plain Python, one thread per connection) that
  ``sendall``-s blocks from a preallocated buffer or ``recv_into``-s them;
- a ``redis-server`` (no persistence; where it is not installed the Redis
  baseline is skipped and the JSON says why: ``scripts/install-servers.sh``);
- ``--clients`` (8) client processes (multiprocessing, spawn: no shared GIL).
  1-client figures come from worker 0 alone; N-client figures from all of
  them at once (released together by a barrier), each moving a 1/N share.
  Alone, a worker uses torch's default threads; N at once use one each (8
  processes x 2 spinning OpenMP threads on 2 cores starve each other).

Per block size -- ``large`` 32 MiB (Llama-3-8B: 32 layers x 256 tokens x 8
KV heads x 128, bf16) and ``small`` 1 MiB (the same model, 8-token chunks) --
every rep moves ``--rep-mib`` (256) MiB in all, with 1 or N clients:

- ``kvstore``: ``Client.put`` of fresh random keys (deleted after the rep,
  untimed: every put stores, and reuses the slots the last one freed) and
  ``Client.get`` into preallocated tensors, over ``tcp`` (loopback,
  ``shared_memory=False``), ``unix`` (``shared_memory=False``) and ``shm``
  (the Unix socket with shared memory; the memfd comes over the socket);
- ``socket``: the raw peer over TCP loopback and a Unix socket, one request
  per rep like a kvstore batch: put = the client ``sendall``-s each block from
  its tensor, the peer acks; get = the peer sends, the client ``recv_into``-s
  each block's tensor;
- ``redis``: redis-py pipelined ``SET`` of each block's bytes / ``GET`` (a
  fresh ``bytes`` per value, not copied into a tensor), with redis-py's
  Python command packer (no copy of the values; hiredis's copies them all)
  and hiredis for replies where it is installed;
- ``memcpy``: torch copy of the same blocks into reused tensors in the client
  process, one ``torch._foreach_copy_`` per rep (the call kvstore's client
  makes for a shared-memory batch): the floor of the shared-memory path.

Headline ratios (32 MiB blocks, 1 client; ``ratios_by_block`` has them for
both sizes; ``definitions`` in the JSON): ``tcp_get_ratio_vs_socket``,
``tcp_ratio_vs_redis`` (geometric mean of the TCP put/SET and get/GET ratios;
``tcp_ratio_vs_redis_min`` the lower one), ``shm_get_ratio_vs_memcpy``, and
``clients8_scaling`` (geometric mean over kvstore's 3 transports x put/get of
N-client aggregate GB/s / 1-client GB/s).

Not in the ratios: ``first_fill_put_gbps``, worker 0's put of the get set
into the fresh server over TCP (one rep: the server's memory is touched for
the first time); ``premap_shm_put_gbps``, each worker's first shared-memory
put of a whole rep, one worker at a time before timing, which maps the slots
every later put reuses into that process (a process's first copy into a slot
takes a page fault per 4 KiB page); ``page_faults_per_rep``, the median
minor faults of the clients (summed) and of the server per rep of each subject.

Timing: interleaved rounds (order reversed on odd rounds), medians; a rep
spans from the first client's start to the last one's end; GB/s is 1e9 bytes
of block data per second. LMCache's server is reported as skipped (not
installed here). Run: ``python benchmarks/bench_server.py [--json] [--quick]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import multiprocessing as mp
import os
import platform
import resource
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds

from kvstore import KVLayout
from kvstore.cli import HOST, KVStoreServerProcess, RedisServer
from kvstore.client import Client, ClientOptions
from kvstore.errors import ConfigError
from kvstore.testing import make_keys
from kvstore.wire import SlotStatus

TARGETS = {
    "tcp_get_ratio_vs_socket": 0.6,
    "tcp_ratio_vs_redis": 4.0,
    "shm_get_ratio_vs_memcpy": 0.7,
    "clients8_scaling": 1.5,
}
MiB = 1024**2
SIZES = ("large", "small")
TRANSPORTS = ("tcp", "unix", "shm")
OPS = ("put", "get")
#: Raw peer request: op (b"P" client sends, b"G" peer sends), block count, block bytes.
HEADER = struct.Struct("!cIQ")
_SALT = {"large": 1, "small": 2}


# -- what one run moves ---------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Geometry and sizes of one run (picklable: the workers get a copy)."""

    layers: int
    tokens: dict[str, int]
    rep_bytes: int
    clients: int
    host_capacity: str

    def layout(self, size: str) -> KVLayout:
        """Llama-like GQA geometry (8 KV heads, head_dim 128), bf16."""
        return KVLayout(
            num_layers=self.layers,
            num_kv_heads=8,
            head_dim=128,
            block_tokens=self.tokens[size],
            dtype=torch.bfloat16,
        )

    def count(self, size: str, clients: int) -> int:
        """Blocks each of ``clients`` clients moves per rep."""
        return int(self.rep_bytes // self.layout(size).block_nbytes // clients)

    def nbytes(self, size: str, clients: int) -> int:
        """Block bytes one rep moves in all."""
        return int(self.count(size, clients) * clients * self.layout(size).block_nbytes)


@dataclass(frozen=True)
class Subject:
    """One timed thing: ``system`` (kvstore, socket, redis, memcpy) doing ``op``."""

    size: str
    system: str
    transport: str
    op: str
    clients: int

    @property
    def name(self) -> str:
        """``size/system/transport/op/cN``."""
        return f"{self.size}/{self.system}/{self.transport}/{self.op}/c{self.clients}"


@dataclass(frozen=True)
class Endpoints:
    """Where the workers connect."""

    tcp: str
    unix: str
    socket_port: int
    socket_path: str
    redis_url: str | None


def get_keys(size: str, n: int) -> list[bytes]:
    """The keys of the blocks every get reads (worker 0 stores them first)."""
    return [bytes(k) for k in make_keys(n, salt=_SALT[size])]


def redis_keys(size: str, n: int) -> list[str]:
    """The Redis names of the values every redis GET reads."""
    return [f"get:{size}:{i}" for i in range(n)]


# -- the raw socket peer (its own process) ---------------------------------------
def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed first."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def serve_raw(sock: socket.socket) -> None:
    """One connection of the raw peer: G sends blocks, P receives them then acks."""
    buf = bytearray(0)
    head = bytearray(HEADER.size)
    with sock:
        while recv_exact(sock, memoryview(head)):
            op, count, size = HEADER.unpack(head)
            if len(buf) < count * size:
                buf = bytearray(count * size)  # zero-filled: every page touched once
            view = memoryview(buf)
            for i in range(count):
                part = view[i * size : (i + 1) * size]
                if op == b"G":
                    sock.sendall(part)
                elif not recv_exact(sock, part):
                    return
            if op == b"P":
                sock.sendall(b"k")


def accept_loop(listener: socket.socket) -> None:
    """Serve each connection on a thread of its own."""
    while True:
        sock, _ = listener.accept()
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve_raw, args=(sock,), daemon=True).start()


def socket_peer_main(unix_path: str, conn: Connection) -> None:
    """The raw peer's process: listen on TCP and ``unix_path``; report the port; serve."""
    tcp = socket.create_server((HOST, 0), backlog=64)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(unix_path)
    unix.listen(64)
    for listener in (tcp, unix):
        threading.Thread(target=accept_loop, args=(listener,), daemon=True).start()
    conn.send(tcp.getsockname()[1])
    with contextlib.suppress(EOFError):
        conn.recv()  # until told to stop (or the parent dies)


class SocketPeer:
    """The raw peer process, as a context manager."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, "raw.sock")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=socket_peer_main, args=(self.path, child), daemon=True)
        self.port = 0

    def __enter__(self) -> SocketPeer:
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the raw socket peer did not start")
        self.port = int(self._conn.recv())
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


# -- client worker processes ----------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` (no copy)."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]


@dataclass
class SizeState:
    """A worker's blocks, output tensors and clients for one block size."""

    layout: KVLayout
    blocks: list[torch.Tensor]
    outs: list[torch.Tensor]
    clients: dict[str, Client] = field(default_factory=dict)

    def views(self, n: int) -> list[memoryview]:
        """The bytes of the first ``n`` blocks."""
        return [tensor_bytes(b) for b in self.blocks[:n]]

    def out_views(self, n: int) -> list[memoryview]:
        """The bytes of the first ``n`` output tensors."""
        return [tensor_bytes(o) for o in self.outs[:n]]


Op = tuple[Callable[[], object], Callable[[], object]]


def _nothing() -> None:
    return None


def put_stored(client: Client, keys: list[bytes], blocks: list[torch.Tensor]) -> float:
    """``client.put`` of new keys; its seconds. Raises unless every block was stored."""
    start = time.perf_counter()
    statuses = client.put_statuses(keys, blocks)
    elapsed = time.perf_counter() - start
    if any(s & 0x7F != SlotStatus.STORED for s in statuses):
        raise RuntimeError(f"not every block was stored: {statuses}")
    return elapsed


class Worker:
    """One client process: its data, kvstore clients, raw sockets and redis client."""

    def __init__(self, index: int, plan: Plan, ends: Endpoints, barrier: Barrier) -> None:
        self.index, self.plan, self.ends, self.barrier = index, plan, ends, barrier
        self.sizes: dict[str, SizeState] = {}
        self.socks: dict[str, socket.socket] = {}
        self.redis: Any = None
        self.threads = torch.get_num_threads()

    def torch_threads(self, clients: int) -> int:
        """Torch threads for a rep of ``clients`` clients: torch's default alone; else the
        cores shared out (8 processes x 2 spinning OpenMP threads on 2 cores make each
        per-block ``copy_`` wait for a time slice: memcpy of 128 KiB blocks ran at
        0.05 GB/s instead of 13)."""
        return self.threads if clients == 1 else max(1, (os.cpu_count() or 1) // clients)

    def setup(self) -> dict[str, Any]:
        """Make the blocks, connect everything; whether shared memory was attached."""
        for size in SIZES:
            layout = self.plan.layout(size)
            n = self.plan.count(size, 1 if self.index == 0 else self.plan.clients)
            blocks = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in range(n)]
            for block in blocks:
                block.view(torch.uint8).random_(0, 256)  # incompressible bytes
            outs = [torch.ones(layout.block_shape, dtype=layout.dtype) for _ in range(n)]
            state = self.sizes[size] = SizeState(layout, blocks, outs)
            for transport in TRANSPORTS:
                address = self.ends.tcp if transport == "tcp" else self.ends.unix
                options = ClientOptions(address=address, shared_memory=transport == "shm")
                state.clients[transport] = client = Client(layout, options)
                client.ping()  # connect now (and map the shared memory), not in a timed rep
        tcp = socket.create_connection((HOST, self.ends.socket_port))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.connect(self.ends.socket_path)
        self.socks = {"tcp": tcp, "unix": unix}
        if self.ends.redis_url is not None:
            self.redis = redis_client(self.ends.redis_url)
        shm = all(s.clients["shm"].shared_memory for s in self.sizes.values())
        threads = {f"c{k}": self.torch_threads(k) for k in (1, self.plan.clients)}
        return {"shared_memory": shm, "torch_threads": threads}

    def fill(self) -> dict[str, float]:
        """(Worker 0) store the get sets in the fresh server and Redis; first-fill GB/s."""
        gbps: dict[str, float] = {}
        for size, state in self.sizes.items():
            keys = get_keys(size, len(state.blocks))
            elapsed = put_stored(state.clients["tcp"], keys, state.blocks)
            gbps[size] = len(keys) * state.layout.block_nbytes / elapsed / 1e9
            if self.redis is not None:
                pipe = self.redis.pipeline(transaction=False)
                for name, view in zip(
                    redis_keys(size, len(keys)), state.views(len(keys)), strict=True
                ):
                    pipe.set(name, view)
                pipe.execute()
        return gbps

    def premap(self) -> dict[str, float]:
        """Map the slots puts use into this process: a shared-memory put of a whole rep
        (deleted again). Puts reuse the slots freed last (a stack), so these are the
        slots every later put gets. Returns its GB/s: a process's first copy into a
        slot pays a page fault per 4 KiB page (worker 0's also allocates the pages)."""
        gbps: dict[str, float] = {}
        for size, state in self.sizes.items():
            n = self.plan.count(size, 1)
            blocks = [state.blocks[i % len(state.blocks)] for i in range(n)]
            keys = [os.urandom(16) for _ in range(n)]
            elapsed = put_stored(state.clients["shm"], keys, blocks)
            state.clients["shm"].delete(keys)
            gbps[size] = n * state.layout.block_nbytes / elapsed / 1e9
        return gbps

    def check(self) -> None:
        """(Worker 0) every transport's get returns the bytes that were put."""
        for size, state in self.sizes.items():
            keys = get_keys(size, len(state.blocks))
            for transport, client in state.clients.items():
                for out in state.outs:
                    out.fill_(0)
                if not all(client.get(keys, state.outs)):
                    raise RuntimeError(f"{size} {transport} get missed after the run")
                for out, block in zip(state.outs, state.blocks, strict=True):
                    if not torch.equal(out.view(torch.uint8), block.view(torch.uint8)):
                        raise RuntimeError(f"{size} {transport} get returned other bytes")
            if self.redis is not None:
                name, view = redis_keys(size, 1)[0], state.views(1)[0]
                if self.redis.get(name) != bytes(view):
                    raise RuntimeError(f"{size}: redis returned other bytes")

    def run(self, subj: Subject) -> tuple[float, float, int]:
        """One rep of ``subj``: untimed prep, the barrier, the timed op, untimed cleanup.

        Returns its start and end (``perf_counter``: the same clock in every process)
        and the minor page faults this process took during the op.
        """
        count = self.plan.count(subj.size, subj.clients)
        build = {
            "kvstore": self._kvstore_op,
            "socket": self._socket_op,
            "redis": self._redis_op,
            "memcpy": self._memcpy_op,
        }[subj.system]
        threads = self.torch_threads(subj.clients)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        op, cleanup = build(self.sizes[subj.size], subj, count)
        if subj.clients > 1:
            self.barrier.wait(timeout=120)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        op()
        end = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        cleanup()
        return start, end, faults

    def _share(self, keys: list[Any], count: int) -> list[Any]:
        return keys[self.index * count : (self.index + 1) * count]

    def _kvstore_op(self, state: SizeState, subj: Subject, count: int) -> Op:
        client = state.clients[subj.transport]
        if subj.op == "get":
            keys = self._share(get_keys(subj.size, count * subj.clients), count)
            outs = state.outs[:count]

            def get() -> None:
                if not all(client.get(keys, outs)):
                    raise RuntimeError(f"{subj.name}: a get missed")

            return get, _nothing
        fresh = [os.urandom(16) for _ in range(count)]  # a stored key would not be put again
        blocks = state.blocks[:count]

        return lambda: put_stored(client, fresh, blocks), lambda: client.delete(fresh)

    def _socket_op(self, state: SizeState, subj: Subject, count: int) -> Op:
        sock = self.socks[subj.transport]
        nbytes = state.layout.block_nbytes
        if subj.op == "get":
            head = HEADER.pack(b"G", count, nbytes)
            outs = state.out_views(count)

            def get() -> None:
                sock.sendall(head)
                for view in outs:
                    if not recv_exact(sock, view):
                        raise RuntimeError("the raw peer closed the connection")

            return get, _nothing
        head, ack = HEADER.pack(b"P", count, nbytes), memoryview(bytearray(1))
        views = state.views(count)

        def put() -> None:
            sock.sendall(head)
            for view in views:
                sock.sendall(view)
            if not recv_exact(sock, ack):
                raise RuntimeError("the raw peer closed the connection")

        return put, _nothing

    def _redis_op(self, state: SizeState, subj: Subject, count: int) -> Op:
        pipe = self.redis.pipeline(transaction=False)
        nbytes = state.layout.block_nbytes
        if subj.op == "get":
            for name in self._share(redis_keys(subj.size, count * subj.clients), count):
                pipe.get(name)

            def get() -> None:
                if any(v is None or len(v) != nbytes for v in pipe.execute()):
                    raise RuntimeError(f"{subj.name}: a value is missing")

            return get, _nothing
        for i, view in enumerate(state.views(count)):
            pipe.set(f"put:{subj.size}:{self.index}:{i}", view)
        return pipe.execute, _nothing

    def _memcpy_op(self, state: SizeState, subj: Subject, count: int) -> Op:
        dsts, srcs = state.outs[:count], state.blocks[:count]
        # The call kvstore's client makes for a batch through shared memory (copy_all): a
        # per-block copy_ loop would stall alone on the libgomp effect benchmarks/README.md
        # describes (1 MiB blocks: 0.8-1.2 GB/s in some processes), skewing the ratio.
        return lambda: torch._foreach_copy_(dsts, srcs), _nothing

    def close(self) -> None:
        """Close every client and socket."""
        for state in self.sizes.values():
            for client in state.clients.values():
                client.close()
        for sock in self.socks.values():
            sock.close()
        if self.redis is not None:
            self.redis.close()


def worker_main(
    index: int, conn: Connection, plan: Plan, ends: Endpoints, barrier: Barrier
) -> None:
    """A worker process: run the commands the parent sends until ``stop``."""
    worker = Worker(index, plan, ends, barrier)
    try:
        while True:
            try:
                command, *args = conn.recv()
            except EOFError:
                return
            if command == "stop":
                return
            try:
                conn.send(("ok", getattr(worker, command)(*args)))
            except BaseException:
                barrier.abort()  # the others waiting for this one fail now, not at the timeout
                conn.send(("error", traceback.format_exc()))
    finally:
        worker.close()


def server_faults(pid: int | None) -> int:
    """Minor page faults the server process has taken so far (0 where unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


class WorkerPool:
    """The client processes (spawned), driven through pipes."""

    def __init__(self, plan: Plan, ends: Endpoints, server_pid: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.server_pid = server_pid
        #: Per subject and rep: minor page faults of the clients (summed) and the server.
        self.faults: dict[str, list[tuple[int, int]]] = {}
        # Kept referenced: the children open its semaphores by name while they start.
        self.barrier = barrier = ctx.Barrier(plan.clients)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(plan.clients):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(i, child, plan, ends, barrier), daemon=True
            )
            self.conns.append(parent)
            self.procs.append(proc)

    def __enter__(self) -> WorkerPool:
        for proc in self.procs:
            proc.start()
        return self

    def call(self, indices: range, command: str, *args: Any) -> list[Any]:
        """Run ``command`` on each worker of ``indices`` at once; their results."""
        for i in indices:
            self.conns[i].send((command, *args))
        results = []
        for i in indices:
            status, value = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"worker {i} failed in {command}:\n{value}")
            results.append(value)
        return results

    def rep(self, subj: Subject) -> Rep:
        """A rep of ``subj``: from the first client's start to the last one's end."""

        def rep() -> float:
            before = server_faults(self.server_pid)
            spans = self.call(range(subj.clients), "run", subj)
            server = server_faults(self.server_pid) - before
            self.faults.setdefault(subj.name, []).append((sum(s[2] for s in spans), server))
            return float(max(s[1] for s in spans) - min(s[0] for s in spans))

        return rep

    def __exit__(self, *exc: object) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# -- the run --------------------------------------------------------------------------
def server_config(plan: Plan, workdir: str) -> dict[str, Any]:
    """Host memory for the working set (per store: one per block size) over a disk tier."""
    return {
        "tiers": [
            {"kind": "host", "capacity": plan.host_capacity},
            {"kind": "disk", "capacity": "8GiB", "path": os.path.join(workdir, "disk")},
        ],
        "server": {},
    }


def subjects(plan: Plan, redis: bool) -> list[Subject]:
    """Every subject, each next to its baselines (so they share the same moments)."""
    out: list[Subject] = []
    for size in SIZES:
        for k in sorted({1, plan.clients}):
            for op in OPS:
                out += [
                    Subject(size, "kvstore", "tcp", op, k),
                    Subject(size, "socket", "tcp", op, k),
                ]
                if redis:
                    out.append(Subject(size, "redis", "tcp", op, k))
                out += [
                    Subject(size, "kvstore", "unix", op, k),
                    Subject(size, "socket", "unix", op, k),
                    Subject(size, "kvstore", "shm", op, k),
                ]
                if op == "get":
                    out.append(Subject(size, "memcpy", "local", "copy", k))
    return out


def redis_packer() -> tuple[Any, str]:
    """redis-py's pure-Python command packer, and what it is.

    It sends a large value as its own buffer, from the caller's memory. The
    hiredis packer (redis-py's default where hiredis is installed) copies every
    value into one new request first: SET of 32 MiB values ran at 0.30 GB/s with
    it, 1.2 GB/s with this one (replies are parsed by hiredis either way).
    """
    try:
        from redis.connection import PythonRespSerializer
    except ImportError:  # an older redis-py: its default
        return None, "redis-py default"
    return PythonRespSerializer(6000, _encode), "python (values sent from memory, not copied)"


def _encode(value: Any) -> bytes | memoryview:
    """A command's argument as bytes (values are bytes or memoryviews already)."""
    return value if isinstance(value, (bytes, memoryview)) else str(value).encode()


def redis_client(url: str) -> Any:
    """A redis-py client for the baseline: the Python packer, the installed parser."""
    import redis

    packer, _ = redis_packer()
    extra = {"command_packer": packer} if packer is not None else {}
    return redis.Redis.from_url(url, socket_timeout=120, **extra)


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str | None, dict[str, Any]]]:
    """A redis-server's URL and version, or None and why it is skipped."""
    try:
        server = RedisServer()
    except ConfigError as exc:
        log(f"redis baseline skipped: {exc}")
        yield None, {"skipped": f"redis baseline skipped: {exc}"}
        return
    with server:
        import redis

        with redis.Redis.from_url(server.url) as client:
            version = client.info("server").get("redis_version")
        info = {
            "redis_version": version,
            "redis_py": redis.__version__,
            "parser": "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure Python (no hiredis)",
            "command_packer": redis_packer()[1],
        }
        yield server.url, info


def lmcache_status() -> dict[str, Any]:
    """LMCache's server is not benchmarked here; say why."""
    if importlib.util.find_spec("lmcache") is None:
        return {"skipped": "lmcache is not installed in this environment (not attempted)"}
    return {"skipped": "lmcache is importable, but starting its server is not implemented here"}


def measure(args: Any, plan: Plan, rounds: int) -> dict[str, Any]:
    """Start the servers and the workers, fill, time every subject, check."""
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-bench-server-"))
        server = stack.enter_context(KVStoreServerProcess(server_config(plan, tmp), tmp))
        peer = stack.enter_context(SocketPeer(tmp))
        redis_url, redis_info = stack.enter_context(redis_server())
        ends = Endpoints(server.address, server.unix_address, peer.port, peer.path, redis_url)
        log(f"starting {plan.clients} client processes (spawn)")
        pool = stack.enter_context(WorkerPool(plan, ends, server.pid))
        setup = pool.call(range(plan.clients), "setup")
        fill = pool.call(range(1), "fill")[0]
        premap = [pool.call(range(i, i + 1), "premap")[0] for i in range(plan.clients)]
        subs = subjects(plan, redis_url is not None)
        log(f"{len(subs)} subjects, {rounds} rounds x {args.reps} reps")
        times = run_rounds({s.name: (pool.rep(s), args.reps) for s in subs}, rounds)
        pool.call(range(1), "check")
    return {
        "subjects": subs,
        "times": times,
        "first_fill": fill,
        "premap": {size: [p[size] for p in premap] for size in SIZES},
        "shared_memory": all(s["shared_memory"] for s in setup),
        "worker_torch_threads": setup[0]["torch_threads"],
        "redis": redis_info,
        "faults": pool.faults,
    }


def figures(plan: Plan, subs: list[Subject], times: dict[str, list[float]]) -> dict[str, Any]:
    """GB/s as ``[size][system][transport][op]["cN"]``."""
    out: dict[str, Any] = {}
    for s in subs:
        gbps = plan.nbytes(s.size, s.clients) / median(times[s.name]) / 1e9
        by_op = out.setdefault(s.size, {}).setdefault(s.system, {}).setdefault(s.transport, {})
        by_op.setdefault(s.op, {})[f"c{s.clients}"] = gbps
    return out


def geomean(values: list[float]) -> float:
    """The geometric mean."""
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ratios(g: dict[str, Any], clients: int) -> dict[str, Any]:
    """Every ratio for one block size's figures ``g``."""
    kv, raw = g["kvstore"], g["socket"]
    out: dict[str, Any] = {}
    for t in ("tcp", "unix"):
        for op in OPS:
            out[f"{t}_{op}_ratio_vs_socket"] = kv[t][op]["c1"] / raw[t][op]["c1"]
    if "redis" in g:
        for op in OPS:
            out[f"tcp_{op}_ratio_vs_redis"] = kv["tcp"][op]["c1"] / g["redis"]["tcp"][op]["c1"]
        pair = [out["tcp_put_ratio_vs_redis"], out["tcp_get_ratio_vs_redis"]]
        out["tcp_ratio_vs_redis"], out["tcp_ratio_vs_redis_min"] = geomean(pair), min(pair)
    memcpy = g["memcpy"]["local"]["copy"]["c1"]
    for op in OPS:
        out[f"shm_{op}_ratio_vs_memcpy"] = kv["shm"][op]["c1"] / memcpy
    if clients > 1:
        c = f"c{clients}"
        each = {f"{t}_{op}": kv[t][op][c] / kv[t][op]["c1"] for t in TRANSPORTS for op in OPS}
        out["clients8_scaling"] = geomean(list(each.values()))
        out["clients8_scaling_by_subject"] = each
        raw_each = [raw[t][op][c] / raw[t][op]["c1"] for t in ("tcp", "unix") for op in OPS]
        out["socket_clients8_scaling"] = geomean(raw_each)
        out["memcpy_clients8_scaling"] = g["memcpy"]["local"]["copy"][c] / memcpy
    return out


DEFINITIONS = {
    "tcp_get_ratio_vs_socket": "kvstore TCP get GB/s / raw TCP socket recv_into GB/s",
    "tcp_ratio_vs_redis": "geometric mean of kvstore TCP put / redis-py SET and get / GET",
    "tcp_ratio_vs_redis_min": "the lower of those two ratios",
    "shm_get_ratio_vs_memcpy": "kvstore shared-memory get GB/s / torch _foreach_copy_ GB/s",
    "clients8_scaling": (
        "geometric mean over kvstore tcp/unix/shm x put/get of N-client aggregate GB/s "
        "/ 1-client GB/s"
    ),
    "headline": "32 MiB blocks ('large'), 1 client unless stated; medians over reps",
}


def machine() -> dict[str, Any]:
    """The host, beyond :func:`_common.environment`: CPU, memory, kernel, shmem huge pages."""

    def first(path: str, prefix: str = "") -> str | None:
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[-1].strip() if prefix else line.strip()
        return None

    mem = first("/proc/meminfo", "MemTotal")
    return {
        "cpu_model": first("/proc/cpuinfo", "model name"),
        "mem_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "kernel": platform.release(),
        "shmem_thp": first("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    }


def summarize(args: Any, plan: Plan, run: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The JSON result."""
    g = figures(plan, run["subjects"], run["times"])
    by_block = {size: ratios(g[size], plan.clients) for size in SIZES}
    head = by_block["large"]
    large = g["large"]["kvstore"]
    flat = {f"{t}_{op}_gbps": large[t][op]["c1"] for t in TRANSPORTS for op in OPS}
    headline = {name: head.get(name) for name in TARGETS}
    return {
        "benchmark": "server",
        "quick": bool(args.quick),
        **headline,
        "tcp_ratio_vs_redis_min": head.get("tcp_ratio_vs_redis_min"),
        **flat,
        "socket_tcp_get_gbps": g["large"]["socket"]["tcp"]["get"]["c1"],
        "memcpy_gbps": g["large"]["memcpy"]["local"]["copy"]["c1"],
        "targets": TARGETS,
        "definitions": DEFINITIONS,
        "meets_target": {k: v is not None and v >= TARGETS[k] for k, v in headline.items()},
        "ratios_by_block": by_block,
        "gbps": g,
        "first_fill_put_gbps": run["first_fill"],
        "premap_shm_put_gbps": run["premap"],
        "block_mib": {size: plan.layout(size).block_nbytes / MiB for size in SIZES},
        "blocks_per_rep": {size: plan.count(size, 1) for size in SIZES},
        "bytes_per_rep": {size: plan.nbytes(size, 1) for size in SIZES},
        "clients": plan.clients,
        "client_mode": "processes (multiprocessing spawn), one kvstore Client each",
        "worker_torch_threads": run["worker_torch_threads"],
        "shared_memory_attached": run["shared_memory"],
        "server": {"process": "KVStoreServerProcess", "config": server_config(plan, "<tmp>")},
        "redis": run["redis"],
        "lmcache": lmcache_status(),
        "page_faults_per_rep": {
            name: {"clients": median([c for c, _ in f]), "server": median([s for _, s in f])}
            for name, f in run["faults"].items()
        },
        "rounds": rounds,
        "reps": {name: len(t) for name, t in run["times"].items()},
        "machine": machine(),
        "environment": environment(),
    }


def table(result: dict[str, Any]) -> list[list[object]]:
    """Rows: GB/s per subject (1 and N clients), then the headline ratios."""
    n = f"c{result['clients']}"
    rows: list[list[object]] = [["what", "GB/s 1 client", f"GB/s {n}", "target", "meets"]]
    for size, by_system in result["gbps"].items():
        mib = result["block_mib"][size]
        for system, by_transport in by_system.items():
            for transport, by_op in by_transport.items():
                for op, by_k in by_op.items():
                    rows.append(
                        [f"{mib:g} MiB {system} {transport} {op}", by_k["c1"], by_k[n], "", ""]
                    )
    for name, target in result["targets"].items():
        value = result[name] if result[name] is not None else "skipped"
        rows.append([name, value, "", f">= {target:g}", result["meets_target"][name]])
    return rows


def parse_args(argv: list[str] | None) -> Any:
    """The command line."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="layers per block (32; quick 4)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per large block (256)")
    parser.add_argument("--small-tokens", type=int, default=8, help="tokens per small block (8)")
    parser.add_argument("--rep-mib", type=int, default=None, help="MiB moved per rep (256)")
    parser.add_argument("--clients", type=int, default=8, help="client processes (8)")
    parser.add_argument("--reps", type=int, default=1, help="reps per subject per round")
    parser.add_argument("--host-capacity", default=None, help="server host tier per store")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    args = parse_args(argv)
    # SIGTERM unwinds like an exception, so the servers and workers started get stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = Plan(
        layers=args.layers or (4 if args.quick else 32),
        tokens={"large": args.tokens, "small": args.small_tokens},
        rep_bytes=(args.rep_mib or (32 if args.quick else 256)) * MiB,
        clients=args.clients,
        host_capacity=args.host_capacity or ("512MiB" if args.quick else "2GiB"),
    )
    for size in SIZES:
        if plan.count(size, plan.clients) < 1:
            raise SystemExit(f"--rep-mib is too small for {plan.clients} clients of {size} blocks")
    rounds = args.rounds or (1 if args.quick else 5)
    log(
        f"blocks of {plan.layout('large').block_nbytes / MiB:g} and "
        f"{plan.layout('small').block_nbytes / MiB:g} MiB, {plan.rep_bytes / MiB:g} MiB per rep"
    )
    run = measure(args, plan, rounds)
    result = summarize(args, plan, run, rounds)
    emit(result, args.json, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
