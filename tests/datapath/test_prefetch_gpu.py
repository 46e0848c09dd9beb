"""Prefetches into a GPU: copies queued at once and ordered on the GPU, layer waits on the
engine's stream (wait_layer_on), slower tiers read through pinned staging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore import KVStore
from kvstore.testing.data import host_config, random_blocks, small_layout

WAIT = 30.0


def disk_config(path: Path, blocks: int, nbytes: int) -> dict[str, object]:
    return {"tiers": [{"kind": "disk", "path": str(path), "capacity": blocks * nbytes}]}


def test_wait_layer_on_waits_on_the_cpu_for_a_host_destination() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
        kv = random_blocks(layout, 3, seed=1)
        store.put(keys, kv)
        handle = store.prefetch(keys)
        for layer in range(layout.num_layers):
            handle.wait_layer_on(layer)
            assert handle.out is not None and torch.equal(handle.out[layer], kv[layer])
        assert handle.wait(WAIT) and handle.valid_blocks == 3
        block = store.prefetch(keys, order="block")
        block.wait_layer_on(0)  # block order: the whole load
        assert block.done and block.out is not None and torch.equal(block.out, kv)


def test_wait_layer_on_returns_when_a_load_ends_early(tmp_path: Path) -> None:
    layout = small_layout()
    with KVStore(layout, disk_config(tmp_path, 8, layout.block_nbytes)) as store:
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
        store.put(keys, random_blocks(layout, 3, seed=2))
        handle = store.prefetch(keys)
        handle.cancel()
        for layer in range(layout.num_layers):
            handle.wait_layer_on(layer)
        assert handle.wait(WAIT)


def stream_check(handle: object, out: torch.Tensor, kv: torch.Tensor, layers: int) -> None:
    """Wait for each layer on a side stream, as an engine would, and read it there."""
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for layer in range(layers):
            handle.wait_layer_on(layer)  # type: ignore[attr-defined]
            sums.append(out[layer].float().sum())
    side.synchronize()
    for layer in range(layers):
        assert torch.equal(sums[layer], kv[layer].float().sum())


@pytest.mark.cuda
def test_prefetch_from_host_memory_into_the_gpu_layer_by_layer() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
        kv = random_blocks(layout, 4, seed=3).cuda()
        store.put(keys, kv)
        out = torch.full_like(kv, 9)
        torch.cuda._sleep(50_000_000)
        out.fill_(5)  # still queued when prefetch() is called: the copies must come after
        handle = store.prefetch(keys, out=out)
        stream_check(handle, out, kv, layout.num_layers)
        assert handle.wait(WAIT) and handle.valid_blocks == 4 and handle.blocks_ready == 4
        assert torch.equal(out, kv)


@pytest.mark.cuda
def test_prefetch_from_disk_into_the_gpu_through_pinned_staging(tmp_path: Path) -> None:
    layout = small_layout()
    config = disk_config(tmp_path, 16, layout.block_nbytes)
    config["prefetch"] = {"staging_bytes": 4 * layout.block_nbytes}  # groups of two blocks
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(6 * layout.block_tokens), "m")
        kv = random_blocks(layout, 6, seed=4)
        store.put(keys, kv)
        assert store.drain(WAIT)
        out = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
        handle = store.prefetch(keys, out=out)
        stream_check(handle, out, kv.cuda(), layout.num_layers)
        assert handle.wait(WAIT) and handle.valid_blocks == 6
        assert torch.equal(out.cpu(), kv)


@pytest.mark.cuda
def test_a_corrupt_block_on_disk_ends_the_gpu_prefix(tmp_path: Path) -> None:
    layout = small_layout()
    with KVStore(layout, disk_config(tmp_path, 16, layout.block_nbytes)) as store:
        keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
        kv = random_blocks(layout, 4, seed=5)
        store.put(keys, kv)
        files = sorted(tmp_path.rglob(keys[2].hex() + "*"))
        assert files, "the block file of key 2"
        with open(files[0], "r+b") as f:
            f.seek(-64, 2)
            f.write(b"\xff" * 64)
        out = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
        handle = store.prefetch(keys, out=out)
        for layer in range(layout.num_layers):
            handle.wait_layer_on(layer)
        assert handle.wait(WAIT) and handle.valid_blocks == 2 and handle.error is not None
        bt = layout.block_tokens
        assert torch.equal(out[:, :, : 2 * bt].cpu(), kv[:, :, : 2 * bt])


@pytest.mark.cuda
def test_blocks_in_memory_and_on_disk_mix_in_one_gpu_prefetch(tmp_path: Path) -> None:
    layout = small_layout()
    nbytes = layout.block_nbytes
    config = {
        "tiers": [
            {"kind": "host", "capacity": 8 * nbytes},
            {"kind": "disk", "path": str(tmp_path), "capacity": 16 * nbytes},
        ]
    }
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(5 * layout.block_tokens), "m")
        kv = random_blocks(layout, 5, seed=6)
        store.put(keys, kv)
        store.flush(keys)
        store.engine.datapath.evict(0, 2)  # two blocks now only on disk
        out = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
        handle = store.prefetch(keys, out=out)
        stream_check(handle, out, kv.cuda(), layout.num_layers)
        assert handle.wait(WAIT) and handle.valid_blocks == 5
        assert torch.equal(out.cpu(), kv)


@pytest.mark.parametrize("order", ["layer", "block"])
def test_the_ordered_path_on_cpu_mixes_memory_and_disk_and_stops_at_a_corrupt_block(
    tmp_path: Path, order: str
) -> None:
    """The GPU's loading scheme (everything queued at once, slower tiers through
    staging, runs of adjacent blocks as one copy), run on CPU tensors."""
    layout = small_layout()
    nbytes = layout.block_nbytes
    config = {
        "tiers": [
            # No promotion: the second load must find the damaged block on disk still.
            {"kind": "host", "capacity": 6 * nbytes, "promote_after": 0},
            {"kind": "disk", "path": str(tmp_path), "capacity": 64 * nbytes},
        ],
        "prefetch": {"staging_bytes": 4 * nbytes},
    }
    bt = layout.block_tokens
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(9 * bt), "m")
        kv = random_blocks(layout, 9, seed=7)
        store.put(keys[:4], kv[:, :, : 4 * bt])
        store.put(keys[4:], kv[:, :, 4 * bt :])
        assert store.drain(WAIT)
        store.flush(keys)
        store.engine.datapath.evict(0, 2)  # some blocks only on disk, some in memory too
        where = [store.engine.datapath.where(k) for k in keys]
        assert [1] in where  # at least one block only the disk holds
        out = torch.zeros_like(kv)
        views = [out[:, :, i * bt : (i + 1) * bt] for i in range(9)]
        handle = store.engine.datapath.prefetcher.start(keys, views, order, 1, ordered=True)
        for layer in range(layout.num_layers):
            handle.wait_layer_on(layer)
        assert handle.wait(WAIT) and handle.valid_blocks == 9 and handle.blocks_ready == 9
        assert torch.equal(out, kv)
        only_disk = next(i for i, w in enumerate(where) if w == [1])
        files = sorted(tmp_path.rglob(keys[only_disk].hex() + "*"))
        with open(files[0], "r+b") as f:
            f.seek(-64, 2)
            f.write(b"\xff" * 64)
        out.zero_()
        handle = store.engine.datapath.prefetcher.start(keys, views, order, 1, ordered=True)
        assert handle.wait(WAIT) and handle.valid_blocks == only_disk
        assert torch.equal(out[:, :, : only_disk * bt], kv[:, :, : only_disk * bt])
