"""Security: refusing to start exposed without a token, token auth, namespace isolation, TLS."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trustme

from kvstore.client import Client, ClientOptions
from kvstore.config import StoreConfig
from kvstore.errors import AccessDeniedError, ConfigError, TierError
from kvstore.server import Server, ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire import auth
from kvstore.wire.protocol import Op, Status, encode_json, encode_keys

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
ADMIN = "admin-token-0123456789abcdef"
TEAM_A = "team-a-token-0123456789abcdef"
TEAM_B = "team-b-token-0123456789abcdef"


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step] for i in range(n)]


def tokens() -> dict[str, Any]:
    return {
        "token": ADMIN,
        "tokens": [
            {"name": "a", "token": TEAM_A, "namespaces": ["team-a"]},
            {"name": "b", "token": TEAM_B, "namespaces": ["team-b", "shared"]},
        ],
    }


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "example.com:7070"])
def test_exposed_listener_without_a_token_refuses_to_start(listen: str) -> None:
    config = StoreConfig.from_dict({"server": {"listen": listen}}, environ={})
    with pytest.raises(ConfigError, match=r"refusing to start.*no token is set"):
        Server(config)


def test_exposed_listener_with_a_token_starts(kv_server: Start) -> None:
    server = kv_server(listen="0.0.0.0:0", token=ADMIN)
    host, _, port = server.address.rpartition(":")
    assert host == "0.0.0.0"  # really listening beyond loopback
    keys = make_keys(2)
    with Client(LAYOUT, ClientOptions(f"127.0.0.1:{port}", token=ADMIN.encode())) as c:
        assert all(c.put(keys, blocks(2, seed=3)))
        assert c.lookup(keys) == 2


def test_short_tokens_are_refused(kv_server: Start) -> None:
    with pytest.raises(ConfigError, match="at least 16 characters"):
        kv_server(token="short")


def test_token_file(kv_server: Start, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(ADMIN + "\n")
    server = kv_server(token_file=str(path))
    keys = make_keys(1)
    with Client(LAYOUT, ClientOptions(server.address, token=ADMIN.encode())) as c:
        assert all(c.put(keys, blocks(1, seed=4)))
        assert c.lookup(keys) == 1
    with (  # the file's token is the one enforced
        Client(LAYOUT, ClientOptions(server.address, token=TEAM_A.encode())) as c,
        pytest.raises(AccessDeniedError),
    ):
        c.ping()


def test_missing_and_wrong_tokens_are_refused(kv_server: Start) -> None:
    server = kv_server(**tokens())
    with (
        Client(LAYOUT, ClientOptions(server.address)) as c,
        pytest.raises(AccessDeniedError, match="requires a token"),
    ):
        c.ping()
    with (
        Client(LAYOUT, ClientOptions(server.address, token=b"x" * 32)) as c,
        pytest.raises(AccessDeniedError, match="authentication failed"),
    ):
        c.ping()
    assert server.stats()["auth_failures"] == 1


def test_unauthenticated_frames_are_refused_and_change_nothing(kv_server: Start, raw: Any) -> None:
    server = kv_server(**tokens())
    conn = raw(server.address)
    conn.call(Op.HELLO, encode_json({}))
    frame, _meta, _ = conn.call(Op.DELETE, encode_keys(make_keys(1)))
    assert frame.status == Status.UNAUTHENTICATED
    assert conn.closed_by_server()
    conn = raw(server.address)
    frame, _, _ = conn.call(Op.GET, b"")  # not even HELLO
    assert frame.status == Status.UNAUTHENTICATED and conn.closed_by_server()
    assert server.server.registry.hosted() == []  # no store was even opened


def test_a_replayed_answer_fails_on_another_connection(kv_server: Start, raw: Any) -> None:
    server = kv_server(**tokens())
    first = raw(server.address)
    hello = first.handshake()
    answer = auth.answer(ADMIN.encode(), bytes.fromhex(hello["nonce"]))
    assert first.call(Op.AUTH, answer)[0].status == Status.OK
    second = raw(server.address)
    second.call(Op.HELLO, encode_json({}))
    assert second.call(Op.AUTH, answer)[0].status == Status.UNAUTHENTICATED


def test_namespace_isolation_between_tokens(kv_server: Start) -> None:
    server = kv_server(**tokens())
    keys = make_keys(3)

    def client(token: str, namespace: str) -> Client:
        return Client(LAYOUT, ClientOptions(server.address, namespace, token.encode()))

    with client(TEAM_A, "team-a") as a, client(TEAM_B, "team-b") as b:
        assert all(a.put(keys, blocks(3, seed=1)))
        assert b.exists(keys) == [False] * 3  # same keys, another tenant: not visible
        assert b.get(keys, [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype)] * 3) == [False] * 3
        assert b.delete(keys) == 0 and b.list_keys() == []
        assert a.exists(keys) == [True] * 3  # b could not evict or delete them
        stats = b.server_stats()
        assert {s["namespace"] for s in stats["stores"]} == {"team-b"}
    for token, namespace in ((TEAM_A, "team-b"), (TEAM_B, "team-a"), (TEAM_A, "shared")):
        with client(token, namespace) as c, pytest.raises(AccessDeniedError, match="does not open"):
            c.ping()
    with client(ADMIN, "team-a") as admin:  # the unrestricted token opens any namespace
        assert admin.exists(keys) == [True] * 3


def test_access_denied_is_its_own_error(kv_server: Start) -> None:
    from kvstore.client.connection import Connection

    server = kv_server(**tokens())
    with pytest.raises(AccessDeniedError):
        Connection(ClientOptions(server.address, "team-a", TEAM_B.encode()), LAYOUT)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_server(kv_server: Start, ca: trustme.CA, tmp_path: Path) -> ServerThread:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_path), append=True)
    cert.private_key_pem.write_to_path(str(key_path))
    return kv_server(token=ADMIN, tls_cert=str(cert_path), tls_key=str(key_path))


def test_tls_round_trip(kv_server: Start, ca: trustme.CA, tmp_path: Path) -> None:
    server = tls_server(kv_server, ca, tmp_path)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    options = ClientOptions(
        server.address, token=ADMIN.encode(), tls=True, tls_ca=str(ca_path), shared_memory=False
    )
    keys, data = make_keys(2), blocks(2, seed=3)
    with Client(LAYOUT, options) as c:
        assert all(c.put(keys, data))
        outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(2)]
        assert c.get(keys, outs) == [True, True]
    assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))


def test_tls_refuses_plain_clients_and_unknown_servers(
    kv_server: Start, ca: trustme.CA, tmp_path: Path
) -> None:
    server = tls_server(kv_server, ca, tmp_path)
    plain = ClientOptions(server.address, token=ADMIN.encode(), timeout=3.0)
    with Client(LAYOUT, plain) as c, pytest.raises(TierError):
        c.ping()
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    untrusted = ClientOptions(server.address, token=ADMIN.encode(), tls=True, tls_ca=str(other_ca))
    with (
        Client(LAYOUT, untrusted) as c,
        pytest.raises(TierError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        c.ping()
    assert ssl.OPENSSL_VERSION  # the check above came from OpenSSL, not a mock
