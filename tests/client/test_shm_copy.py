"""Copies out of shared memory: plain host outputs in one C call made from addresses,
anything else through the copy engine, both giving the stored bytes."""

from __future__ import annotations

import mmap
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from kvstore.cli.kvserver import server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.client import receive as client_receive
from kvstore.config import StoreConfig
from kvstore.errors import ProtocolError
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import block_list, empty_blocks, small_layout
from kvstore.wire import Mapping as ShmMapping

LAYOUT = small_layout()
N = 6


@pytest.fixture
def client() -> Iterator[Client]:
    work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    config = server_test_config(work, [{"kind": "host", "capacity": 4 * N * LAYOUT.block_nbytes}])
    thread = ServerThread(StoreConfig.from_dict(config, environ={})).start()
    with Client(LAYOUT, ClientOptions(thread.address, shared_memory=True, timeout=10)) as c:
        yield c
    thread.stop()
    shutil.rmtree(work, ignore_errors=True)


def _stored(client: Client) -> tuple[list[bytes], list[torch.Tensor]]:
    keys, blocks = make_keys(N, salt=3), block_list(LAYOUT, N, seed=3)
    assert client.put(keys, blocks) == [True] * N
    assert client.shared_memory
    return keys, blocks


def test_plain_outputs_are_copied_in_one_c_call(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    if client_receive.memcopy is None:
        pytest.skip("kvstore.native._memcopy is not built")
    keys, blocks = _stored(client)
    calls: list[int] = []
    real = client_receive.memcopy.copy_regions

    def counting(table: object, threads: int) -> None:
        calls.append(len(memoryview(table)) // 3)  # type: ignore[arg-type]
        real(table, threads)  # type: ignore[arg-type]

    monkeypatch.setattr(client_receive.memcopy, "copy_regions", counting)
    outs = empty_blocks(LAYOUT, N)
    assert client.get(keys, outs) == [True] * N
    assert calls == [N]
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    assert client.stats["shm_blocks"] >= N


@pytest.mark.parametrize("case", ["strided", "overlapping"])
def test_other_outputs_go_through_the_copy_engine(
    client: Client, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    keys, blocks = _stored(client)
    if client_receive.memcopy is not None:
        monkeypatch.setattr(
            client_receive.memcopy, "copy_regions", lambda *a: pytest.fail("not a plain memcpy")
        )
    if case == "strided":  # each out a view with every other element of a bigger tensor
        big = torch.zeros(
            N, *LAYOUT.block_shape[:-1], 2 * LAYOUT.block_shape[-1], dtype=LAYOUT.dtype
        )
        outs = [big[i, ..., ::2] for i in range(N)]
        assert client.get(keys, outs) == [True] * N
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    else:  # the same tensor twice: copy_ order, the last block wins
        same = torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype)
        assert client.get(keys[:2], [same, same]) == [True, True]
        assert torch.equal(same, blocks[1])


def test_a_slot_outside_the_segment_is_a_protocol_error() -> None:
    size = 4 * LAYOUT.block_nbytes
    region = mmap.mmap(-1, size)
    mapping = ShmMapping(region, torch.frombuffer(region, dtype=torch.uint8))
    outs = empty_blocks(LAYOUT, 2)
    for bad in (size - LAYOUT.block_nbytes + 1, -1):
        with pytest.raises(ProtocolError, match="outside the segment"):
            client_receive.copy_from_shm(
                mapping, LAYOUT, [(outs[0], 0), (outs[1], bad)], LAYOUT.block_nbytes
            )
    region[:size] = bytes(range(256)) * (size // 256)
    client_receive.copy_from_shm(mapping, LAYOUT, [(outs[0], 0)], LAYOUT.block_nbytes)
    assert outs[0].view(torch.uint8).flatten().tolist()[:300] == [i % 256 for i in range(300)]
