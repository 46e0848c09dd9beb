"""A real kvstore-server process stopped mid-load: SIGTERM drains and flushes, kill -9 loses
nothing acknowledged as durable, and a restart finds the blocks on disk, verified."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.client import Client, ClientOptions
from kvstore.errors import KVStoreError
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import SlotStatus

LAYOUT = small_layout(num_layers=4, head_dim=64, block_tokens=64)  # 64 KiB blocks
BATCH = 8


def batch(i: int) -> tuple[list[bytes], list[torch.Tensor]]:
    kv = random_blocks(LAYOUT, BATCH, seed=1000 + i)
    step = LAYOUT.block_tokens
    return make_keys(BATCH, salt=i), [kv[:, :, j * step : (j + 1) * step] for j in range(BATCH)]


class Loader:
    """Puts batches until told to stop or the server goes away; records what was acked."""

    def __init__(self, address: str, durable: bool) -> None:
        self.client = Client(LAYOUT, ClientOptions(address, timeout=5, connect_timeout=1))
        self.durable = durable
        self.acked: dict[int, list[bool]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            keys, blocks = batch(i)
            try:
                statuses = self.client.put_statuses(keys, blocks, durable=self.durable)
            except KVStoreError:
                return  # the server went away
            want = SlotStatus.DURABLE if self.durable else 0x7F
            self.acked[i] = [bool(s & want) and s & 0x7F == SlotStatus.STORED for s in statuses]
            i += 1

    def __enter__(self) -> Loader:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.client.close()


def verify_all(address: str, acked: dict[int, list[bool]]) -> int:
    """Read back every acknowledged block; return how many there were."""
    checked = 0
    with Client(LAYOUT, ClientOptions(address)) as c:
        for i, flags in acked.items():
            keys, blocks = batch(i)
            wanted = [j for j, ok in enumerate(flags) if ok]
            outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in wanted]
            got = c.get([keys[j] for j in wanted], outs)
            assert got == [True] * len(wanted), f"batch {i}: acknowledged blocks lost"
            for j, out in zip(wanted, outs, strict=True):
                assert torch.equal(out, blocks[j]), f"batch {i} block {j}: wrong bytes"
            checked += len(wanted)
    return checked


def config(tmp_path: Path) -> dict[str, object]:
    return {
        "tiers": [
            {"kind": "host", "capacity": "64MiB"},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
        ],
        "server": {"drain_timeout_s": 10},
    }


def test_sigterm_mid_load_drains_flushes_and_a_restart_finds_everything(tmp_path: Path) -> None:
    with KVStoreServerProcess(config(tmp_path), tmp_path / "work") as server:
        with Loader(server.address, durable=False) as loader:
            time.sleep(1.5)
            assert server.stop() == 0  # drained and flushed, a clean exit
        assert len(loader.acked) >= 3, server.log_tail()
        assert "kvstore-server stopped" in server.log_tail()
        server.start()
        assert verify_all(server.address, loader.acked) >= 3 * BATCH


def test_kill_9_mid_load_loses_nothing_acknowledged_as_durable(tmp_path: Path) -> None:
    with KVStoreServerProcess(config(tmp_path), tmp_path / "work") as server:
        with Loader(server.address, durable=True) as loader:
            time.sleep(1.5)
            server.kill()
        assert len(loader.acked) >= 3, server.log_tail()
        server.start()
        assert verify_all(server.address, loader.acked) >= 3 * BATCH
        with Client(LAYOUT, ClientOptions(server.address)) as c:
            disk = c.server_stats()["stores"][0]["tiers"][1]
        assert disk["kind"] == "disk" and disk["blocks"] >= 3 * BATCH


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("shared", [False, True])
def test_a_client_reconnects_by_itself_after_a_restart(
    tmp_path: Path, signal_name: str, shared: bool
) -> None:
    """Also through shared memory: the restarted server's segment is a new one, and
    the client maps it instead of reading the dead server's memory."""
    with KVStoreServerProcess(config(tmp_path), tmp_path / "work") as server:
        options = ClientOptions(
            server.address, shared_memory=shared, retry_interval=0.2, connect_timeout=1
        )
        with Client(LAYOUT, options) as c:
            keys, blocks = batch(0)
            assert all(c.put(keys, blocks, durable=True))
            if signal_name == "SIGTERM":
                server.stop()
            else:
                server.kill()
            with pytest.raises(KVStoreError):
                c.get(keys, [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype)])
            server.start()
            deadline = time.monotonic() + 10
            outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
            while True:
                try:
                    assert c.get(keys, outs) == [True] * len(keys)
                    break
                except KVStoreError:
                    assert time.monotonic() < deadline, "the client did not reconnect"
                    time.sleep(0.1)
            assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
