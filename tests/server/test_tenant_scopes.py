"""Tenants on a live kvstore-server: isolation, scopes, and tokens changed at run time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore.client import Client, ClientOptions
from kvstore.client.admin import AdminClient
from kvstore.errors import AccessDeniedError, InvalidInputError, ScopeError
from kvstore.keys import Namespace, chain_keys, tokens_to_bytes
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import Op, Status, encode_json

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
OPS = "ops-token-0123456789abcdef"
ROOT = {"scopes": ["root"]}
SCOPES = ["read", "write", "admin"]
A_RW = "a-rw-token-0123456789abcdef"
A_RO = "a-ro-token-0123456789abcdef"
B_RW = "b-rw-token-0123456789abcdef"
C_RW = "c-rw-token-0123456789abcdef"
A_LEAD = "a-lead-token-0123456789abcdef"
A_NEW = "a-new-token-0123456789abcdef"


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(n)]


def tenants() -> dict[str, Any]:
    return {
        "tenants": {
            "team-a": {
                "namespaces": ["team-a", "team-a-eval"],
                "tokens": [
                    {"name": "a-rw", "token": A_RW},
                    {"name": "a-ro", "token": A_RO, "scopes": ["read"]},
                    {"name": "a-lead", "token": A_LEAD, "scopes": ["manage"]},
                ],
            },
            "team-b": {"namespaces": ["team-b"], "tokens": [{"name": "b-rw", "token": B_RW}]},
            "ops": {"tokens": [{"name": "ops", "token": OPS, "scopes": SCOPES}]},
        }
    }


def client(server: ServerThread, token: str, namespace: str) -> Client:
    return Client(LAYOUT, ClientOptions(server.address, namespace, token.encode()))


def admin(server: ServerThread, token: str = OPS) -> AdminClient:
    return AdminClient(ClientOptions(server.address, "team-a", token.encode()))


def test_the_same_prompt_under_two_tenants_gives_different_keys() -> None:
    prompt = tokens_to_bytes(list(range(4 * LAYOUT.block_tokens)))
    seeds = [Namespace("m", LAYOUT, tenant=t).seed for t in ("team-a", "team-b")]
    keys_a, keys_b = (chain_keys(prompt, LAYOUT.block_tokens, s) for s in seeds)
    assert not set(keys_a) & set(keys_b)
    # No tenant: the seed is the one it always was (stored blocks keep their keys).
    assert Namespace("m", LAYOUT).seed != seeds[0]
    assert Namespace("m", LAYOUT, tenant=None).seed == Namespace("m", LAYOUT).seed


def test_a_tenant_never_sees_another_tenants_blocks(kv_server: Start) -> None:
    server = kv_server(**tenants())
    keys = make_keys(3)
    with client(server, A_RW, "team-a") as a, client(server, B_RW, "team-b") as b:
        assert all(a.put(keys, blocks(3, seed=1)))
        assert b.exists(keys) == [False] * 3 and b.lookup(keys) == 0
        assert b.get(keys, empty(3)) == [False] * 3
        assert b.delete(keys) == 0 and b.list_keys() == []
        stats = b.server_stats()
        assert {s["namespace"] for s in stats["stores"]} == {"team-b"}
        assert "server" not in stats  # every tenant's traffic is not team-b's to see
        assert a.exists(keys) == [True] * 3
    for token, namespace in ((A_RW, "team-b"), (B_RW, "team-a"), (B_RW, "team-a-eval")):
        with client(server, token, namespace) as c, pytest.raises(AccessDeniedError):
            c.ping()
    with client(server, OPS, "team-a") as ops:  # the operator (admin scope) sees all
        assert ops.exists(keys) == [True] * 3
        assert "server" in ops.server_stats()


def test_scopes_are_enforced(kv_server: Start, raw: Any) -> None:
    server = kv_server(**tenants())
    keys = make_keys(2)
    with client(server, A_RW, "team-a") as rw:
        assert all(rw.put(keys, blocks(2, seed=2)))
    with client(server, A_RO, "team-a") as ro:
        assert ro.lookup(keys) == 2
        assert ro.get(keys, empty(2)) == [True, True]
        assert not ro.shared_memory  # a mapping is writable: readers get none
        with pytest.raises(ScopeError, match="lacks the write scope"):
            ro.put(make_keys(1, salt=9), blocks(1, seed=3))
        with pytest.raises(ScopeError, match="lacks the write scope"):
            ro.delete(keys)
        assert ro.lookup(keys) == 2  # nothing changed, and the connection goes on
    with pytest.raises(ScopeError, match="lacks the manage scope"):
        admin(server, A_RW).tenants()
    conn = raw(server.address)
    conn.handshake(token=A_RO.encode(), namespace="team-a", layout=LAYOUT)
    frame, meta, _ = conn.call(Op.ADMIN, encode_json({"action": "tenants"}))
    assert frame.status == Status.NOT_PERMITTED and b"manage scope" in meta
    frame, _, _ = conn.call(Op.PING)
    assert frame.status == Status.OK  # refused, not cut off


def test_tenants_and_tokens_change_at_run_time(kv_server: Start) -> None:
    server = kv_server(**tenants())
    keys = make_keys(2, salt=5)
    ops = admin(server)
    assert set(ops.tenants()["tenants"]) == {"team-a", "team-b", "ops"}
    assert "token" not in str(ops.tenants()["tenants"]["team-a"]["tokens"][0])  # no secrets
    with pytest.raises(AccessDeniedError):
        client(server, C_RW, "team-c").ping()
    ops.put_tenant("team-c", ["team-c"], [{"name": "c", "token": C_RW}])
    with client(server, C_RW, "team-c") as c:
        assert all(c.put(keys, blocks(2, seed=6)))
        ops.put_tenant("team-c", ["team-c"], [{"name": "c", "token": C_RW, "scopes": ["read"]}])
        with pytest.raises(ScopeError, match="write scope"):  # the open connection too
            c.put(make_keys(1, salt=7), blocks(1, seed=7))
        ops.remove_tenant("team-c")
        with pytest.raises(AccessDeniedError):
            c.lookup(keys)
    ops.put_tenant("team-c", ["team-c"], [{"name": "c", "token": C_RW}])
    with client(server, C_RW, "team-c") as c:
        assert c.lookup(keys) == 2  # removing the tenant lost no block


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ({"action": "nope"}, "unknown action"),
        ({"action": "put_tenant", "tenant": "x"}, "give 'tenant'"),
        ({"action": "put_tenant", "tenant": {"name": "bad name!"}}, "namespace|name"),
        (
            {"action": "put_tenant", "tenant": {"name": "team-x", "namespaces": ["team-a"]}},
            "already belongs to tenant 'team-a'",
        ),
        (
            {"action": "put_tenant", "tenant": {"name": "x", "tokens": [{"token": "short"}]}},
            "at least 16 characters",
        ),
        (
            {"action": "put_tenant", "tenant": {"name": "x", "tokens": [{"token": C_RW, **ROOT}]}},
            "unknown scope 'root'",
        ),
        (
            {"action": "put_tenant", "tenant": {"name": "x", "tokens": [{"token": A_RW}]}},
            "same token",
        ),
        ({"action": "remove_tenant", "name": "nobody"}, "no tenant 'nobody'"),
        ({"action": "reload"}, "not started from a config file"),
    ],
)
def test_bad_admin_requests_change_nothing(
    kv_server: Start, request_: dict[str, Any], match: str
) -> None:
    server = kv_server(**tenants())
    ops = admin(server)
    before = ops.tenants()
    action = request_.pop("action")
    with pytest.raises(InvalidInputError, match=match) as info:
        ops.request(action, **request_)
    assert "\n" not in str(info.value)
    assert ops.tenants() == before
    with client(server, A_RW, "team-a") as a:
        a.ping()


def test_tokens_added_at_run_time_close_connections_made_without_one(kv_server: Start) -> None:
    server = kv_server()  # loopback, no token: every client is trusted
    with Client(LAYOUT, ClientOptions(server.address, "team-a")) as anyone:
        anyone.ping()
        AdminClient(ClientOptions(server.address, "team-a")).put_tenant(
            "team-a", ["team-a"], [{"name": "a", "token": A_RW}]
        )
        with pytest.raises(AccessDeniedError):
            anyone.lookup(make_keys(1))
    with client(server, A_RW, "team-a") as a:
        assert a.lookup(make_keys(1)) == 0


def test_a_tenants_manager_rotates_its_own_tokens_and_nothing_else(kv_server: Start) -> None:
    server = kv_server(**tenants())
    keys = make_keys(2, salt=11)
    with client(server, A_RW, "team-a") as a:
        assert all(a.put(keys, blocks(2, seed=11)))
    lead, ops = admin(server, A_LEAD), admin(server)
    assert set(lead.tenants()["tenants"]) == {"team-a"}  # no other tenant, no server token
    before = ops.tenants()
    refused: list[tuple[Any, ...]] = [
        (lead.put_tenant, "team-a", ["team-a", "team-b"], []),  # grab another's namespace
        (lead.remove_tenant, "team-b"),
        (lead.reload,),
        (lead.put_tokens, [{"name": "x", "token": A_NEW, "scopes": ["manage"]}], "team-b"),
        (lead.put_tokens, [{"name": "x", "token": A_NEW, "scopes": ["manage", "admin"]}]),
        (lead.put_tokens, [{"name": "x", "token_file": "/etc/hostname", "scopes": ["manage"]}]),
    ]
    for call, *args in refused:
        with pytest.raises(ScopeError):
            call(*args)
    with pytest.raises(InvalidInputError, match="keep one token with the manage scope"):
        lead.put_tokens([{"name": "a-rw", "token": A_NEW}])
    assert ops.tenants() == before  # every refusal changed nothing
    rotated = [
        {"name": "a-rw", "token": A_NEW},
        {"name": "a-lead", "token": A_LEAD, "scopes": ["manage"]},
    ]
    tokens = lead.put_tokens(rotated)["tenants"]["team-a"]["tokens"]
    assert [t["name"] for t in tokens] == ["a-rw", "a-lead"]
    with pytest.raises(AccessDeniedError):  # the old secret stops working
        client(server, A_RW, "team-a").ping()
    with client(server, A_NEW, "team-a") as a:
        assert a.lookup(keys) == 2  # same tenant, same blocks
    with client(server, B_RW, "team-b") as b:
        b.ping()  # other tenants untouched
    assert ops.tenants()["tenants"]["team-b"] == before["tenants"]["team-b"]
    ops.put_tokens([{"name": "b2", "token": C_RW}], tenant="team-b")  # the operator: any tenant
    with client(server, C_RW, "team-b") as b:
        b.ping()
