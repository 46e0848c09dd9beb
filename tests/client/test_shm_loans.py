"""A GET through shared memory is a loan of the server's slots that ends after the
store's ``lease_s``; an ended loan's slot may hold another block at once. A client that
copies out too late (a thread starved of CPU) must get a miss, never those bytes."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import kvstore.client.sync as client_sync
from kvstore.client import Client, ClientOptions
from kvstore.config import StoreConfig
from kvstore.copies.base import CopyEngine
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import block_list, empty_blocks, small_layout
from kvstore.testing.kvserver import server_test_config

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
    """The real engine, except that this thread's first copy out of shared memory
    waits until ``resume`` is set (after telling ``lent``): a starved client thread."""

    def __init__(self, real: CopyEngine, thread: threading.Thread) -> None:
        self.real, self.thread = real, thread
        self.lent, self.resume = threading.Event(), threading.Event()

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if pairs and threading.current_thread() is self.thread and not self.lent.is_set():
            self.lent.set()
            assert self.resume.wait(30)
        self.real.copy_all(pairs)

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
        stall = _StalledOnce(client_sync.engine_for("cpu"), threading.current_thread())
        monkeypatch.setattr(client_sync, "engine_for", lambda device: stall)

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
