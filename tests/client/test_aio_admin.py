"""AsyncAdminClient against a real server: the sync admin's tenants, changes and refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore.client import AsyncAdminClient, AsyncClient, ClientOptions
from kvstore.client.admin import AsyncAdminClient as FromAdmin
from kvstore.errors import AccessDeniedError, InvalidInputError, TierError
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
OPS = "ops-token-0123456789abcdef"
A_RW = "a-rw-token-0123456789abcdef"
C_RW = "c-rw-token-0123456789abcdef"


def tenants() -> dict[str, Any]:
    return {
        "tenants": {
            "team-a": {"namespaces": ["team-a"], "tokens": [{"name": "a-rw", "token": A_RW}]},
            "ops": {
                "tokens": [{"name": "ops", "token": OPS, "scopes": ["read", "write", "admin"]}]
            },
        }
    }


def admin(server: ServerThread, token: str = OPS) -> AsyncAdminClient:
    return AsyncAdminClient(ClientOptions(server.address, "team-a", token.encode()))


def client(server: ServerThread, token: str, namespace: str) -> AsyncClient:
    return AsyncClient(LAYOUT, ClientOptions(server.address, namespace, token.encode()))


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def test_exported_from_the_client_package() -> None:
    assert AsyncAdminClient is FromAdmin


def test_tenants_put_use_and_remove(kv_server: Start) -> None:
    server = kv_server(**tenants())
    keys = make_keys(2, salt=5)

    async def scenario() -> None:
        ops = admin(server)
        listed = (await ops.tenants())["tenants"]
        assert set(listed) == {"team-a", "ops"}
        assert "token" not in str(listed["team-a"]["tokens"][0])  # no secrets
        with pytest.raises(AccessDeniedError):
            await client(server, C_RW, "team-c").ping()
        after = await ops.put_tenant("team-c", ["team-c"], [{"name": "c", "token": C_RW}])
        assert after["tenants"]["team-c"]["namespaces"] == ["team-c"]
        async with client(server, C_RW, "team-c") as c:  # the new token works at once
            assert await c.put(keys, blocks(2, seed=6)) == [True, True]
        after = await ops.remove_tenant("team-c")
        assert set(after["tenants"]) == {"team-a", "ops"}
        with pytest.raises(AccessDeniedError):
            await client(server, C_RW, "team-c").ping()

    asyncio.run(scenario())


def test_a_token_without_the_admin_scope_is_refused(kv_server: Start) -> None:
    server = kv_server(**tenants())

    async def scenario() -> None:
        with pytest.raises(AccessDeniedError, match="lacks the manage scope"):
            await admin(server, A_RW).tenants()
        with pytest.raises(AccessDeniedError, match="lacks the manage scope"):
            await admin(server, A_RW).put_tenant("team-c", ["team-c"], [])
        assert set((await admin(server).tenants())["tenants"]) == {"team-a", "ops"}

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ({"action": "nope"}, "unknown action"),
        ({"action": "put_tenant", "tenant": "x"}, "give 'tenant'"),
        (
            {"action": "put_tenant", "tenant": {"name": "team-x", "namespaces": ["team-a"]}},
            "already belongs to tenant 'team-a'",
        ),
        (
            {"action": "put_tenant", "tenant": {"name": "x", "tokens": [{"token": "short"}]}},
            "at least 16 characters",
        ),
        ({"action": "remove_tenant", "name": "nobody"}, "no tenant 'nobody'"),
        ({"action": "reload"}, "not started from a config file"),
    ],
)
def test_a_malformed_change_is_refused_and_changes_nothing(
    kv_server: Start, request_: dict[str, Any], match: str
) -> None:
    server = kv_server(**tenants())

    async def scenario() -> None:
        ops = admin(server)
        before = await ops.tenants()
        action = request_.pop("action")
        with pytest.raises(InvalidInputError, match=match) as info:
            await ops.request(action, **request_)
        assert "\n" not in str(info.value)
        assert await ops.tenants() == before
        async with client(server, A_RW, "team-a") as a:
            await a.ping()

    asyncio.run(scenario())


def test_the_typed_methods_refuse_like_the_sync_ones(kv_server: Start) -> None:
    server = kv_server(**tenants())

    async def scenario() -> None:
        ops = admin(server)
        before = await ops.tenants()
        with pytest.raises(InvalidInputError, match="no tenant 'nobody'"):
            await ops.remove_tenant("nobody")
        with pytest.raises(InvalidInputError, match="not started from a config file"):
            await ops.reload()
        with pytest.raises(InvalidInputError, match="at least 16 characters"):
            await ops.put_tenant("team-x", ["team-x"], [{"name": "x", "token": "short"}])
        assert await ops.tenants() == before

    asyncio.run(scenario())


def test_no_server_is_a_tier_error(kv_server: Start) -> None:
    server = kv_server()
    address = server.address
    server.stop()

    async def scenario() -> None:
        with pytest.raises(TierError, match="cannot connect"):
            await AsyncAdminClient(ClientOptions(address, "team-a")).tenants()

    asyncio.run(scenario())
