"""The kvstore-server process: listeners, connections, metrics, and an orderly end.

:class:`Server` runs on one asyncio loop (uvloop where installed). It listens
on TCP (plain, or TLS with a certificate), on a Unix socket, and optionally
serves Prometheus metrics over HTTP. Store operations run on ``server.threads``
worker threads, never on the loop.

Tenants and tokens change at run time: an ADMIN request (admin scope), or
SIGHUP, which reads the config file again (:meth:`Server.reload`); only the
``server`` section's tokens and tenants are taken, and stores are untouched.

Stopping (SIGTERM, SIGINT, or :meth:`Server.stop`) drains: listeners close at
once, requests in flight get up to ``drain_timeout_s`` to finish, then the
connections close and every store flushes its memory tiers to disk, so the
disk tier is consistent and a restart finds the blocks. A kill -9 loses only
blocks that were not yet on disk -- never one acknowledged as durable.

:class:`ServerThread` runs a server on a background thread of the calling
process (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvstore.config import DaemonConfig, DiskTierConfig, StoreConfig
from kvstore.errors import ConfigError, KVStoreError
from kvstore.runtime import trim_heap
from kvstore.server import handlers
from kvstore.server.channel import Channel, RawChannel, StreamChannel
from kvstore.server.connection import Connection
from kvstore.server.metrics import MetricsEndpoint, ServerMetrics
from kvstore.server.orphans import HeldPuts
from kvstore.server.quotas import TenantQuotas
from kvstore.server.session import ByteBudget, ServerContext
from kvstore.server.staging import StagingPool
from kvstore.server.stores import HostedStore, StoreRegistry
from kvstore.server.tenants import AdminDesk
from kvstore.tiers import DirectoryLock
from kvstore.wire import Authenticator

if TYPE_CHECKING:
    from kvstore.events import EventPublisher

__all__ = ["Server", "ServerThread"]

log = logging.getLogger(__name__)

_BACKLOG = 512
_STAGING_IDLE = 512 * 1024**2
_SWEEP_S = 1.0  # how often held reservations are checked for writers that are done
_TRIM_S = 60.0  # how often the C heap's free memory goes back to the OS


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _cannot_listen(binding: str, exc: OSError) -> str:
    """One line for a listener that cannot be bound: which setting, why, what to do."""
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno == errno.EADDRINUSE:
        why += "; stop what listens there or choose another address"
    return f"{binding}: cannot listen: {why}"


def _publisher(config: StoreConfig) -> EventPublisher | None:
    """The server's KV-event publisher, when ``events.enabled`` (needs kvstore-tiers[events])."""
    if not config.events.enabled:
        return None
    from kvstore.events import EventPublisher

    return EventPublisher(config.events)


def _check_tiers(config: StoreConfig) -> None:
    """Refuse to start on a tier mistake a store would only find when the first client
    opens one: a disk path that cannot be a directory (:class:`ConfigError`), an S3
    bucket that does not exist or credentials S3 or Redis refuse (:class:`TierError`).
    Each S3 and Redis tier is opened once for a one-chunk layout and closed (a listing,
    a PING); an endpoint that does not answer is an outage, logged, not a mistake."""
    from kvstore.config import DiskTierConfig, RedisTierConfig, S3TierConfig

    checked = (DiskTierConfig, RedisTierConfig, S3TierConfig)
    tiers = [t for t in config.tiers if isinstance(t, checked)]
    if not tiers:
        return
    from kvstore.layout import KVLayout  # torch and the tiers: only when used
    from kvstore.tiers import check_path, create_tier

    probe = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=1)
    for tier in tiers:
        if isinstance(tier, DiskTierConfig):
            check_path(tier)  # without making a layout directory
        else:
            create_tier(tier, probe).close()


def _disk_locks(config: StoreConfig) -> list[DirectoryLock]:
    """The lock of each disk tier's directory (:mod:`kvstore.tiers.disk_lock`), not yet
    taken: a server owns its directories, and a second one on them refuses to start."""
    return [DirectoryLock(t.path) for t in config.tiers if isinstance(t, DiskTierConfig)]


def _check_keys(settings: DaemonConfig, auth: Authenticator) -> None:
    """With encryption on, each store seals with its tenant's keys: install the
    namespace-to-tenant mapping and check the keyring now (a missing tenant's keys
    are said at start, not per client)."""
    config = settings.store
    if not config.encryption.enabled:
        return
    from kvstore.format import use_tenant_resolver
    from kvstore.tiers import store_keys

    if settings.server.tenants:
        use_tenant_resolver(auth.tenant_of)
    store_keys(config.encryption, config.cluster.namespace)
    for tenant in settings.server.tenants:
        for namespace in tenant.namespaces[:1]:
            store_keys(config.encryption, namespace)


class Server:
    """One kvstore-server (see the module docstring). Start it with :meth:`start`.

    ``config``: a :class:`DaemonConfig`, or a whole-file :class:`StoreConfig` (split by
    role with :meth:`DaemonConfig.of`).

    ``reloader``: reads the config again, for SIGHUP and the ADMIN ``reload``
    (None: this server has no file to reload).
    """

    def __init__(
        self,
        config: DaemonConfig | StoreConfig,
        reloader: Callable[[], DaemonConfig | StoreConfig] | None = None,
    ) -> None:
        settings = DaemonConfig.of(config)
        cfg = settings.server
        cfg.check_startable()
        _check_tiers(settings.store)
        self._authenticator = Authenticator(cfg.credentials(), cfg.owners())
        _check_keys(settings, self._authenticator)
        #: Tenants' shares and limits in the tiers, and their figures.
        self.quotas = TenantQuotas(settings, self._authenticator.tenant_of)
        self.admin = AdminDesk(settings, self._authenticator, reloader)
        self.admin.on_change = self._tenants_changed
        self.admin.check = self.quotas.check
        #: The config by role; ``settings.server`` follows reloads of tenants and tokens.
        self.settings = settings
        #: What every hosted store opens with (before its namespace is applied).
        self.config = settings.store
        self.metrics = ServerMetrics()
        self._executor = ThreadPoolExecutor(cfg.threads, thread_name_prefix="kvstore-server")
        self._copier = ThreadPoolExecutor(cfg.threads, thread_name_prefix="kvstore-copy")
        #: KV events of every hosted store, through one socket (None: ``events`` is off).
        self.events = _publisher(self.config)
        self.registry = StoreRegistry(settings, on_open=self._on_open, events=self.events)
        #: Tenants' own KV-event publishers (``events_endpoint``), by tenant.
        self.tenant_events: dict[str, EventPublisher] = {}
        self.registry.events_for = self._events_for
        #: This server's membership in a cluster (None: standalone), from ``start()``.
        self.cluster: Any = None
        self._load = _RequestRate(self.metrics)
        self._ctx: ServerContext | None = None
        self._listeners: list[socket.socket] = []
        self._tls_servers: list[asyncio.AbstractServer] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._serving: set[asyncio.Task[None]] = set()
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._stopped: asyncio.Event | None = None
        # Signals that came while start() ran, taken once it is done (loop-only).
        self._stop_asked = False
        self._reload_asked = False
        #: One exclusive lock per disk tier directory, held from start() to close().
        self._disk_locks = _disk_locks(self.config)
        #: Where the server listens: ``tcp`` (HOST:PORT), ``unix`` (a path), ``metrics``,
        #: ``events`` / ``events_replay`` (ZMQ endpoints of its KV events).
        self.addresses: dict[str, str] = {}

    @property
    def ctx(self) -> ServerContext:
        """The state its connections share (after :meth:`start`)."""
        assert self._ctx is not None, "start() the server first"
        return self._ctx

    # -- start ----------------------------------------------------------------
    async def start(self) -> None:
        """Take the disk directories (another server using one is a :class:`ConfigError`),
        bind every listener and begin accepting."""
        try:
            for lock in self._disk_locks:
                lock.acquire()
            await self._start()
        except BaseException:
            self._release_disks()
            raise

    def _release_disks(self) -> None:
        for lock in self._disk_locks:
            lock.release()

    async def _start(self) -> None:
        cfg = self.settings.server
        self._stopped = asyncio.Event()
        self._ctx = ServerContext(
            settings=self.settings,
            registry=self.registry,
            authenticator=self._authenticator,
            metrics=self.metrics,
            budget=ByteBudget(cfg.max_inflight_bytes),
            executor=self._executor,
            staging=StagingPool(_STAGING_IDLE),
            admin=self.admin,
            quotas=self.quotas,
            held=HeldPuts(cfg.reservation_hold_s, asyncio.get_running_loop().time),
        )
        binding = "events.endpoint"  # which setting the listener being bound comes from
        try:
            if self.events is not None:  # bound before any store opens: subscribers connect
                self.events.start()
                self.addresses["events"] = self.events.bound_endpoint or ""
                if self.events.bound_replay_endpoint:
                    self.addresses["events_replay"] = self.events.bound_replay_endpoint
                binding = "server.tenants.<tenant>.events_endpoint"
                self._start_tenant_events()
            if cfg.listen:
                binding = f"server.listen (--listen) {cfg.listen}"
                await self._listen_tcp(cfg.listen)
            if cfg.unix_socket:
                binding = f"server.unix_socket (--unix-socket) {cfg.unix_socket}"
                self._listen_unix(cfg.unix_socket)
            if cfg.metrics_listen:
                binding = f"server.metrics_listen (--metrics-listen) {cfg.metrics_listen}"
                await self._listen_metrics(cfg.metrics_listen)
        except OSError as exc:
            await self._close_listeners()
            raise ConfigError(_cannot_listen(binding, exc)) from None
        self._sweeper = asyncio.create_task(self._sweep_held(self._ctx))
        if self.config.cluster.enabled:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._join_cluster)
        if self._stop_asked:
            self._stopped.set()
        if self._reload_asked:
            self.reload()

    def _join_cluster(self) -> None:
        """Publish this server's blocks in the cluster (if peers can reach it)."""
        from kvstore.cluster import ClusterNode  # redis is imported only for clusters

        cluster = self.config.cluster
        advertise = cluster.advertise or self._default_advertise()
        if advertise is None:
            log.warning(
                "cluster: no cluster.advertise and listening on %s: this node fetches from "
                "its peers but serves nothing to them",
                self.settings.server.listen,
            )
            return
        node = ClusterNode(dataclasses.replace(cluster, advertise=advertise), self._load)
        for hosted in self.registry.hosted():
            node.track(hosted.namespace, hosted.store)
        self.cluster = node
        node.start()

    def _default_advertise(self) -> str | None:
        """The TCP address, when it is one peers can dial (not a wildcard)."""
        tcp = self.addresses.get("tcp")
        if tcp is None or tcp.startswith(("0.0.0.0:", "[::]:", ":::")):
            return None
        return tcp

    def _start_tenant_events(self) -> None:
        """Bind each tenant's own event sockets (``events_endpoint``): its stores publish
        there, and only there."""
        from kvstore.events import EventPublisher

        for tenant in self.settings.server.tenants:
            if tenant.events_endpoint is None:
                continue
            where = f"server.tenants.{tenant.name}"
            check = self._events_check(tenant.name) if tenant.events_auth else None
            publisher = EventPublisher(tenant.events(self.config.events, where), check)
            self.tenant_events[tenant.name] = publisher
            publisher.start()
            self.addresses[f"events:{tenant.name}"] = publisher.bound_endpoint or ""
            if publisher.bound_replay_endpoint:
                self.addresses[f"events_replay:{tenant.name}"] = publisher.bound_replay_endpoint

    def _events_check(self, tenant: str) -> Callable[[str, bytes], bool]:
        """Who may subscribe to ``tenant``'s own KV events (``events_auth``): its readers
        and the operator, by the tokens as they stand when a subscriber connects."""
        return lambda user, secret: self._authenticator.reads_events_of(tenant, user, secret)

    def _events_for(self, namespace: str) -> EventPublisher | None:
        tenant = self._authenticator.tenant_of(namespace)
        return self.tenant_events.get(tenant, self.events)

    def _on_open(self, hosted: HostedStore) -> None:
        self.quotas.attach(hosted)
        if self.cluster is not None:
            self.cluster.track(hosted.namespace, hosted.store)

    async def _listen_tcp(self, address: str) -> None:
        host, port = _split(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        bound = sock.getsockname()
        self.addresses["tcp"] = f"{host}:{bound[1]}"
        if self.settings.server.tls_cert:
            server = await asyncio.start_server(
                self._tls_client,
                sock=sock,
                ssl=self._tls_context(),
                ssl_handshake_timeout=self.settings.server.io_timeout_s,
                backlog=_BACKLOG,
            )
            self._tls_servers.append(server)
            return
        self._accept_on(sock)

    def _listen_unix(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if os.path.exists(path) and not _socket_in_use(path):
                os.unlink(path)  # a stale socket of a server that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # only this user may connect (and map shared memory)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        self.addresses["unix"] = path
        self._accept_on(sock)

    def _accept_on(self, sock: socket.socket) -> None:
        sock.listen(_BACKLOG)
        sock.setblocking(False)
        self._listeners.append(sock)
        self._accepting.append(asyncio.create_task(self._accept_loop(sock)))

    async def _listen_metrics(self, address: str) -> None:
        endpoint = MetricsEndpoint(self._render_metrics, lambda: not self.ctx.draining)
        host, port = await endpoint.start(*_split(address))
        self._metrics_endpoint = endpoint
        self.addresses["metrics"] = f"{host}:{port}"

    def _tls_context(self) -> ssl.SSLContext:
        cfg = self.settings.server
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cfg.tls_cert or "", cfg.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"server.tls_cert / tls_key: cannot load them: {exc}") from None
        return context

    def _render_metrics(self) -> str:
        stores = self.registry.stats()
        return self.metrics.render(stores) + self.quotas.render(stores)

    # -- connections ------------------------------------------------------------
    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: wait instead of spinning
                if listener.fileno() < 0:
                    return
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if not self._admit():
                sock.close()
                continue
            self._spawn(RawChannel(sock, self._copier))

    async def _tls_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit():
            writer.close()
            return
        conn = Connection(self.ctx, StreamChannel(reader, writer))
        self.ctx.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.ctx.connections.discard(conn)

    def _admit(self) -> bool:
        ctx = self.ctx
        if ctx.draining or len(ctx.connections) >= self.settings.server.max_connections:
            self.metrics.add("connections_refused")
            return False
        return True

    def _spawn(self, chan: Channel) -> None:
        conn = Connection(self.ctx, chan)
        self.ctx.connections.add(conn)
        task = asyncio.create_task(conn.serve())
        self._serving.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._serving.discard(t)
            self.ctx.connections.discard(conn)

        task.add_done_callback(done)

    # -- stop -------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the server to drain and stop (safe from a signal handler; asked while it
        starts, it stops once started)."""
        self._stop_asked = True
        if self._stopped is not None:
            self._stopped.set()

    async def serve_forever(self) -> None:
        """Serve until :meth:`stop`, then drain and close."""
        assert self._stopped is not None, "start() the server first"
        await self._stopped.wait()
        await self.close()

    async def close(self) -> None:
        """Drain: stop accepting, let requests in flight finish, close, flush stores."""
        ctx = self.ctx
        if ctx.draining:
            return
        ctx.draining = True
        await self._close_listeners()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.server.drain_timeout_s
        while any(c.busy for c in ctx.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(ctx.connections):
            conn.chan.abort()
        if self._serving:
            await asyncio.wait(list(self._serving), timeout=self.settings.server.io_timeout_s)
        await self._release_held(ctx)
        for server in self._tls_servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5.0)
        if self._metrics_endpoint is not None:
            await self._metrics_endpoint.close()
        if self.cluster is not None:  # leave first: peers stop asking for our blocks
            await loop.run_in_executor(self._executor, self.cluster.stop)
        await loop.run_in_executor(self._executor, self.quotas.close)
        await loop.run_in_executor(self._executor, self.registry.close)
        if self.events is not None:
            await loop.run_in_executor(self._executor, self.events.close)
        for publisher in self.tenant_events.values():
            await loop.run_in_executor(self._executor, publisher.close)
        self._executor.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        if "unix" in self.addresses:
            with contextlib.suppress(OSError):
                os.unlink(self.addresses["unix"])
        self._release_disks()  # after the stores' flush: the directories are whole
        log.info("kvstore-server stopped")

    async def _sweep_held(self, ctx: ServerContext) -> None:
        """Give back, every ``_SWEEP_S``, the held reservations whose writers are done
        (exited, or held past ``server.reservation_hold_s``); and, every ``_TRIM_S``,
        the C heap's free memory (the worker, copy and ZMQ threads allocate and free
        from glibc's per-thread arenas, which keep what is freed: the 60-minute memory
        soak's server grew 3.4%)."""
        assert ctx.held is not None
        loop = asyncio.get_running_loop()
        trimmed = loop.time()
        while True:
            await asyncio.sleep(_SWEEP_S)
            done = ctx.held.sweep()
            if done:
                ctx.metrics.gauge("reservations_held", -len(done))
                await loop.run_in_executor(self._executor, handlers.abort_all, done)
            if loop.time() - trimmed >= _TRIM_S:
                trimmed = loop.time()
                if await loop.run_in_executor(self._executor, trim_heap):
                    ctx.metrics.add("heap_trims")

    async def _release_held(self, ctx: ServerContext) -> None:
        """At close: every held reservation, aborted (no slot is handed out again)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if ctx.held is not None and (done := ctx.held.release_all()):
            ctx.metrics.gauge("reservations_held", -len(done))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, handlers.abort_all, done)

    async def _close_listeners(self) -> None:
        for task in self._accepting:
            task.cancel()
        for listener in self._listeners:
            listener.close()
        for server in self._tls_servers:
            server.close()
        self._accepting.clear()
        self._listeners.clear()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain the server, SIGHUP reloads its tenants and tokens
        (main thread only)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def reload(self) -> bool:
        """Take the config file's tokens and tenants now; a bad file is logged in one
        line and changes nothing. True when they were taken. Asked while the server
        starts (its port may accept already), it reloads once started."""
        if self._ctx is None:  # start() has not made the state a reload changes yet
            self._reload_asked = True
            return False
        try:
            self.admin.reload()
        except KVStoreError as exc:
            log.error("reload refused, tenants and tokens unchanged: %s", exc)
            return False
        return True

    def _tenants_changed(self, server: Any) -> None:
        self.settings = self.settings.with_server(server)
        self.quotas.update(server)
        if self._ctx is not None:
            self._ctx.settings = self.settings


class _RequestRate:
    """Requests per second since the previous call: the load a node reports."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last = (time.monotonic(), 0)

    def __call__(self) -> float:
        now = time.monotonic()
        total = int(sum(self._metrics.snapshot()["requests"].values()))
        then, before = self._last
        self._last = (now, total)
        return (total - before) / max(now - then, 1e-3)


def _socket_in_use(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class ServerThread:
    """A :class:`Server` on a thread of its own; a context manager.

    >>> with ServerThread(config) as server:
    ...     client = Client(server.address, layout)
    """

    def __init__(self, config: DaemonConfig | StoreConfig) -> None:
        self.server = Server(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvstore-server", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_until_complete(self.server.serve_forever())
        self._loop.close()

    def start(self) -> ServerThread:
        """Start and wait until it listens."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    @property
    def address(self) -> str:
        """The TCP address (else ``unix:<path>``)."""
        addrs = self.server.addresses
        return addrs["tcp"] if "tcp" in addrs else f"unix:{addrs['unix']}"

    def stats(self) -> dict[str, Any]:
        """The server's counters."""
        return self.server.metrics.snapshot()

    def stop(self) -> None:
        """Drain and stop; wait for the thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.server.stop)
            self._thread.join()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
