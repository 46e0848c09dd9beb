"""Events that converge through a kvstore-server: one publisher for all its stores, two
namespaces written by clients while memory demotes to disk, clients delete, the
subscriber restarts, the server restarts on its disk; afterwards a view built from the
events alone equals what the server's tiers hold."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from convergence_rig import events_config

from kvharness.event_view import EventView, compare, held_media
from kvstore import KVStore, StoreConfig
from kvstore.cli.kvserver import server_test_config
from kvstore.datapath.contracts import Medium
from kvstore.events.blocks import BlockMapper
from kvstore.keys import BlockKey
from kvstore.server import ServerThread
from kvstore.testing.data import random_blocks, small_layout

CHUNK = 32
LAYOUT = small_layout(block_tokens=CHUNK)


@pytest.fixture
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs-conv-", dir="/tmp"))  # short: a Unix socket
    yield path
    shutil.rmtree(path, ignore_errors=True)


def server(work: Path, events: dict[str, object]) -> ServerThread:
    host = {"kind": "host", "capacity": 10 * LAYOUT.block_nbytes}
    data = server_test_config(work, [host, {"kind": "disk"}])
    data["events"] = events
    return ServerThread(StoreConfig.from_dict(data, environ={}))


def client(srv: ServerThread, namespace: str) -> KVStore:
    return KVStore(
        LAYOUT, {"tiers": [{"kind": "remote", "address": srv.address, "namespace": namespace}]}
    )


def truth(srv: ServerThread, events: dict[str, object], announced: set[BlockKey]) -> dict:
    mapper = BlockMapper(CHUNK, StoreConfig.from_dict({"events": events}).events)
    out: dict = {}
    for hosted in srv.server.registry.hosted():
        tiers = hosted.store.engine.datapath.tiers
        out.update(
            held_media([(tiers[0], Medium.MEMORY), (tiers[1], Medium.DISK)], mapper, announced)
        )
    return out


def churn(srv: ServerThread, rng: random.Random, steps: int, announced: set[BlockKey]) -> None:
    """Puts with tokens in two namespaces, deletes, demotions by the server's store."""
    clients = {ns: client(srv, ns) for ns in ("a", "b")}
    try:
        prompts = [[rng.randrange(40_000) for _ in range(6 * CHUNK)] for _ in range(5)]
        for step in range(steps):
            ns = rng.choice("ab")
            tokens = rng.choice(prompts)[: rng.randint(1, 6) * CHUNK]
            keys = clients[ns].hash_tokens(tokens, namespace=ns)
            if rng.random() < 0.8:
                clients[ns].put(keys, random_blocks(LAYOUT, len(keys), seed=step), tokens=tokens)
                announced.update(keys)
            else:
                clients[ns].delete(keys[rng.randrange(len(keys)) :])
    finally:
        for c in clients.values():
            c.close()


def test_a_view_of_a_servers_events_equals_its_tiers_after_restarts(work: Path) -> None:
    events = {**events_config(work), "block_size": CHUNK // 2}
    announced: set[BlockKey] = set()
    rng = random.Random(3)
    view = EventView(str(events["endpoint"]), str(events["replay_endpoint"])).start()
    try:
        with server(work, events) as srv:
            churn(srv, rng, 80, announced)
            view.restart()
            churn(srv, rng, 40, announced)
        with server(work, events) as srv:  # its disk and journal kept: announced again
            churn(srv, rng, 60, announced)
            view.restart()
            churn(srv, rng, 40, announced)
            for hosted in srv.server.registry.hosted():
                hosted.store.flush()
            deadline = time.monotonic() + 20
            while True:
                diff = compare(view.view(), truth(srv, events, announced))
                if diff.none or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert diff.counts() == {"phantom": 0, "missed": 0, "wrong_medium": 0}
            assert {"CPU", "STORAGE"} <= set(view.view().values())
        assert view.stats()["gaps_unfilled"] == 0
    finally:
        view.close()
