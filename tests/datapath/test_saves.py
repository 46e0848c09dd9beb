"""Saves that never block the caller: the staging ring, the saver (on CPU tensors here,
through the thread engine; from CUDA tensors through the store where a GPU exists)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstore import InvalidInputError, KVStore
from kvstore.datapath.saves import StagingRing
from kvstore.testing.data import host_config, random_blocks, small_layout

WAIT = 30.0


def test_the_ring_hands_out_regions_in_order_and_wraps() -> None:
    ring = StagingRing(torch.device("cpu"), 4096)
    a, b, c = ring.take(1000), ring.take(1000), ring.take(1000)
    assert a is not None and b is not None and c is not None
    assert (a.start, b.start, c.start) == (0, 1024, 2048)
    assert ring.take(8192) is None  # more than the whole ring: the caller saves in line
    ring.give(b)  # out of order: nothing is reusable until a is back too
    assert ring.used == 3 * 1024
    ring.give(a)
    assert ring.used == 1024
    d = ring.take(1024)  # the end of the ring is free
    e = ring.take(2048)  # wraps to the start: [0, 2048) is free again
    assert d is not None and d.start == 3072 and e is not None and e.start == 0
    for region in (c, d, e):
        ring.give(region)
    assert ring.used == 0


def test_a_full_ring_makes_the_taker_wait_until_room_comes_back() -> None:
    ring = StagingRing(torch.device("cpu"), 2048)
    first = ring.take(2048)
    assert first is not None
    waits: list[int] = []
    got: list[object] = []
    taker = threading.Thread(target=lambda: got.append(ring.take(512, lambda: waits.append(1))))
    taker.start()
    time.sleep(0.1)
    assert not got and waits == [1]  # backpressure, never a drop
    ring.give(first)
    taker.join(WAIT)
    assert got and got[0] is not None


def test_views_of_a_region_have_the_shape_and_dtype_of_the_source() -> None:
    ring = StagingRing(torch.device("cpu"), 1 << 16)
    src = torch.randn(2, 8, 4, 16).to(torch.bfloat16)[:, :, :2]  # not contiguous
    region = ring.take(src.numel() * src.element_size())
    assert region is not None
    view = ring.view(region, src)
    view.copy_(src)
    assert view.is_contiguous() and torch.equal(view, src)


def test_background_saves_land_in_order_and_reads_wait_for_them() -> None:
    """The saver's whole path on CPU tensors (the thread engine's lanes)."""
    layout = small_layout()
    with KVStore(layout, {**host_config(layout, 16), "saves": {"staging_bytes": "1MiB"}}) as store:
        manager = store.engine.datapath
        keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
        kv = random_blocks(layout, 4, seed=3)
        for layer in range(layout.num_layers):  # layer by layer, as prefill makes them
            src = kv[layer].clone()
            assert manager.save_layer(keys[:2], layer, src[:, : 2 * layout.block_tokens]) == 2
            src.zero_()  # the caller reuses its buffer at once: the snapshot is safe
        assert manager.save(keys[2:], kv[:, :, 2 * layout.block_tokens :].clone()) == 2
        assert store.lookup(keys) == 4  # waits for the saves of these keys
        assert torch.equal(store.get(keys), kv)
        assert store.drain(WAIT)
        stats = store.stats()
        assert stats["saves_queued"] == layout.num_layers + 1 and stats["saves_failed"] == 0


def test_a_tiny_ring_still_saves_everything() -> None:
    layout = small_layout()
    nbytes = layout.block_nbytes
    config = {**host_config(layout, 32), "saves": {"staging_bytes": 2 * nbytes}}
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(8 * layout.block_tokens), "m")
        kv = random_blocks(layout, 8, seed=4)
        for i in range(8):  # one block a call: the ring holds two
            store.engine.datapath.save(
                keys[i : i + 1], kv[:, :, i * layout.block_tokens : (i + 1) * layout.block_tokens]
            )
        store.engine.datapath.save(keys, kv)  # larger than the ring: saved in line
        assert store.drain(WAIT)
        assert store.lookup(keys) == 8 and torch.equal(store.get(keys), kv)
        assert store.stats()["saves_in_line"] == 1


def test_a_failing_tier_makes_a_background_save_a_miss_not_an_error() -> None:
    from kvstore.testing.faults import FaultyTier

    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as probe:
        tier_config = probe.config.tiers[0]
    from kvstore.tiers.host import HostTier

    faulty = FaultyTier(HostTier(tier_config, layout))
    faulty.put_error = 1.0
    with KVStore(layout, host_config(layout, 8), tiers=[faulty]) as store:
        keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
        assert store.engine.datapath.save(keys, random_blocks(layout, 2)) == 2
        assert store.drain(WAIT)
        assert store.lookup(keys) == 0


def test_bad_save_config_is_refused() -> None:
    from kvstore.errors import ConfigError

    layout = small_layout()
    with pytest.raises(ConfigError, match=r"saves\.mode"):
        KVStore(layout, {**host_config(layout, 4), "saves": {"mode": "later"}})
    with pytest.raises(ConfigError, match="staging_bytes"):
        KVStore(layout, {**host_config(layout, 4), "saves": {"staging_bytes": 0}})


# -- from CUDA tensors, through the store ---------------------------------------------------
@pytest.mark.cuda
def test_put_from_cuda_returns_at_once_and_lands() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 16)) as store:
        keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
        kv = random_blocks(layout, 4, seed=5).cuda()
        want = kv.clone()
        assert store.put(keys, kv) == 4
        kv.zero_()  # reused at once, on the same stream: the snapshot was taken before
        assert store.drain(WAIT)
        assert store.lookup(keys) == 4
        assert torch.equal(store.get(keys, device="cuda"), want)
        got = store.get(keys)
        assert got.is_pinned() and torch.equal(got.cuda(), want)


@pytest.mark.cuda
def test_put_layer_from_cuda_publishes_blocks_when_every_layer_landed() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 16)) as store:
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
        kv = random_blocks(layout, 3, seed=6).cuda()
        for layer in range(layout.num_layers - 1):
            store.put_layer(keys, layer, kv[layer])
        assert store.drain(WAIT) and store.lookup(keys) == 0  # a layer is still missing
        store.put_layer(keys, layout.num_layers - 1, kv[-1])
        out = torch.empty_like(kv)
        assert store.get_prefix(keys, out) == 3  # waits for the save of these keys
        assert torch.equal(out, kv)


@pytest.mark.cuda
def test_sync_saves_copy_before_returning() -> None:
    layout = small_layout()
    config = {**host_config(layout, 8), "saves": {"mode": "sync"}}
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
        kv = random_blocks(layout, 2, seed=7).cuda()
        assert store.put(keys, kv) == 2
        assert store.stats()["saves_queued"] == 0
        assert store.engine.datapath.lookup(keys) == 2


def test_get_refuses_out_and_device_together() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 4)) as store:
        keys = store.hash_tokens(torch.arange(layout.block_tokens), "m")
        store.put(keys, random_blocks(layout, 1))
        with pytest.raises(InvalidInputError):
            store.get(keys, torch.empty(layout.tensor_shape(1), dtype=layout.dtype), device="cpu")
        with pytest.raises(InvalidInputError):
            store.get(keys, device="meta")
        assert torch.equal(store.get(keys, device="cpu"), store.get(keys))


def test_without_room_for_the_ring_saves_are_synchronous(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device too full for the staging ring (an out-of-memory no real CPU tier gives)."""
    import kvstore.datapath.manager

    def no_room(*_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(kvstore.datapath.manager, "Saver", no_room)
    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
        kv = random_blocks(layout, 2, seed=9)
        with caplog.at_level("WARNING", logger="kvstore.datapath.manager"):
            assert store.engine.datapath.save(keys[:1], kv[:, :, : layout.block_tokens]) == 1
            for layer in range(layout.num_layers):
                store.engine.datapath.save_layer(
                    keys[1:], layer, kv[layer, :, layout.block_tokens :]
                )
        assert store.lookup(keys) == 2
        assert torch.equal(store.get(keys), kv)
        assert sum("staging ring" in r.getMessage() for r in caplog.records) == 1
        assert store.stats()["saves_queued"] == 0
