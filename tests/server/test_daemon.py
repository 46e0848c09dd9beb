"""kvstore-server end to end: round trips over TCP, a Unix socket and shared memory, from
memory and from disk, many clients at once, and client processes sharing blocks."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from kvstore.client import Client, ClientOptions
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import block_list as blocks_of
from kvstore.testing.data import empty_blocks as empty
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import SlotStatus

Start = Callable[..., ServerThread]
LAYOUT = small_layout()


def address(server: ServerThread, transport: str) -> str:
    return server.address if transport == "tcp" else f"unix:{server.server.addresses['unix']}"


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("shared", [False, True])
def test_round_trip(kv_server: Start, transport: str, shared: bool) -> None:
    server = kv_server()
    with Client(LAYOUT, ClientOptions(address(server, transport), shared_memory=shared)) as c:
        keys, blocks = make_keys(4), blocks_of(LAYOUT, 4, seed=1)
        assert c.put(keys[:3], blocks[:3]) == [True] * 3
        assert c.shared_memory is shared
        outs = empty(LAYOUT, 4)
        assert c.get(keys, outs) == [True, True, True, False]
        assert all(torch.equal(o, b) for o, b in zip(outs[:3], blocks[:3], strict=True))
        assert bool((outs[3] == 0).all())  # a miss leaves its output alone
        ranged = empty(LAYOUT, 3, (1, 3))
        assert c.get(keys[:3], ranged, layers=(1, 3)) == [True] * 3
        assert all(torch.equal(o, b[1:3]) for o, b in zip(ranged, blocks, strict=False))
        assert c.exists(keys) == [True, True, True, False]
        assert c.lookup(keys) == 3
        assert sorted(c.list_keys()) == sorted(keys[:3])
        assert c.delete([keys[0], keys[3]]) == 1
        assert c.exists(keys) == [False, True, True, False]
        moved = "shm_blocks" if shared else "socket_blocks"
        assert c.stats[moved] >= 9


@pytest.mark.parametrize("shared", [False, True])
def test_strided_engine_views_in_and_out(kv_server: Start, shared: bool) -> None:
    server = kv_server()
    kv = random_blocks(LAYOUT, 3, seed=2)
    step = LAYOUT.block_tokens
    views = [kv[:, :, i * step : (i + 1) * step] for i in range(3)]
    assert not views[1].is_contiguous()
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=shared)) as c:
        assert all(c.put(make_keys(3), views))
        out = torch.zeros_like(kv)
        targets = [out[:, :, i * step : (i + 1) * step] for i in range(3)]
        assert c.get(make_keys(3), targets) == [True] * 3
    assert torch.equal(out, kv)


@pytest.mark.parametrize("shared", [False, True])
def test_blocks_only_on_disk_are_served_verified(kv_server: Start, shared: bool) -> None:
    """A host tier of 4 blocks under 24: most come back from the disk tier."""
    host = 4 * LAYOUT.block_nbytes
    server = kv_server(
        tiers=[
            {"kind": "host", "capacity": host, "high_watermark": 1.0, "low_watermark": 0.5},
            {"kind": "disk", "capacity": "64MiB"},
        ]
    )
    keys, blocks = make_keys(24), blocks_of(LAYOUT, 24, seed=3)
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=shared)) as c:
        assert all(c.put(keys, blocks))
        outs = empty(LAYOUT, 24)
        assert all(c.get(keys, outs))
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
        tiers = c.server_stats()["stores"][0]["tiers"]
    assert tiers[0]["blocks"] <= 4 and tiers[1]["blocks"] >= 20


def test_durable_put_is_on_disk_when_acknowledged(kv_server: Start) -> None:
    server = kv_server()
    keys, blocks = make_keys(3), blocks_of(LAYOUT, 3, seed=4)
    with Client(LAYOUT, ClientOptions(server.address)) as c:
        statuses = c.put_statuses(keys, blocks, durable=True)
        assert all(s & SlotStatus.DURABLE for s in statuses)
        assert all(s & 0x7F == SlotStatus.STORED for s in statuses)
        again = c.put_statuses(keys, blocks, durable=True)  # present, and durable
        assert all(s == SlotStatus.PRESENT | SlotStatus.DURABLE for s in again)
    hosted = server.server.registry.hosted()[0]
    disk = hosted.store.engine.datapath.tiers[1]
    assert disk.contains(keys) == [True] * 3


@dataclass
class _Mix:
    """Many clients at once, each a run of random puts, gets, lookups and deletes over one
    key space (``mix``: the shares below which an op is a put, a get, a lookup; above, a
    delete); every block read must be the one its key was written with."""

    server: ServerThread
    truth: dict[bytes, torch.Tensor]
    shared: bool = False
    ops: int = 25
    most: int = 6  # keys an op names at most
    mix: tuple[float, float, float] = (0.4, 0.85, 0.95)
    errors: list[str] = field(default_factory=list)
    slowest: float = 0.0  # the longest op, seconds

    def run(self, clients: int) -> None:
        threads = [threading.Thread(target=self._work, args=(s,)) for s in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert self.errors == []
        assert not any(t.is_alive() for t in threads)

    def _work(self, seed: int) -> None:
        try:
            self._client(seed)
        except Exception as exc:
            self.errors.append(f"client {seed}: {exc!r}")

    def _client(self, seed: int) -> None:
        rng, keys = random.Random(seed), list(self.truth)
        options = ClientOptions(self.server.address, shared_memory=self.shared, timeout=10)
        with Client(LAYOUT, options) as c:
            for _ in range(self.ops):
                pick = rng.sample(keys, rng.randint(1, self.most))
                op, started = rng.random(), time.monotonic()
                if op < self.mix[0]:
                    c.put(pick, [self.truth[k] for k in pick])
                elif op < self.mix[1]:
                    outs = empty(LAYOUT, len(pick))
                    for k, ok, out in zip(pick, c.get(pick, outs), outs, strict=True):
                        if ok and not torch.equal(out, self.truth[k]):
                            self.errors.append(f"client {seed}: wrong bytes for {k.hex()}")
                elif op < self.mix[2]:
                    c.lookup(pick)
                else:
                    c.delete(pick[:1])
                self.slowest = max(self.slowest, time.monotonic() - started)


@pytest.mark.parametrize("shared", [False, True])
def test_many_clients_at_once_byte_exact(kv_server: Start, shared: bool) -> None:
    """32 clients, random put / get / lookup / delete over a shared key space; every
    block read is the one its key was written with."""
    # Two worker threads and a tier that must evict lent blocks: a release that waited
    # for a worker behind evictions waiting for that release would stall everyone.
    server = kv_server(tiers=[{"kind": "host", "capacity": 48 * LAYOUT.block_nbytes}], threads=2)
    keys = make_keys(64, salt=5)
    _Mix(server, dict(zip(keys, blocks_of(LAYOUT, 64, seed=5), strict=True)), shared).run(32)
    manager = server.server.registry.hosted()[0].store.engine.datapath
    deadline = time.monotonic() + 10  # the server ends loans as it sees the clients leave
    while manager.pinned_blocks() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.pinned_blocks() == 0  # every loan and reservation ended


def test_deletes_of_lent_blocks_never_stall_the_gets_that_lent_them(kv_server: Start) -> None:
    """One worker thread, gets, puts and deletes of the same few blocks: a delete waits
    on a worker for the blocks' readers, so a get must never wait for a worker while it
    holds them lent (it did: every such delete stalled the server until the lease
    ended, 30 s)."""
    server = kv_server(tiers=[{"kind": "host", "capacity": 48 * LAYOUT.block_nbytes}], threads=1)
    keys = make_keys(16, salt=6)
    truth = dict(zip(keys, blocks_of(LAYOUT, 16, seed=6), strict=True))
    mix = _Mix(server, truth, ops=80, most=4, mix=(0.4, 0.8, 0.8))
    mix.run(12)
    assert mix.slowest < 8.0  # far below the 30 s lease a stall lasted (seconds on a busy CI)


_PEER = """
import sys, torch
from kvstore.client import Client, ClientOptions
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
layout = small_layout()
kv = random_blocks(layout, 6, seed=11)
step = layout.block_tokens
blocks = [kv[:, :, i * step:(i + 1) * step] for i in range(6)]
with Client(layout, ClientOptions(sys.argv[1], shared_memory=sys.argv[2] == "1")) as c:
    if sys.argv[3] == "put":
        assert all(c.put(make_keys(6, salt=11), blocks))
    else:
        outs = [torch.zeros(layout.block_shape, dtype=layout.dtype) for _ in range(6)]
        assert c.get(make_keys(6, salt=11), outs) == [True] * 6
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    print("shm" if c.shared_memory else "socket")
"""


@pytest.mark.parametrize("shared", [False, True])
def test_two_client_processes_share_blocks(kv_server: Start, shared: bool) -> None:
    server = kv_server()
    flag = "1" if shared else "0"
    for step in ("put", "get"):
        run = subprocess.run(
            [sys.executable, "-c", _PEER, server.address, flag, step],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip() == ("shm" if shared else "socket")
    kv = random_blocks(LAYOUT, 6, seed=11)
    with Client(LAYOUT, ClientOptions(server.address)) as c:
        outs = empty(LAYOUT, 6)
        assert all(c.get(make_keys(6, salt=11), outs))
    assert torch.equal(torch.cat(outs, dim=2), kv)


def test_layouts_and_namespaces_get_stores_of_their_own(kv_server: Start) -> None:
    server = kv_server()
    other = small_layout(num_layers=5)
    keys = make_keys(2)
    with (
        Client(LAYOUT, ClientOptions(server.address, namespace="a")) as a,
        Client(LAYOUT, ClientOptions(server.address, namespace="b")) as b,
        Client(other, ClientOptions(server.address, namespace="a")) as a5,
    ):
        assert all(a.put(keys, blocks_of(LAYOUT, 2, seed=6)))
        assert b.exists(keys) == [False, False]  # another namespace: another store
        assert a5.exists(keys) == [False, False]  # another layout: another store
        assert b.delete(keys) == 0
        assert a.exists(keys) == [True, True]
    labels = sorted(h.label for h in server.server.registry.hosted())
    assert len(labels) == 3 and labels[0].startswith("a/")


def test_store_limit_is_a_clear_error(kv_server: Start) -> None:
    from kvstore.errors import TierError

    server = kv_server(max_stores=1)
    with Client(LAYOUT, ClientOptions(server.address, namespace="one")) as c:
        c.ping()
    with (
        Client(LAYOUT, ClientOptions(server.address, namespace="two")) as c,
        pytest.raises(TierError, match="max_stores"),
    ):
        c.ping()


def test_sent_headers_come_from_puts_and_still_guard_the_bytes(kv_server: Start) -> None:
    """A block put over the socket is sent back with the header its client sent (no
    hashing); one put through shared memory gets its header computed at its first send.
    Either way the receiver checks the bytes: memory damaged after the put is a miss."""
    server = kv_server()
    keys, data = make_keys(2, salt=12), blocks_of(LAYOUT, 2, seed=12)
    with (
        Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as sock,
        Client(LAYOUT, ClientOptions(server.address, shared_memory=True)) as shm,
    ):
        assert sock.put(keys[:1], data[:1]) == [True]
        assert shm.put(keys[1:], data[1:]) == [True] and shm.shared_memory
        hosted = server.server.registry.hosted()[0]
        assert hosted.headers.get(keys[0]) is not None  # the client's header, kept
        assert hosted.headers.get(keys[1]) is None  # written through shared memory
        for _ in range(2):  # computed, then reused
            outs = empty(LAYOUT, 2)
            assert sock.get(keys, outs) == [True, True]
            assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
        assert hosted.headers.get(keys[1]) is not None
        view = hosted.store.engine.datapath.tiers[0].view(keys[0])
        assert view is not None
        view[1].fill_(0.5)  # memory damaged after the put
        out = empty(LAYOUT, 1)
        assert sock.get(keys[:1], out) == [False]
        assert sock.stats["corrupt_retries"] == 1
