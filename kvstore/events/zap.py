"""Token checks for KV-event subscribers: ZMQ's PLAIN mechanism, answered over ZAP.

A publisher that authenticates (a tenant's sockets with ``events_auth``) makes its PUB and
ROUTER sockets PLAIN servers: a subscriber connects with a user name and a password
(``zmq.PLAIN_USERNAME`` / ``zmq.PLAIN_PASSWORD``), and ZMQ asks the context's ZAP handler
(RFC 27, ``inproc://zeromq.zap.01``) whether to let it in before it receives anything.
:class:`ZapHandler` is that handler; the publisher's own thread polls its socket beside
the others, so no thread is added and the check reads the tokens as they stand at each
connection (a token rotated out no longer connects; connections made before stay).

PLAIN sends the password as it is: over a network, keep the endpoint on ``ipc://`` or
behind a tunnel (as for the server's token without TLS).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["ZAP_DOMAIN", "ZAP_ENDPOINT", "Check", "ZapHandler", "require_plain"]

log = logging.getLogger(__name__)

#: Where ZMQ sends the authentication requests of a context (RFC 27).
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: The ZAP domain kvstore's authenticating sockets announce.
ZAP_DOMAIN = b"kvstore-events"
#: ``check(user, password)``: whether a subscriber with these credentials may connect.
Check = Callable[[str, bytes], bool]


def require_plain(sock: zmq.Socket[Any]) -> None:
    """Make ``sock`` (before it binds) a PLAIN server whose peers ZAP must admit."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


class ZapHandler:
    """The ZAP handler of one ZMQ context, admitting PLAIN peers that ``check`` accepts.

    Bind it (construct it) before any socket of the context binds; the thread that polls
    :attr:`socket` calls :meth:`answer` when it is readable, and :meth:`close` at the end.
    """

    def __init__(self, ctx: zmq.Context[Any], check: Check) -> None:
        self.check = check
        self.socket: zmq.Socket[Any] = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        #: Connections admitted and refused.
        self.counts = {"admitted": 0, "refused": 0}

    def answer(self) -> None:
        """Answer one waiting request (RFC 27: version, id, domain, address, identity,
        mechanism, credentials; the reply: version, id, status, text, user, metadata)."""
        frames = self.socket.recv_multipart()
        version, request_id = frames[0], frames[1] if len(frames) > 1 else b""
        ok, user = self._decide(frames)
        status, text = (b"200", b"OK") if ok else (b"400", b"not a token of this tenant")
        self.counts["admitted" if ok else "refused"] += 1
        if not ok:
            log.warning("events: a subscriber was refused (user %r)", user)
        self.socket.send_multipart([version, request_id, status, text, user.encode(), b""])

    def _decide(self, frames: list[bytes]) -> tuple[bool, str]:
        if len(frames) < 6 or frames[0] != b"1.0" or frames[5] != b"PLAIN" or len(frames) != 8:
            return False, ""
        user = frames[6].decode("utf-8", errors="replace")
        try:
            return bool(self.check(user, frames[7])), user
        except Exception:  # a failing check admits nobody, and never ends the publisher
            log.exception("events: the subscriber check failed")
            return False, user

    def close(self) -> None:
        """Close the socket (the publisher's thread, at its end)."""
        self.socket.close(0)
