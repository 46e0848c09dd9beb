"""NVIDIA Dynamo's standalone KV indexer, fed only by a kvstore-server's KV events, knows
which prompts the server holds, in which medium, and again after the server restarts."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dynamo_indexer import DynamoIndexer, WorkerMatch, dynamo_marks

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.cli.kvserver import server_test_config
from kvstore.server import ServerThread
from kvstore.testing.data import random_blocks, small_layout

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

pytestmark = dynamo_marks(180)

BLOCK = 16  # tokens per published block, the indexer's --block-size
CHUNK = 32  # tokens per kvstore chunk: two published blocks each
WORKER = 7


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs-dyn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _server(work: Path, ports: tuple[int, int]) -> ServerThread:
    data = server_test_config(work, [{"kind": "host", "capacity": "4MiB"}, {"kind": "disk"}])
    data["events"] = {
        "enabled": True,
        "endpoint": f"tcp://127.0.0.1:{ports[0]}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}",
        "block_size": BLOCK,
        "token_journal": str(work / "tokens"),
    }
    return ServerThread(StoreConfig.from_dict(data, environ={}))


def _client(server: ServerThread, layout: KVLayout) -> KVStore:
    remote = {"kind": "remote", "address": server.address, "namespace": "dyn"}
    return KVStore(layout, {"tiers": [remote]})


def _register(idx: DynamoIndexer, ports: tuple[int, int]) -> None:
    idx.register(
        WORKER,
        f"tcp://127.0.0.1:{ports[0]}",
        replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
    )


def test_the_indexer_sees_prompts_put_through_the_server_demoted_and_deleted(
    work: Path,
) -> None:
    layout = small_layout(block_tokens=CHUNK)
    ports = (_port(), _port())
    tokens = (torch.arange(4 * CHUNK) + 1000).tolist()
    with _server(work, ports) as server, DynamoIndexer(block_size=BLOCK) as idx:
        _register(idx, ports)
        with _client(server, layout) as client:
            keys = client.hash_tokens(tokens, "m")
            client.put(keys, random_blocks(layout, 4), tokens=tokens)
            full = len(tokens)
            got = idx.wait_for(tokens, WORKER, lambda m: m.longest_matched == full)
            # in the server's host memory (the indexer's counts are cumulative: gpu <= cpu
            # <= disk, the prefix matched down to each tier)
            assert (got.gpu, got.cpu) == (0, full)
            (hosted,) = server.server.registry.hosted()
            assert len(hosted.store.evict(4, tier=0)) == 4  # demoted to its disk
            # the indexer applies each medium's events on its own: the host removals can
            # land before the disk stores, so wait for both
            got = idx.wait_for(tokens, WORKER, lambda m: m.cpu == 0 and m.disk == full)
            assert got == WorkerMatch(longest_matched=full, gpu=0, cpu=0, disk=full, dp={0: 0})
            client.delete(keys[2:])
            got = idx.wait_for(tokens, WORKER, lambda m: m.longest_matched == 2 * CHUNK)
            assert got.disk == 2 * CHUNK
            client.delete(keys)
            idx.wait_for(tokens, WORKER, lambda m: m.longest_matched == 0)


def test_after_a_server_restart_the_indexer_learns_what_its_disk_kept(work: Path) -> None:
    """The restarted server numbers its batches above the old ones (the indexer drops
    older sequences), clears the worker, and announces its disk's blocks with the tokens
    of its journal once the store opens."""
    layout = small_layout(block_tokens=CHUNK)
    ports = (_port(), _port())
    tokens = (torch.arange(3 * CHUNK) + 5000).tolist()
    other = (torch.arange(CHUNK) + 9000).tolist()
    with DynamoIndexer(block_size=BLOCK) as idx:
        with _server(work, ports) as server:
            _register(idx, ports)
            with _client(server, layout) as client:
                keys = client.hash_tokens(tokens, "m")
                client.put(keys, random_blocks(layout, 3), tokens=tokens)
                idx.wait_for(tokens, WORKER, lambda m: m.cpu == len(tokens))
        with _server(work, ports) as server, _client(server, layout) as client:
            # a put opens the store: its disk's blocks are announced, then the new one
            more = client.hash_tokens(other, "m")
            client.put(more, random_blocks(layout, 1, seed=1), tokens=other)
            idx.wait_for(other, WORKER, lambda m: m.cpu == CHUNK)
            got = idx.wait_for(tokens, WORKER, lambda m: m.longest_matched == len(tokens))
            assert (got.cpu, got.disk) == (0, len(tokens))  # flushed to disk at shutdown
