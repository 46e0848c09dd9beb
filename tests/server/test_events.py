"""A kvstore-server's KV events: what clients put (with their tokens), demote, delete and
clear, published once for every hosted store, and learned again after a restart."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import InvalidInputError, KVLayout, KVStore, StoreConfig
from kvstore.cli.kvserver import server_test_config
from kvstore.keys import ChunkTokens
from kvstore.server import ServerThread
from kvstore.testing.data import random_blocks, small_layout

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvstore.events.format import BlockRemoved, BlockStored, decode_batch  # noqa: E402


class Sub:
    """A SUB socket on the server's events endpoint."""

    def __init__(self, ctx: Any, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def events(self, want: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
        """Events received until ``want(events)`` holds."""
        got: list[Any] = []
        while not want(got):
            if not self.sock.poll(int(timeout * 1000)):
                raise AssertionError(f"timed out; received {got!r}")
            _, _, payload = self.sock.recv_multipart()
            got += decode_batch(payload).events
        return got


@pytest.fixture
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs-ev-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def zctx() -> Iterator[Any]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _server(work: Path, journal: bool = False) -> ServerThread:
    data = server_test_config(work, [{"kind": "host", "capacity": "1MiB"}, {"kind": "disk"}])
    data["events"] = {
        "enabled": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "block_size": 16,
        "interval_s": 0.005,
        **({"token_journal": str(work / "tokens")} if journal else {}),
    }
    return ServerThread(StoreConfig.from_dict(data, environ={}))  # started by `with`


def _client(server: ServerThread, layout: KVLayout) -> KVStore:
    remote = {"kind": "remote", "address": server.address, "namespace": "ev"}
    return KVStore(layout, {"tiers": [remote]})


def _stored_tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]


def _joined(sub: Sub, client: KVStore, layout: KVLayout) -> None:
    """Put throw-away chunks until the subscriber sees events (ZMQ's slow joiner)."""
    for i in range(200):
        tokens = torch.full((layout.block_tokens,), 10_000 + i)
        keys = client.hash_tokens(tokens, "join")
        client.put(keys, random_blocks(layout, 1), tokens=tokens)
        try:
            sub.events(lambda got: bool(got), timeout=0.1)
            return
        except AssertionError:
            continue
    raise AssertionError("the subscriber never joined")


def test_clients_puts_with_tokens_and_deletes_are_published(work: Path, zctx: Any) -> None:
    layout = small_layout(block_tokens=32)
    with _server(work) as server:
        sub = Sub(zctx, server.server.addresses["events"])
        with _client(server, layout) as client:
            _joined(sub, client, layout)
            tokens = torch.arange(3 * layout.block_tokens)
            keys = client.hash_tokens(tokens, "m")
            client.put(keys[:1], random_blocks(layout, 1), tokens=tokens[: layout.block_tokens])
            client.put(
                keys[1:],
                random_blocks(layout, 2),
                tokens=tokens[layout.block_tokens :],
                parent=keys[0],
            )
            got = sub.events(lambda ev: len(_stored_tokens(ev)) >= len(tokens))
            stored = [e for e in got if isinstance(e, BlockStored)]
            assert _stored_tokens(stored) == tokens.tolist()
            assert stored[0].parent_block_hash is None
            for up, down in itertools.pairwise(stored):
                assert down.parent_block_hash == up.block_hashes[-1]  # one chain, in order
            assert {e.medium for e in stored} == {"CPU"}
            client.delete(keys[2:])
            gone = sub.events(lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
            removed = [e for e in gone if isinstance(e, BlockRemoved)]
            assert removed[0].block_hashes == stored[-1].block_hashes


def test_tokens_that_do_not_cover_the_chunks_are_refused_and_nothing_is_stored(
    work: Path,
) -> None:
    layout = small_layout(block_tokens=32)
    with _server(work) as server, _client(server, layout) as client:
        tokens = torch.arange(2 * layout.block_tokens)
        keys = client.hash_tokens(tokens, "m")
        with pytest.raises(InvalidInputError, match="token ids"):
            client.put(keys, random_blocks(layout, 2), tokens=tokens[:-1])
        with pytest.raises(InvalidInputError, match="parent"):
            client.put(keys, random_blocks(layout, 2), parent=keys[0])
        with pytest.raises(InvalidInputError):
            ChunkTokens.of(keys, tokens, b"short", layout.block_tokens)
        assert client.lookup(keys, recheck=True) == 0
        assert all(s["blocks"] == 0 for s in server.server.registry.stats())


def test_a_restarted_server_announces_what_its_disk_kept_to_a_late_subscriber(
    work: Path, zctx: Any
) -> None:
    """The token journal keeps the tokens; the restarted store announces its disk's blocks
    when it opens, and a subscriber that asks the replay socket from 0 gets them."""
    layout = small_layout(block_tokens=32)
    tokens = torch.arange(2 * layout.block_tokens)
    with _server(work, journal=True) as server, _client(server, layout) as client:
        keys = client.hash_tokens(tokens, "m")
        client.put(keys, random_blocks(layout, 2), tokens=tokens)
    with _server(work, journal=True) as server, _client(server, layout) as client:
        assert client.lookup(keys) == 2  # opens the store: it reads its disk and journal
        replay = zctx.socket(zmq.DEALER)
        replay.connect(server.server.addresses["events_replay"])
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[Any] = []
        while replay.poll(10_000):
            frames = replay.recv_multipart()
            if frames[-1] == b"":
                break
            events += decode_batch(frames[-1]).events
        replay.close(linger=0)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert _stored_tokens(stored) == tokens.tolist()
        assert {e.medium for e in stored} == {"STORAGE"}  # on disk after the restart
