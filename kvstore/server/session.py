"""What a request handler sees of the server: its connection's session, the shared context.

:mod:`kvstore.server.handlers` serves data requests for a
:class:`~kvstore.server.connection.Connection` but sees it only as a
:class:`Session`, the few things a handler uses (the store it opened, its
channel, loans and reservations, replies, worker threads, deadlines). So
imports run one way: the connection imports the handlers, and both import
this module, which imports neither.

Also here: what every connection of one server shares (:class:`ServerContext`,
:class:`ByteBudget`), a reservation waiting for its COMMIT
(:class:`Reservation`), and :class:`Refused`, the error a request is refused with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvstore.config import DaemonConfig, ServerConfig
from kvstore.datapath.contracts import Loan, PendingPut
from kvstore.server.channel import Buffer, Channel
from kvstore.server.metrics import ServerMetrics
from kvstore.server.orphans import HeldPuts, ProcessId
from kvstore.server.quotas import TenantQuotas
from kvstore.server.staging import StagingPool
from kvstore.server.stores import HostedStore, StoreRegistry
from kvstore.server.tenants import AdminDesk
from kvstore.wire import Authenticator, Frame, Status

__all__ = ["ByteBudget", "Refused", "Reservation", "ServerContext", "Session"]

T = TypeVar("T")


class Refused(Exception):
    """A request refused with ``status``; ``fatal``: the connection closes after the reply."""

    def __init__(self, status: Status, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.fatal = fatal


class ByteBudget:
    """Payload bytes in flight across the server. Loop-only (no lock needed).

    A request bigger than the whole budget is let through alone, so nothing
    is refused for its size here (frame limits do that); others wait.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, nbytes: int, deadline: float) -> bool:
        """Take ``nbytes``; False if they did not free up before ``deadline``."""
        loop = asyncio.get_running_loop()
        async with self._cond:
            while self.used and self.used + nbytes > self.limit:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), left)
            self.used += nbytes
            return True

    async def release(self, nbytes: int) -> None:
        """Give ``nbytes`` back."""
        async with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


@dataclass
class Reservation:
    """A RESERVE waiting for its COMMIT."""

    pending: PendingPut
    slots: list[tuple[int, int]]
    created: float


class Session(Protocol):
    """A client connection, as request handlers see it (one per connection, loop-only)."""

    @property
    def ctx(self) -> ServerContext:
        """What every connection of the server shares."""

    @property
    def chan(self) -> Channel:
        """The client's byte stream."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop."""

    @property
    def store(self) -> HostedStore:
        """The store this connection opened."""

    @property
    def loans(self) -> dict[int, Loan]:
        """Loans of shared-memory blocks the client has not released, by lease id."""

    @property
    def reservations(self) -> dict[int, Reservation]:
        """RESERVEs waiting for their COMMIT, by reservation id."""

    @property
    def ids(self) -> Iterator[int]:
        """Fresh lease and reservation ids."""

    @property
    def serial(self) -> int:
        """This connection's number, unique in the server (its held reservations' tags)."""

    @property
    def attached(self) -> bool:
        """Whether the client mapped the shared memory through this connection."""

    @property
    def writer(self) -> ProcessId | None:
        """The client process (None: not known), which writes the shared memory it
        reserves."""

    @property
    def busy(self) -> int:
        """Requests being received or served (a draining server waits for 0)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread."""

    def deadline(self, nbytes: int = 0) -> float:
        """When ``nbytes`` more must have moved (loop time)."""

    async def reply(
        self,
        request: Frame,
        meta: bytes = b"",
        payload: Sequence[Buffer] = (),
        flags: int = 0,
    ) -> None:
        """Send the reply to ``request`` (unless it asked for none)."""


@dataclass
class ServerContext:
    """What every connection of one server shares."""

    #: The server's config by role; ``settings.server`` follows reloads.
    settings: DaemonConfig
    registry: StoreRegistry
    authenticator: Authenticator
    metrics: ServerMetrics
    budget: ByteBudget
    executor: Executor
    staging: StagingPool
    draining: bool = False
    connections: set[Session] = field(default_factory=set)
    #: Serves ADMIN requests and reloads (None: a server made without one).
    admin: AdminDesk | None = None
    #: Tenants' quotas and figures (None: a server made without them).
    quotas: TenantQuotas | None = None
    #: Dropped reservations whose writers may still write (None: a server made without
    #: it aborts them at once).
    held: HeldPuts | None = None

    def tenant_names(self) -> frozenset[str]:
        """The tenants of ``server.tenants`` as they stand now."""
        server = self.admin.server if self.admin is not None else self.settings.server
        return frozenset(t.name for t in server.tenants)

    @property
    def server(self) -> ServerConfig:
        """The ``server:`` section of the config."""
        return self.settings.server
