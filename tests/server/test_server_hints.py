"""Session hints through kvstore-server (op HINT): retain, demote and prefetch a session's
blocks on the namespace's store; malformed hints are answered ``rejected`` and change
nothing; the clients check hints before sending them."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore.client import Client, ClientOptions
from kvstore.errors import InvalidInputError
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import Op, Status, decode_json, encode_hint_request, encode_keys

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
TOKEN = "hint-token-0123456789abcdef"


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def hosted_store(server: ServerThread, namespace: str = "default") -> Any:
    return next(h.store for h in server.server.registry.hosted() if h.namespace == namespace)


def in_memory(store: Any, keys: list[bytes]) -> int:
    return sum(0 in store.engine.datapath.where(k) for k in keys)


def fields(**over: Any) -> dict[str, Any]:
    return {"retain_s": None, "priority": 0, "prefetch": False, "demote": False, **over}


def test_retain_demote_and_prefetch_a_session(kv_server: Start) -> None:
    server = kv_server()
    agent, other = make_keys(4, salt=1), make_keys(2, salt=2)
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as c:
        assert all(c.put(agent, blocks(4, seed=1)))
        answer = c.hint(agent, session="agent-7", retain_s=60, priority=5)
        assert (answer.status, answer.blocks, answer.retain_s) == ("accepted", 4, 60.0)
        store = hosted_store(server)
        assert len(store.engine.datapath.retention) == 4

        answer = c.hint(session="agent-7", demote=True)  # the session went idle
        assert (answer.status, answer.blocks, answer.demoted) == ("accepted", 4, 4)
        store.drain(5.0)  # demotions run in the background
        assert in_memory(store, agent) == 0 and c.exists(agent) == [True] * 4

        answer = c.hint(session="agent-7", prefetch=True)  # its next turn is near
        assert (answer.status, answer.blocks, answer.prefetching) == ("accepted", 4, 4)
        store.drain()
        assert in_memory(store, agent) == 4

        answer = c.hint(session="agent-8", retain_s=5)
        assert answer.status == "rejected" and "unknown session 'agent-8'" in answer.reason
        assert c.hint(other, retain_s=5).status == "rejected"  # none of them stored
        answer = c.hint([*agent[:2], *other], retain_s=5)  # the server clips what it lacks
        assert (answer.status, answer.blocks) == ("clipped", 2)
        assert "2 of 4 blocks are not stored" in answer.reason

        stats = c.server_stats()
        assert stats["server"]["requests"]["hint"] == 6
        assert stats["server"]["hints_accepted"] == 3
        assert stats["server"]["hints_rejected"] == 2
        assert stats["server"]["hints_clipped"] == 1
        assert stats["stores"][0]["hints"]["hints_accepted"] == 3


def test_retained_blocks_stay_in_the_servers_memory_under_pressure(kv_server: Start) -> None:
    host = {"kind": "host", "capacity": 8 * LAYOUT.block_nbytes}
    host.update(high_watermark=1.0, low_watermark=0.99)
    server = kv_server(tiers=[host, {"kind": "disk", "capacity": "16MiB"}])
    agent = make_keys(4, salt=1)
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as c:
        assert all(c.put(agent, blocks(4, seed=1)))
        assert c.hint(agent, retain_s=60, priority=5).status == "accepted"
        for seed in range(2, 6):  # a flood of other prompts through an 8-block memory tier
            assert all(c.put(make_keys(4, salt=seed), blocks(4, seed=seed)))
    store = hosted_store(server)
    store.drain()
    assert in_memory(store, agent) == 4
    assert in_memory(store, make_keys(4, salt=2)) == 0


def test_malformed_hints_are_rejected_and_change_nothing(kv_server: Start, raw: Any) -> None:
    server = kv_server()
    keys = make_keys(2)
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as c:
        assert all(c.put(keys, blocks(2, seed=1)))
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    malformed = [
        (fields(priority=1000, session="s"), keys, "priority"),
        (fields(bogus=1, session="s"), keys, "unknown hint key 'bogus'"),
        (fields(prefetch=True, demote=True, session="s"), keys, "contradict"),
        (fields(retain_s=-1, session="s"), keys, "retain_s"),
        (fields(retain_s="60", session="s"), keys, "retain_s"),
        (fields(session=""), keys, "session"),
        (fields(retain_s=5), None, "give keys, a session, or both"),
    ]
    for body, hinted, why in malformed:
        frame, meta, _ = conn.call(Op.HINT, encode_hint_request(body, hinted))
        assert frame.status == Status.OK, meta
        answer = decode_json(meta)
        assert answer["status"] == "rejected" and why in answer["reason"], answer
        assert answer["blocks"] == 0
    # NaN and Infinity are JSON to Python's parser: refused all the same
    nan = b'{"retain_s": NaN, "session": "s"}'
    frame, meta, _ = conn.call(
        Op.HINT, struct.pack("<I", len(nan)) + nan + b"\x01" + encode_keys(keys)
    )
    assert frame.status == Status.OK and decode_json(meta)["status"] == "rejected"
    # metas that do not decode are BAD_REQUEST, like any op's; the connection goes on
    body = json.dumps(fields(retain_s=5)).encode()
    for bad in (
        b"",
        struct.pack("<I", 500) + body,  # a JSON length past the meta
        struct.pack("<I", 3) + b"[1]" + b"\x00",  # not an object
        struct.pack("<I", len(body)) + body + b"\x02",  # a bad keys flag
        struct.pack("<I", len(body)) + body + b"\x01" + encode_keys(keys)[:-1],
        struct.pack("<I", len(body)) + body + b"\x00junk",
    ):
        frame, meta, _ = conn.call(Op.HINT, bad)
        assert frame.status == Status.BAD_REQUEST, (bad, meta)
    assert conn.call(Op.PING)[0].status == Status.OK
    store = hosted_store(server)
    assert len(store.engine.datapath.retention) == 0  # nothing was retained
    frame, meta, _ = conn.call(Op.HINT, encode_hint_request(fields(retain_s=5, session="s"), None))
    assert "unknown session 's'" in decode_json(meta)["reason"]  # nor remembered
    frame, meta, _ = conn.call(Op.HINT, encode_hint_request(fields(retain_s=5), keys))
    assert decode_json(meta)["status"] == "accepted"  # the same connection serves good hints
    stats = server.stats()
    assert stats["requests"]["hint"] == len(malformed) + 1 + 6 + 2
    assert stats["errors"]["bad_request"] == 6
    assert stats["hints_rejected"] == len(malformed) + 1 + 1


def test_hint_follows_the_handshake_and_stays_in_its_namespace(kv_server: Start, raw: Any) -> None:
    server = kv_server(token=TOKEN)
    meta = encode_hint_request(fields(retain_s=5), make_keys(1))
    conn = raw(server.address)
    conn.handshake()
    assert conn.call(Op.HINT, meta)[0].status == Status.UNAUTHENTICATED
    assert conn.closed_by_server()
    conn = raw(server.address)
    conn.handshake(token=TOKEN.encode())
    assert conn.call(Op.HINT, meta)[0].status == Status.NOT_OPEN
    assert conn.closed_by_server()

    keys = make_keys(2)

    def client(namespace: str) -> Client:
        return Client(LAYOUT, ClientOptions(server.address, namespace, TOKEN.encode()))

    with client("team-a") as a, client("team-b") as b:
        assert all(a.put(keys, blocks(2, seed=1)))
        assert a.hint(keys, session="s", retain_s=30).status == "accepted"
        assert b.hint(keys, retain_s=30).status == "rejected"  # not stored in team-b
        assert "unknown session" in b.hint(session="s", demote=True).reason
        assert len(hosted_store(server, "team-a").engine.datapath.retention) == 2
        assert len(hosted_store(server, "team-b").engine.datapath.retention) == 0


def test_the_client_checks_hints_before_sending(kv_server: Start) -> None:
    server = kv_server(max_batch_blocks=8)
    keys = make_keys(2)
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as c:
        with pytest.raises(InvalidInputError, match=r"at most 8\)"):
            c.hint(make_keys(9), retain_s=5)  # the server's limit, before it is known
        for args, kw in [
            ((keys,), {"priority": 1000}),
            ((keys,), {"priority": True}),
            ((keys,), {"retain_s": float("nan")}),
            ((keys,), {"retain_s": -1}),
            ((keys,), {"prefetch": True, "demote": True}),
            ((keys,), {"session": ""}),
            ((), {"retain_s": 5}),
            (([b"short"],), {"retain_s": 5}),
            ((b"0" * 16,), {"retain_s": 5}),
        ]:
            with pytest.raises(InvalidInputError):
                c.hint(*args, **kw)
        sent = c.server_stats()["server"]["requests"].get("hint", 0)
        with pytest.raises(InvalidInputError, match="at most 8"):
            c.hint(make_keys(9), retain_s=5)  # the limit, now known: not sent
        assert c.server_stats()["server"]["requests"].get("hint", 0) == sent == 1
        assert c.hint(keys, retain_s=5).status == "rejected"  # well formed, nothing stored


def test_a_store_passes_its_hints_to_the_server_behind_it(kv_server: Start) -> None:
    """A store over a remote tier: its hint retains the blocks in the server's store too
    (the server evicts by its own rules, so the client's retention alone would not hold
    them there)."""
    from kvstore import KVStore

    server = kv_server()
    keys = make_keys(3, salt=7)
    config = {"tiers": [{"kind": "remote", "address": server.address, "shared_memory": False}]}
    with KVStore(LAYOUT, config) as store:
        kv = random_blocks(LAYOUT, 3, seed=7)
        assert store.put(keys, kv) == 3
        answer = store.hint(keys, retain_s=60, priority=4)
        assert (answer.status, answer.blocks) == ("accepted", 3)
        assert len(hosted_store(server).engine.datapath.retention) == 3
