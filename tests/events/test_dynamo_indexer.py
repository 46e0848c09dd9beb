"""Dynamo's standalone KV indexer fed by a hand-made vLLM-format publisher.

The events are kvstore's own structs (kvstore.events.format), which encode byte for
byte as vLLM's do (tests/events/test_vllm_decoder.py checks that against vLLM itself).
The publisher is an XPUB socket, on the wire the same as vLLM's PUB, so the test can
wait for the indexer's subscription instead of sleeping through ZMQ's slow joiner. The
rules these tests pin down are in dynamo_indexer.py's docstring.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from dynamo_indexer import DynamoIndexer, WorkerMatch, dynamo_marks

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvstore.events.format import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

pytestmark = dynamo_marks(timeout_s=60)

BLOCK = 16


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    medium: str | None = "GPU",
    block_size: int = BLOCK,
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes: list[int], medium: str | None) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


_bases = itertools.count(1000, 1000)


def tokens(blocks: int) -> list[int]:
    """Fresh token ids (never used by another test) for ``blocks`` whole blocks."""
    base = next(_bases)
    return list(range(base, base + blocks * BLOCK))


class Publisher:
    """vLLM's ZmqEventPublisher, by hand: ``[topic, seq (8 bytes BE), KVEventBatch]``."""

    encoder = msgspec.msgpack.Encoder()

    def __init__(self, ctx: Any) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        assert self.sock.poll(int(timeout * 1000)), "the indexer never subscribed"
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, *events: Any, seq: int | None = None, topic: bytes = b"") -> None:
        self.seq = self.seq if seq is None else seq
        payload = self.encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))
        self.send_raw(payload, topic)

    def send_raw(self, payload: bytes, topic: bytes = b"") -> None:
        self.sock.send_multipart([topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@pytest.fixture
def zctx() -> Iterator[Any]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def indexer() -> Iterator[DynamoIndexer]:
    """One indexer for the module; each test registers its own workers."""
    with DynamoIndexer(block_size=BLOCK) as idx:
        yield idx


_worker_ids = itertools.count(100)


@pytest.fixture
def worker(indexer: DynamoIndexer, zctx: Any) -> Iterator[tuple[int, Publisher]]:
    """A publisher registered over HTTP under a fresh worker id, subscribed."""
    wid = next(_worker_ids)
    pub = Publisher(zctx)
    indexer.register(wid, pub.endpoint)
    pub.wait_subscribed()
    yield wid, pub
    indexer.unregister(wid)


def fence(indexer: DynamoIndexer, wid: int, pub: Publisher, medium: str = "GPU") -> None:
    """Publish a marker block on ``medium``'s tier and wait for it: what was sent before it
    for that tier is applied then (the indexer keeps order within a tier, not across)."""
    toks = tokens(1)
    pub.send(stored([toks[0] + 7_000_000], None, toks, medium=medium))
    indexer.wait_for(toks, wid, lambda m: m.longest_matched == BLOCK)


def test_storage_blocks_count_as_disk_then_removed(zctx: Any) -> None:
    """The publisher bound first, subscribed through --workers at start (the CLI path)."""
    pub = Publisher(zctx)
    toks = tokens(4)
    with DynamoIndexer(block_size=BLOCK, workers={1: pub.endpoint}) as idx:
        pub.wait_subscribed()
        pub.send(stored([11, 12, 13, 14], None, toks, medium="STORAGE"))
        got = idx.wait_for(toks, 1, lambda m: m.longest_matched > 0)
        assert got == WorkerMatch(longest_matched=64, gpu=0, cpu=0, disk=64, dp={0: 0})
        assert set(idx.query(toks)) == {1}
        # A query for more than is stored matches the stored prefix; a tail is ignored.
        assert idx.query([*toks, *tokens(2), 1, 2, 3])[1].disk == 64

        pub.send(removed([13, 14], medium="STORAGE"))
        got = idx.wait_for(toks, 1, lambda m: m.longest_matched < 64)
        assert got == WorkerMatch(longest_matched=32, gpu=0, cpu=0, disk=32, dp={0: 0})


def test_cpu_blocks_count_as_cpu(indexer: DynamoIndexer, worker: tuple[int, Publisher]) -> None:
    wid, pub = worker
    toks = tokens(2)
    pub.send(stored([21, 22], None, toks, medium="CPU"))
    got = indexer.wait_for(toks, wid, lambda m: m.longest_matched > 0)
    # Counts are cumulative: disk continues the CPU prefix.
    assert got == WorkerMatch(longest_matched=32, gpu=0, cpu=32, disk=32, dp={0: 0})


def test_tiers_continue_one_prefix(indexer: DynamoIndexer, worker: tuple[int, Publisher]) -> None:
    wid, pub = worker
    toks = tokens(4)
    pub.send(
        stored([31, 32], None, toks[: 2 * BLOCK], medium="GPU"),
        stored([33], 32, toks[2 * BLOCK : 3 * BLOCK], medium="CPU"),
        stored([34], 33, toks[3 * BLOCK :], medium="STORAGE"),
    )
    got = indexer.wait_for(toks, wid, lambda m: m.longest_matched == 64)
    assert got == WorkerMatch(longest_matched=64, gpu=32, cpu=48, disk=64, dp={0: 32})
    # Evicting the GPU copy of the second block cuts the GPU prefix there; the CPU and
    # disk blocks hang off it, so everything after it goes too.
    pub.send(removed([32], medium="GPU"))
    got = indexer.wait_for(toks, wid, lambda m: m.gpu < 32)
    assert got == WorkerMatch(longest_matched=16, gpu=16, cpu=16, disk=16, dp={0: 16})


def test_medium_none_is_gpu_and_removal_is_per_tier(
    indexer: DynamoIndexer, worker: tuple[int, Publisher]
) -> None:
    wid, pub = worker
    toks = tokens(2)
    pub.send(stored([41, 42], None, toks, medium="STORAGE"))
    got = indexer.wait_for(toks, wid, lambda m: m.disk == 32)
    assert got == WorkerMatch(longest_matched=32, gpu=0, cpu=0, disk=32, dp={0: 0})
    pub.send(stored([41, 42], None, toks, medium=None))
    got = indexer.wait_for(toks, wid, lambda m: m.gpu == 32)
    assert got == WorkerMatch(longest_matched=32, gpu=32, cpu=32, disk=32, dp={0: 32})
    pub.send(removed([41, 42], medium=None))  # from the GPU only
    got = indexer.wait_for(toks, wid, lambda m: m.gpu == 0)
    assert got == WorkerMatch(longest_matched=32, gpu=0, cpu=0, disk=32, dp={0: 0})
    pub.send(AllBlocksCleared())
    indexer.wait_for(toks, wid, lambda m: m.longest_matched == 0)


@pytest.mark.parametrize(
    "case",
    ["unknown_gpu_parent", "lowercase_medium", "unknown_medium", "block_size", "bytes_hashes"],
)
def test_events_the_indexer_drops(
    indexer: DynamoIndexer, worker: tuple[int, Publisher], case: str
) -> None:
    wid, pub = worker
    toks = tokens(2)
    if case == "unknown_gpu_parent":
        pub.send(stored([51, 52], 999, toks))
    elif case == "lowercase_medium":
        pub.send(stored([51, 52], None, toks, medium="storage"))
    elif case == "unknown_medium":
        pub.send(stored([51, 52], None, toks, medium="NVMEOF"))
    elif case == "block_size":  # one 32-token block against the indexer's 16
        pub.send(stored([51], None, toks, block_size=2 * BLOCK))
    else:  # vLLM's bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): the batch fails
        pub.send(stored([b"\x01" * 32, b"\x02" * 32], None, toks))  # type: ignore[list-item]
    fence(indexer, wid, pub)
    assert wid not in indexer.query(toks)


def test_lower_tier_child_waits_for_its_parent(
    indexer: DynamoIndexer, worker: tuple[int, Publisher]
) -> None:
    wid, pub = worker
    toks = tokens(2)
    for medium in ("GPU", "STORAGE"):  # child first, then its parent, on each tier
        pub.send(stored([62], 61, toks[BLOCK:], medium=medium))
        pub.send(stored([61], None, toks[:BLOCK], medium=medium))
    fence(indexer, wid, pub, "GPU")
    fence(indexer, wid, pub, "STORAGE")
    # The GPU child was dropped; the disk one was kept and continues the GPU prefix,
    # because its parent hash is that of the block matched there.
    got = indexer.query(toks)[wid]
    assert got == WorkerMatch(longest_matched=32, gpu=16, cpu=16, disk=32, dp={0: 16})
    # A continuation is found by parent hash: the same tokens under other hashes are not.
    other = tokens(2)
    pub.send(stored([65], None, other[:BLOCK], medium="GPU"))
    pub.send(stored([67], 66, other[BLOCK:], medium="STORAGE"))
    pub.send(stored([66], None, other[:BLOCK], medium="STORAGE"))
    fence(indexer, wid, pub, "GPU")
    fence(indexer, wid, pub, "STORAGE")
    got = indexer.query(other)[wid]
    assert got == WorkerMatch(longest_matched=16, gpu=16, cpu=16, disk=16, dp={0: 16})


def test_stale_sequence_numbers_are_dropped(
    indexer: DynamoIndexer, worker: tuple[int, Publisher]
) -> None:
    wid, pub = worker
    late, stale = tokens(1), tokens(1)
    pub.send(stored([71], None, late), seq=5)  # a first seq above 0 is taken (gap logged)
    indexer.wait_for(late, wid, lambda m: m.gpu == BLOCK)
    pub.send(stored([72], None, stale), seq=3)  # <= the last applied: dropped
    pub.seq = 6  # (seq 4 would be stale too)
    fence(indexer, wid, pub)
    assert wid not in indexer.query(stale)


def test_gap_is_replayed_from_the_router_socket(indexer: DynamoIndexer, zctx: Any) -> None:
    """vLLM's replay protocol: DEALER asks ``[b"", start seq]``, ROUTER answers
    ``[id, b"", topic, seq, batch]`` per batch and ``[id, b"", b"", END, b""]``."""
    pub = Publisher(zctx)
    router = zctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    wid = next(_worker_ids)
    indexer.register(wid, pub.endpoint, replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    pub.wait_subscribed()
    toks = tokens(3)
    missed = [
        KVEventBatch(ts=0.0, events=[stored([81], None, toks[:BLOCK])]),
        KVEventBatch(ts=0.0, events=[stored([82], 81, toks[BLOCK : 2 * BLOCK])]),
    ]
    pub.send(stored([83], 82, toks[2 * BLOCK :]), seq=2)  # seqs 0 and 1 never arrived
    assert router.poll(10_000), "no replay request"
    client, empty, start = router.recv_multipart()
    assert empty == b"" and int.from_bytes(start, "big") == 0
    for seq, batch in enumerate(missed):
        router.send_multipart(
            [client, b"", b"", seq.to_bytes(8, "big"), Publisher.encoder.encode(batch)]
        )
    router.send_multipart([client, b"", b"", (2**64 - 1).to_bytes(8, "big"), b""])
    got = indexer.wait_for(toks, wid, lambda m: m.gpu == 48)
    assert got.longest_matched == 48
    indexer.unregister(wid)
    router.close(linger=0)
