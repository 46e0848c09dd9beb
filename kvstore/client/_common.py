"""What the sync and asyncio clients share: options, the handshake, replies, batching."""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.config import RemoteTierConfig, check_namespace, normalize_address
from kvstore.errors import (
    AccessDeniedError,
    ConfigError,
    InvalidInputError,
    KVStoreError,
    ProtocolError,
    ScopeError,
    StoreLimitError,
    TierError,
)
from kvstore.hints import Hint, HintAnswer, checked_hint
from kvstore.keys import BlockKey, check_keys
from kvstore.layout import KVLayout
from kvstore.version import __version__
from kvstore.wire import (
    NONCE_BYTES,
    VERSION,
    Frame,
    Op,
    Status,
    answer,
    decode_json,
    encode_hint_request,
    encode_json,
    wire_nbytes,
)

__all__ = [
    "FATAL_STATUSES",
    "MAX_REQUEST_BYTES",
    "ClientOptions",
    "check_layers",
    "error_for",
    "same_length",
    "batches",
    "check_reply",
    "hint_answer",
    "hint_request",
    "hello_meta",
    "open_meta",
    "auth_meta",
    "refused",
    "not_understood",
]

#: Requests carry at most this many payload bytes (bigger batches are split).
MAX_REQUEST_BYTES = 256 * 1024**2
#: Error replies after which the server closes the connection: it cannot be reused.
FATAL_STATUSES = frozenset(
    {Status.BAD_FRAME, Status.UNAUTHENTICATED, Status.TOO_LARGE, Status.UNSUPPORTED_VERSION}
)
#: Every status of the protocol (IntEnum members hash as their values).
_KNOWN_STATUSES = frozenset(Status)


@dataclass(frozen=True)
class ClientOptions:
    """How to reach and use a kvstore-server.

    ``address``: ``HOST:PORT`` or ``unix:/path`` (``tcp://HOST:PORT`` and
    ``unix:///path`` are taken and kept in those spellings). ``namespace``: the server-side
    partition (a tenant). ``token``: the secret, if the server wants one.
    ``tls``: encrypt (``tls_ca``: CA bundle to trust, None for the system's;
    ``tls_server_name``: the name to check, default the host). ``shared_memory``:
    move block bytes through the server's memory when on the same host.
    ``pool_size`` connections at most; ``connect_timeout`` and ``timeout``
    (per request) in seconds; after an outage one probe per ``retry_interval``.
    """

    address: str = "127.0.0.1:7070"
    namespace: str = "default"
    token: bytes | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_server_name: str | None = None
    shared_memory: bool = True
    pool_size: int = 4
    connect_timeout: float = 2.0
    timeout: float = 30.0
    retry_interval: float = 1.0
    durable: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", normalize_address(self.address, "address"))
        check_namespace(self.namespace, "namespace")
        if self.pool_size < 1 or self.connect_timeout <= 0 or self.timeout <= 0:
            raise ConfigError("pool_size, connect_timeout and timeout must be > 0")

    @classmethod
    def from_config(cls, config: RemoteTierConfig) -> ClientOptions:
        """The options a ``remote`` tier's config describes."""
        return cls(
            address=config.address,
            namespace=config.namespace,
            token=config.secret(),
            tls=config.tls,
            tls_ca=config.tls_ca,
            tls_server_name=config.tls_server_name,
            shared_memory=config.shared_memory,
            pool_size=config.pool_size,
            connect_timeout=config.connect_timeout,
            timeout=config.timeout,
            retry_interval=config.retry_interval,
            durable=config.durable,
        )

    @property
    def unix_path(self) -> str | None:
        """The socket path of a ``unix:`` address."""
        return self.address[5:] if self.address.startswith("unix:") else None

    @property
    def host_port(self) -> tuple[str, int]:
        """Host and port of a TCP address."""
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context to wrap connections in (None without TLS)."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.tls_ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def hello_meta() -> bytes:
    """HELLO's meta."""
    return encode_json({"client": f"kvstore/{__version__}", "protocol": 1})


def auth_meta(hello: dict[str, Any], token: bytes | None) -> bytes | None:
    """AUTH's meta for the server's challenge; None when the server wants no token."""
    if hello.get("auth") != "token":
        return None
    if token is None:
        raise AccessDeniedError("the server requires a token; set token or token_file")
    try:
        nonce = bytes.fromhex(str(hello["nonce"]))
    except (KeyError, ValueError):
        raise ProtocolError("the server's HELLO carries no valid nonce") from None
    if len(nonce) != NONCE_BYTES:
        raise ProtocolError("the server's nonce has the wrong size")
    return answer(token, nonce)


def refused(options: ClientOptions, exc: AccessDeniedError) -> AccessDeniedError:
    """A refusal of the handshake (AUTH or OPEN) as one line that names the server, the
    namespace and that the token was refused, so that whoever reads it -- a log, an
    error at open, a failed get -- knows the token is the problem."""
    detail = str(exc).removeprefix("kvstore-server: ")
    if options.token is None:
        return AccessDeniedError(
            f"kvstore-server at {options.address} refused a client without a token "
            f"(namespace {options.namespace!r}): {detail}"
        )
    return AccessDeniedError(
        f"kvstore-server at {options.address} refused the token for namespace "
        f"{options.namespace!r}: {detail}; use a token this server accepts for it"
    )


def over_store_limit(options: ClientOptions, exc: StoreLimitError) -> StoreLimitError:
    """A server that will not open this client's store (it hosts ``server.max_stores``
    already) as one line naming the server, what happened and the setting to change:
    the server answers, so this is no outage, and retrying alone cannot help."""
    detail = str(exc).removeprefix("kvstore-server: ")
    return StoreLimitError(
        f"kvstore-server at {options.address} will not open this store: {detail}; raise "
        "server.max_stores in that server's config and restart it"
    )


def not_understood(options: ClientOptions, exc: ProtocolError) -> ProtocolError:
    """A handshake answered in another protocol -- another wire version, or not a
    kvstore-server at all -- as one line naming the address and what to check. Not an
    outage: retrying cannot help, so the store does not open (as for a refused token)."""
    return ProtocolError(
        f"kvstore-server at {options.address} does not speak this client's protocol: {exc}; "
        "check that the address is a kvstore-server's and that the server runs the same "
        f"kvstore release as this client (kvstore {__version__}, wire protocol {VERSION})"
    )


@contextmanager
def handshake(options: ClientOptions, close: Callable[[], None]) -> Iterator[None]:
    """Around a connection's handshake: on any error ``close`` it; a refusal
    (:func:`refused`) or another protocol (:func:`not_understood`) becomes one line that
    names the server. Used by the sync and the async connection alike."""
    try:
        yield
    except AccessDeniedError as exc:
        close()
        raise refused(options, exc) from None
    except ProtocolError as exc:
        close()
        raise not_understood(options, exc) from None
    except StoreLimitError as exc:
        close()
        raise over_store_limit(options, exc) from None
    except BaseException:
        close()
        raise


def open_meta(namespace: str, layout: KVLayout) -> bytes:
    """OPEN's meta (``pid``: the process that writes the shared memory it reserves)."""
    return encode_json(
        {
            "namespace": namespace,
            "layout": layout.describe(),
            "fingerprint": layout.fingerprint_hex,
            "pid": os.getpid(),
        }
    )


def check_reply(frame: Frame, request_id: int, op: int, meta: bytes) -> None:
    """Raise the error a failed reply carries (ProtocolError for a frame that does not
    answer the request); after one whose status is in :data:`FATAL_STATUSES` the
    connection is closed by the server."""
    if not frame.is_reply or frame.request_id != request_id or frame.op != op:
        raise ProtocolError(
            f"expected the reply to request {request_id} ({Op(op).name}), got op {frame.op} "
            f"for request {frame.request_id}"
        )
    if frame.status == Status.OK:
        return
    message = meta.decode("utf-8", "replace")
    if frame.status == Status.BUSY and op == Op.OPEN:  # not in flight: max_stores
        raise StoreLimitError(f"kvstore-server: {message} (BUSY)")
    raise error_for(frame.status, message)


def error_for(status: int, message: str) -> KVStoreError:
    """The exception a server's error reply means."""
    name = Status(status).name if status in _KNOWN_STATUSES else str(status)
    text = f"kvstore-server: {message} ({name})"
    if status == Status.NOT_PERMITTED:
        exc: KVStoreError = ScopeError(text)
    elif status in (Status.UNAUTHENTICATED, Status.FORBIDDEN):
        exc = AccessDeniedError(text)
    elif status in (Status.BAD_REQUEST, Status.TOO_LARGE):
        exc = InvalidInputError(text)
    elif status == Status.UNSUPPORTED_VERSION:
        exc = ProtocolError(text)  # the server does not take our frames: not an outage
    else:
        exc = TierError(text)
    return exc


def batches(
    n: int, layout: KVLayout, limits: dict[str, Any], layers: tuple[int, int] | None = None
) -> Iterator[range]:
    """Index ranges of at most ``max_batch_blocks`` blocks and ``MAX_REQUEST_BYTES``."""
    per = wire_nbytes(layout, layers)
    most_bytes = min(MAX_REQUEST_BYTES, int(limits.get("max_frame_bytes", MAX_REQUEST_BYTES)))
    step = max(1, min(int(limits.get("max_batch_blocks", 1024)), most_bytes // per))
    for start in range(0, n, step):
        yield range(start, min(n, start + step))


def check_layers(layout: KVLayout, layers: tuple[int, int] | None) -> tuple[int, int] | None:
    """``layers`` if a valid, non-whole range; None for whole blocks."""
    if layers is None:
        return None
    first, last = layers
    if not 0 <= first < last <= layout.num_layers:
        raise InvalidInputError(f"layer range {tuple(layers)} outside [0, {layout.num_layers})")
    return None if (first, last) == (0, layout.num_layers) else (first, last)


def same_length(keys: Sequence[Any], others: Sequence[Any], what: str) -> None:
    """InvalidInputError unless there is one ``what`` per key."""
    if len(keys) != len(others):
        raise InvalidInputError(f"{len(keys)} keys but {len(others)} {what}")


def hint_request(
    keys: Sequence[BlockKey] | None,
    session: str | None,
    hint: Hint,
    limits: dict[str, Any],
) -> bytes:
    """HINT's meta, after the checks ``store.hint`` makes (InvalidInputError, before
    anything is sent). One hint is one request, never split (a session's keys are
    those of its latest hint), so it names at most the server's ``max_batch_blocks``
    keys (checked here once the server's ``limits`` are known, else by the server)."""
    checked = check_keys(keys) if keys is not None else None
    checked_hint(checked is not None, session, hint)
    most = limits.get("max_batch_blocks")
    if checked is not None and isinstance(most, int) and len(checked) > most:
        raise InvalidInputError(
            f"hint: {len(checked)} keys; the server takes at most {most} in one hint "
            "(server.max_batch_blocks)"
        )
    fields = {
        "retain_s": hint.retain_s,
        "priority": hint.priority,
        "prefetch": hint.prefetch,
        "demote": hint.demote,
        "session": session,
    }
    return encode_hint_request(fields, checked)


_ANSWER_STATUSES = frozenset({"accepted", "clipped", "rejected"})


def hint_answer(meta: bytes) -> HintAnswer:
    """The :class:`HintAnswer` a HINT reply carries (fields it does not know are
    ignored); ProtocolError if it is not one."""
    body = decode_json(meta)
    counts = [body.get(k, 0) for k in ("blocks", "prefetching", "demoted")]
    retain_s = body.get("retain_s")
    if (
        body.get("status") not in _ANSWER_STATUSES
        or not isinstance(body.get("reason", ""), str)
        or any(type(n) is not int or n < 0 for n in counts)
        or not (retain_s is None or (type(retain_s) in (int, float) and retain_s >= 0))
    ):
        raise ProtocolError(f"the server's HINT reply is not a hint answer: {body!r:.200}")
    blocks, prefetching, demoted = counts
    return HintAnswer(
        str(body["status"]),
        str(body.get("reason", "")),
        blocks,
        None if retain_s is None else float(retain_s),
        prefetching,
        demoted,
    )
