"""Prefetch (background, layer by layer) and layerwise writes."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvstore import InvalidInputError, KVStore, LayoutMismatchError
from kvstore.config import HostTierConfig, StoreConfig
from kvstore.datapath import BlockManager
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.testing.data import host_config, random_blocks, small_layout
from kvstore.tiers.base import LayerRange
from kvstore.tiers.host import HostTier


class SteppedTier(HostTier):
    """A host tier whose reads wait for the test's go-ahead, one call at a time.

    It lends no views of its memory, so a prefetch reads it through ``get``
    (a step per call) rather than handing views to the copy engine.
    """

    def __init__(self, layout: KVLayout, blocks: int, latency_ms: float = 0.0) -> None:
        # No latency: a call a layer (a prefetch reads a tier with latency more layers a
        # call, so that the latency is at most a quarter of each: test_prefetch_slow_link).
        config = HostTierConfig(
            capacity=blocks * layout.block_nbytes, read_gbps=0.02, read_latency_ms=latency_ms
        )
        super().__init__(config, layout)
        self.allowed = threading.Semaphore(0)
        self.calls: list[LayerRange] = []

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        assert self.allowed.acquire(timeout=10), "the test never let the read go"
        self.calls.append(layers)
        return super().get(keys, outs, layers)

    def view(self, key: BlockKey) -> torch.Tensor | None:
        return None


def stepped_store(
    n: int = 3, latency_ms: float = 0.0, **config: object
) -> tuple[KVStore, SteppedTier, list[bytes], torch.Tensor]:
    layout = small_layout()
    tier = SteppedTier(layout, 16, latency_ms)
    store = KVStore(
        layout, StoreConfig.from_dict({"tiers": [{"kind": "host"}], **config}), tiers=[tier]
    )
    keys = store.hash_tokens(torch.arange(n * layout.block_tokens), "m")
    kv = random_blocks(layout, n)
    store.put(keys, kv)
    return store, tier, keys, kv


def test_a_tier_with_latency_is_read_several_layers_a_call() -> None:
    """A layer of small_layout (1 KiB at 20 MB/s: 51 us) behind 0.3 ms of latency: 18
    layers a call would keep the latency to a quarter of it, so the prefetch reads each
    block whole (3 layers), in one call, still handing the engine the layers in order."""
    store, tier, keys, kv = stepped_store(latency_ms=0.3)
    layout = store.layout
    assert layout.num_layers == 3 and layout.layer_nbytes == 1024
    out = torch.zeros(layout.tensor_shape(len(keys)), dtype=layout.dtype)
    handle = store.prefetch(keys, out)
    assert not handle.wait_layer(0, timeout=0.05)
    tier.allowed.release()
    assert handle.wait(timeout=10) and handle.blocks_ready == 3
    assert tier.calls == [(0, 3)]  # one call for every layer of every block
    assert [s.last_layer for s in handle.steps] == [1, 2, 3]  # the layers, in order
    assert torch.equal(out, kv)
    store.close()


def test_layers_arrive_in_order_and_wait_layer_sees_each() -> None:
    store, tier, keys, kv = stepped_store()
    handle = store.prefetch(keys)
    assert not handle.wait_layer(0, timeout=0.05)  # nothing read yet
    tier.allowed.release()
    assert handle.wait_layer(0, timeout=10)
    assert not handle.wait_layer(1, timeout=0.05)  # layer 1 still waits
    assert handle.blocks_ready == 0  # no block has every layer yet
    tier.allowed.release(2)
    assert handle.wait(timeout=10) and handle.done
    assert tier.calls == [(0, 1), (1, 2), (2, 3)]  # one read per layer, every block at once
    assert handle.valid_blocks == handle.blocks_ready == 3 and handle.error is None
    assert handle.out is not None and torch.equal(handle.out, kv)
    assert store.engine.datapath.pinned_blocks() == 0  # the lease ended with the load
    store.close()


def test_block_order_makes_a_partial_prefix_usable_early() -> None:
    store, tier, keys, kv = stepped_store(4, prefetch={"policy": "best_effort"})
    handle = store.prefetch(keys, order="block", layers_per_step=1)
    tier.allowed.release(2)
    step = store.layout.block_tokens

    def two_ready() -> bool:
        return handle.blocks_ready >= 2

    assert _eventually(two_ready)
    assert handle.result() == 2  # best effort: take what is there, cancel the rest
    tier.allowed.release(2)
    handle.wait(timeout=10)
    # Cancelled: the read already in flight (block 2) finishes, block 3 is never read.
    assert len(tier.calls) == 3 and handle.blocks_ready == 3
    assert handle.out is not None and torch.equal(
        handle.out[:, :, : 2 * step], kv[:, :, : 2 * step]
    )
    assert store.engine.datapath.pinned_blocks() == 0
    store.close()


def test_cancel_stops_after_the_step_in_flight() -> None:
    store, tier, keys, _ = stepped_store()
    handle = store.prefetch(keys)
    handle.cancel()
    tier.allowed.release(3)
    assert handle.wait(timeout=10)
    assert len(tier.calls) <= 1 and handle.blocks_ready == 0
    assert store.engine.datapath.pinned_blocks() == 0
    store.close()


def test_timeout_policy_takes_what_arrived_by_the_deadline() -> None:
    store, tier, keys, _ = stepped_store(
        prefetch={"policy": "timeout", "timeout_base_s": 0.2, "timeout_per_1k_tokens_s": 0}
    )
    handle = store.prefetch(keys, order="block")
    assert handle.result(num_tokens=3 * store.layout.block_tokens) == 0  # nothing came in time
    assert handle.cancelled
    tier.allowed.release(3)
    handle.wait(timeout=10)
    store.close()


def test_missing_block_in_the_middle_ends_the_prefix() -> None:
    layout = small_layout()
    store = KVStore(layout, host_config(layout, 16))
    keys = store.hash_tokens(torch.arange(5 * layout.block_tokens), "m")
    kv = random_blocks(layout, 5)
    store.put(keys, kv)
    store.delete(keys[2:3])
    with store.prefetch(keys) as handle:
        handle.wait(timeout=10)
        assert handle.valid_blocks == 2 and handle.blocks_ready == 2
        t = 2 * layout.block_tokens
        assert handle.out is not None and torch.equal(handle.out[:, :, :t], kv[:, :, :t])
    store.close()


def test_corrupt_block_mid_prefetch_is_reported_and_never_returned(tmp_path: Path) -> None:
    layout = small_layout()
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}]}
    store = KVStore(layout, config)
    keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
    kv = random_blocks(layout, 4)
    store.put(keys, kv)
    victim = Path(store.engine.datapath.tiers[0].block_path(keys[2]))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10  # flip a bit in the last layer's payload
    victim.write_bytes(bytes(data))
    handle = store.prefetch(keys)  # layer by layer: the damage shows at the last layer
    handle.wait(timeout=10)
    assert handle.valid_blocks == 2 and handle.blocks_ready == 2
    assert handle.error is not None and keys[2].hex() in str(handle.error)
    assert not victim.exists()  # the corrupt file was removed
    t = 2 * layout.block_tokens
    assert handle.out is not None and torch.equal(handle.out[:, :, :t], kv[:, :, :t])
    assert store.lookup(keys) == 2
    store.close()


def test_prefetch_bad_input() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 4)) as store:
        keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
        with pytest.raises(LayoutMismatchError):
            store.prefetch(keys, out=torch.empty(layout.tensor_shape(1), dtype=layout.dtype))
        with pytest.raises(InvalidInputError):
            store.prefetch(keys, order="sideways")
        with pytest.raises(InvalidInputError):
            store.prefetch(keys, layers_per_step=0)
        handle = store.prefetch(keys)  # nothing stored: an empty, finished load
        assert handle.wait(timeout=10) and handle.valid_blocks == 0
        with pytest.raises(InvalidInputError):
            handle.wait_layer(layout.num_layers)


# -- layerwise writes --------------------------------------------------------
def test_a_block_is_visible_only_when_all_layers_arrived() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
        kv = random_blocks(layout, 3)
        for layer in reversed(range(layout.num_layers)):  # any order works
            assert store.lookup(keys) == 0
            done = store.put_layer(keys, layer, kv[layer])
        assert done == 3
        assert store.lookup(keys) == 3
        assert torch.equal(store.get(keys), kv)
        assert store.put_layer(keys, 0, kv[0]) == 0  # stored already: skipped
        assert store.engine.datapath.pinned_blocks() == 0


def test_layers_from_many_threads() -> None:
    layout = small_layout(num_layers=8)
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
        kv = random_blocks(layout, 4)
        threads = [
            threading.Thread(target=store.put_layer, args=(keys, layer, kv[layer]))
            for layer in range(layout.num_layers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.lookup(keys) == 4 and torch.equal(store.get(keys), kv)


def test_an_abandoned_layerwise_write_expires_and_returns_its_room() -> None:
    layout = small_layout()
    clock = [0.0]
    config = HostTierConfig(capacity=4 * layout.block_nbytes)
    tier = HostTier(config, layout)
    manager = BlockManager(
        layout, [tier], StoreConfig(tiers=(config,), lease_s=5), lambda: clock[0]
    )
    keys = [bytes([i]) * 16 for i in range(2)]
    kv = random_blocks(layout, 2)
    step = layout.block_tokens
    manager.write_layer(keys, 0, [kv[0, :, i * step : (i + 1) * step] for i in range(2)])
    assert tier.free_blocks == 2  # two slots reserved for the blocks in flight
    assert manager.lookup(keys) == 0
    clock[0] += 6  # the request was aborted: no more layers come
    assert manager.evict(0, 0) == []  # any pass through eviction reaps expired writes
    assert tier.free_blocks == 4 and manager.counters.layer_writes_expired == 2
    assert manager.pinned_blocks() == 0
    manager.close()


def test_layerwise_write_to_a_tier_without_reservations_goes_through_staging(
    tmp_path: Path,
) -> None:
    layout = small_layout()
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}]}
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
        kv = random_blocks(layout, 2)
        for layer in range(layout.num_layers):
            store.put_layer(keys, layer, kv[layer])
        assert store.engine.datapath.where(keys[0]) == [0]
        assert torch.equal(store.get(keys), kv)


def test_put_layer_bad_input_changes_nothing() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 4)) as store:
        keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
        kv = random_blocks(layout, 2)
        with pytest.raises(InvalidInputError):
            store.put_layer(keys, layout.num_layers, kv[0])
        with pytest.raises(LayoutMismatchError):
            store.put_layer(keys, 0, kv[0, :, : layout.block_tokens])
        with pytest.raises(LayoutMismatchError):
            store.put_layer(keys, 0, kv[0].float())
        with pytest.raises(InvalidInputError):
            store.put_layer(keys, 0, "not a tensor")  # type: ignore[arg-type]
        assert store.engine.datapath.pinned_blocks() == 0 and len(store.engine.datapath) == 0
        assert store.engine.datapath.tiers[0].free_blocks == 4


@pytest.mark.cuda
def test_prefetch_into_cuda_and_layerwise_from_cuda() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
        kv = random_blocks(layout, 3).cuda()
        for layer in range(layout.num_layers):
            store.put_layer(keys, layer, kv[layer])
        out = torch.empty_like(kv)
        handle = store.prefetch(keys, out=out)
        for layer in range(layout.num_layers):
            assert handle.wait_layer(layer, timeout=10)
            assert torch.equal(out[layer], kv[layer])
        assert handle.valid_blocks == 3


def _eventually(check: object, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(check) and check():
            return True
        time.sleep(0.005)
    return False


def test_prefetch_into_an_inference_tensor_from_host_memory(
    store: KVStore, layout: KVLayout
) -> None:
    """The loader thread fills a destination made under torch.inference_mode()."""
    kv = random_blocks(layout, 2, seed=8)
    keys = store.hash_tokens(list(range(2 * layout.block_tokens)), namespace="m")
    store.put(keys, kv)
    with torch.inference_mode():
        handle = store.prefetch(keys)
    assert handle.result() == 2 and handle.error is None
    assert torch.equal(handle.out, kv)
