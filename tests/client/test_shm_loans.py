"""A GET through shared memory is a loan of the server's slots that ends after the
store's ``lease_s``; an ended loan's slot may hold another block at once. A client that
copies out too late (a thread starved of CPU) must get a miss, never those bytes."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import kvstore.client.sync as client_sync
from kvstore.cli.kvserver import server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.config import StoreConfig
from kvstore.copies.base import CopyEngine
from kvstore.errors import KVStoreError
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import block_list, empty_blocks, small_layout

LAYOUT = small_layout()
LEASE_S = 0.3
SLOTS = 8


@pytest.fixture
def server() -> Iterator[ServerThread]:
    """A server whose only tier holds ``SLOTS`` blocks, lending them for ``LEASE_S``."""
    work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    config = server_test_config(work, [{"kind": "host", "capacity": SLOTS * LAYOUT.block_nbytes}])
    config["lease_s"] = LEASE_S
    thread = ServerThread(StoreConfig.from_dict(config, environ={})).start()
    yield thread
    thread.stop()
    shutil.rmtree(work, ignore_errors=True)


class _StalledOnce:
    """A real copy (``real``, whose argument ``pairs_at`` is its pairs), except that this
    thread's first one waits until ``resume`` is set (after telling ``lent``): a starved
    client thread."""

    def __init__(self, real: Callable[..., None], thread: threading.Thread, pairs_at: int) -> None:
        self.real, self.thread, self.pairs_at = real, thread, pairs_at
        self.lent, self.resume = threading.Event(), threading.Event()

    def __call__(self, *args: Any) -> None:
        mine = threading.current_thread() is self.thread
        if args[self.pairs_at] and mine and not self.lent.is_set():
            self.lent.set()
            assert self.resume.wait(30)
        self.real(*args)


class _StalledEngine:
    """The real copy engine, its ``copy_all`` stalled once (:class:`_StalledOnce`)."""

    def __init__(self, real: CopyEngine, thread: threading.Thread) -> None:
        self.real = real
        self.copy_all = self.stall = _StalledOnce(real.copy_all, thread, 0)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def test_a_copy_out_after_the_loan_ended_is_a_miss_not_another_blocks_bytes(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = ClientOptions(server.address, shared_memory=True, timeout=10)
    mine, theirs = make_keys(4, salt=1), make_keys(SLOTS, salt=2)
    truth = dict(zip(mine, block_list(LAYOUT, 4, seed=1), strict=True))
    with Client(LAYOUT, options) as reader, Client(LAYOUT, options) as writer:
        assert reader.put(mine, [truth[k] for k in mine]) == [True] * 4
        assert reader.shared_memory
        stall = _StalledOnce(client_sync.copy_from_shm, threading.current_thread(), 2)
        monkeypatch.setattr(client_sync, "copy_from_shm", stall)

        def overwrite() -> None:
            assert stall.lent.wait(30)
            time.sleep(LEASE_S * 1.5)  # the loan ends; its slots are free to take
            try:
                assert writer.put(theirs, block_list(LAYOUT, SLOTS, seed=2)) == [True] * SLOTS
                assert not any(writer.exists(mine))  # mine were evicted: slots reused
            finally:
                stall.resume.set()

        helper = threading.Thread(target=overwrite)
        helper.start()
        outs = empty_blocks(LAYOUT, 4)
        found = reader.get(mine, outs)
        helper.join(30)
        assert stall.resume.is_set()
        assert reader.stats["shm_late"] == 4
        assert found == [False] * 4  # asked again: gone, so a miss
        assert reader.get(theirs, empty_blocks(LAYOUT, SLOTS)) == [True] * SLOTS


def test_a_copy_out_within_the_loan_is_not_asked_again(server: ServerThread) -> None:
    options = ClientOptions(server.address, shared_memory=True)
    keys, blocks = make_keys(4, salt=3), block_list(LAYOUT, 4, seed=3)
    with Client(LAYOUT, options) as c:
        assert c.put(keys, blocks) == [True] * 4
        outs = empty_blocks(LAYOUT, 4)
        assert c.get(keys, outs) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(outs, blocks, strict=True))
        assert c.stats["shm_late"] == 0 and c.stats["shm_blocks"] >= 4


# -- reservations: the other direction ------------------------------------------------
IDLE_S = 0.4
HOLD_S = 1.5


@pytest.fixture
def small_server() -> Iterator[Callable[..., ServerThread]]:
    """``small_server(**server)``: a server of ``SLOTS`` host slots with those
    ``server:`` settings; stopped at the end."""
    work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    started: list[ServerThread] = []

    def start(**server: Any) -> ServerThread:
        tiers = [{"kind": "host", "capacity": SLOTS * LAYOUT.block_nbytes}]
        config = server_test_config(work, tiers, **server)
        started.append(ServerThread(StoreConfig.from_dict(config, environ={})).start())
        return started[-1]

    yield start
    for thread in started:
        thread.stop()
    shutil.rmtree(work, ignore_errors=True)


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_write_into_reserved_slots_after_the_connection_closed_changes_no_other_block(
    small_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client thread frozen mid-copy past ``idle_timeout_s``: the server closes its
    connection. Its slots used to go back at once, to the next blocks put; the thread's
    copy, when it woke, then changed those blocks' bytes, and every read of them was a
    hit with the frozen client's bytes (before the fix: 8 hits, 4 wrong). They are held
    now, and nothing else is touched."""
    idle_server = small_server(idle_timeout_s=IDLE_S, reservation_hold_s=HOLD_S)
    options = ClientOptions(idle_server.address, shared_memory=True, timeout=10)
    mine, theirs = make_keys(4, salt=5), make_keys(SLOTS, salt=6)
    truth = dict(zip(theirs, block_list(LAYOUT, SLOTS, seed=6), strict=True))
    with Client(LAYOUT, options) as frozen, Client(LAYOUT, options) as other:
        assert frozen.put(make_keys(1, salt=9), block_list(LAYOUT, 1, seed=9)) == [True]
        assert frozen.shared_memory
        engine = _StalledEngine(client_sync.engine_for("cpu"), threading.current_thread())
        stall = engine.stall
        monkeypatch.setattr(client_sync, "engine_for", lambda device: engine)
        stored: list[bool] = []

        def overwrite() -> None:
            assert stall.lent.wait(30)
            time.sleep(IDLE_S * 3)  # the server closes the frozen client's connection
            try:
                stored.extend(other.put(theirs, [truth[k] for k in theirs]))
            finally:
                stall.resume.set()

        helper = threading.Thread(target=overwrite)
        helper.start()
        with contextlib.suppress(KVStoreError):  # its connection is gone: not stored
            assert frozen.put(mine, block_list(LAYOUT, 4, seed=5)) == [False] * 4
        helper.join(30)
        assert stall.resume.is_set()
        kept = [k for k, ok in zip(theirs, stored, strict=True) if ok]
        outs = empty_blocks(LAYOUT, len(kept))
        assert other.get(kept, outs) == [True] * len(kept)
        assert all(torch.equal(o, truth[k]) for o, k in zip(outs, kept, strict=True))
        assert 0 < len(kept) <= SLOTS - 4  # the frozen client's 4 slots were not handed out
        stats = idle_server.stats()
        assert stats["reservations_held"] == 1
        # Its process lives and will never COMMIT on that connection: held for HOLD_S.
        assert _wait_for(lambda: idle_server.stats()["reservations_held"] == 0)
        assert other.put(theirs, [truth[k] for k in theirs]).count(True) == SLOTS


def test_a_reservation_answered_too_late_to_write_is_not_written(
    small_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread starved between RESERVE and its reply: past 0.9 of the server's
    ``reserve_s`` it writes nothing (the reservation may be dropped, its slots given to
    other blocks); its COMMIT of nothing gives them back."""
    reserve_s = 0.3
    server = small_server(io_timeout_s=reserve_s)
    options = ClientOptions(server.address, shared_memory=True, timeout=10)
    keys = make_keys(2, salt=7)
    with Client(LAYOUT, options) as c:
        assert c.put(make_keys(1, salt=8), block_list(LAYOUT, 1, seed=8)) == [True]
        real = client_sync.decode_reserve_reply

        def late(meta: bytes, count: int) -> tuple[int, list[tuple[int, int]]]:
            time.sleep(reserve_s)  # past 0.9 of it
            return real(meta, count)

        monkeypatch.setattr(client_sync, "decode_reserve_reply", late)
        assert c.put(keys, block_list(LAYOUT, 2, seed=7)) == [False, False]
        monkeypatch.undo()
        assert c.stats["shm_late"] == 2
        assert not any(c.exists(keys))
        # The COMMIT of nothing gave the reservation back (committed or dropped and
        # released): nothing stays reserved.
        assert _wait_for(lambda: server.stats().get("reservations_held", 0) == 0)
        assert c.put(keys, block_list(LAYOUT, 2, seed=7)) == [True, True]
