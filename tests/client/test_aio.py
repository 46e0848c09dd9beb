"""The asyncio client against a real server: the same operations, auth, outages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from kvstore.client import AsyncClient, ClientOptions
from kvstore.errors import AccessDeniedError, InvalidInputError, TierError
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
TOKEN = "async-token-0123456789abcdef"


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step] for i in range(n)]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_round_trip(kv_server: Start, transport: str) -> None:
    server = kv_server()
    address = server.address if transport == "tcp" else f"unix:{server.server.addresses['unix']}"

    async def scenario() -> None:
        keys, data = make_keys(4), blocks(4, seed=1)
        async with AsyncClient(LAYOUT, ClientOptions(address)) as c:
            assert await c.put(keys[:3], data[:3]) == [True] * 3
            outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
            assert await c.get(keys, outs) == [True, True, True, False]
            assert all(torch.equal(o, d) for o, d in zip(outs[:3], data[:3], strict=True))
            layer = [torch.zeros((1, *LAYOUT.block_shape[1:]), dtype=LAYOUT.dtype)]
            assert await c.get(keys[:1], layer, layers=(2, 3)) == [True]
            assert torch.equal(layer[0], data[0][2:3])
            assert await c.exists(keys) == [True, True, True, False]
            assert await c.lookup(keys) == 3
            assert sorted(await c.list_keys()) == sorted(keys[:3])
            assert await c.delete(keys) == 3
            await c.ping()
            assert (await c.server_stats())["stores"][0]["blocks"] == 0

    asyncio.run(scenario())


def test_hints(kv_server: Start) -> None:
    server = kv_server()

    async def scenario() -> None:
        keys = make_keys(3)
        async with AsyncClient(LAYOUT, ClientOptions(server.address)) as c:
            assert await c.put(keys, blocks(3, seed=3)) == [True] * 3
            answer = await c.hint(keys, session="agent", retain_s=30, priority=1)
            assert (answer.status, answer.blocks, answer.retain_s) == ("accepted", 3, 30.0)
            answer = await c.hint(session="agent", demote=True)
            assert (answer.status, answer.demoted) == ("accepted", 3)
            answer = await c.hint(session="agent", prefetch=True)
            # the demotion runs in the background: some blocks may be in memory still
            assert answer.status == "accepted" and 0 <= answer.prefetching <= 3
            assert "unknown session" in (await c.hint(session="other", prefetch=True)).reason
            with pytest.raises(InvalidInputError, match="priority"):
                await c.hint(keys, priority=101)
            with pytest.raises(InvalidInputError, match="keys, a session"):
                await c.hint()
            assert (await c.server_stats())["server"]["requests"]["hint"] == 4

    asyncio.run(scenario())


def test_concurrent_requests_share_the_pool(kv_server: Start) -> None:
    server = kv_server()

    async def scenario() -> None:
        async with AsyncClient(LAYOUT, ClientOptions(server.address, pool_size=3)) as c:
            data = blocks(16, seed=2)
            keys = make_keys(16)
            await asyncio.gather(*(c.put([k], [d]) for k, d in zip(keys, data, strict=True)))
            outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
            results = await asyncio.gather(
                *(c.get([k], [o]) for k, o in zip(keys, outs, strict=True))
            )
            assert all(r == [True] for r in results)
            assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))

    asyncio.run(scenario())


def test_tokens_and_outages(kv_server: Start) -> None:
    server = kv_server(token=TOKEN)

    async def scenario() -> None:
        async with AsyncClient(LAYOUT, ClientOptions(server.address)) as c:
            with pytest.raises(AccessDeniedError, match="requires a token"):
                await c.ping()
        async with AsyncClient(LAYOUT, ClientOptions(server.address, token=TOKEN.encode())) as c:
            await c.ping()
            await asyncio.to_thread(server.stop)
            with pytest.raises(TierError):
                await c.ping()
            with pytest.raises(TierError, match="unavailable"):
                await c.ping()  # the breaker answers at once until the next probe

    asyncio.run(scenario())
