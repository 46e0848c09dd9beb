"""Host tier: the conformance suite plus what is specific to host memory."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import HostTierConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.testing.conformance import TierConformance
from kvstore.testing.data import small_layout
from kvstore.tiers.host import HostTier


class TestHostTier(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> HostTier:
        return HostTier(HostTierConfig(capacity=capacity_blocks * layout.block_nbytes), layout)


def test_capacity_rounds_down_to_whole_blocks() -> None:
    layout = small_layout()
    tier = HostTier(HostTierConfig(capacity=3 * layout.block_nbytes + 17), layout)
    assert tier.capacity_blocks == 3
    tier.close()


def test_capacity_below_one_block_is_a_config_error() -> None:
    layout = small_layout()
    with pytest.raises(ConfigError, match="smaller than one block"):
        HostTier(HostTierConfig(capacity=layout.block_nbytes - 1), layout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_pinned_memory_needs_cuda() -> None:
    layout = small_layout()
    auto = HostTier(HostTierConfig(capacity=layout.block_nbytes), layout)
    assert auto.pinned is False  # pinned: null means "only when CUDA exists"
    auto.close()
    with pytest.raises(ConfigError, match="pinned"):
        HostTier(HostTierConfig(capacity=layout.block_nbytes, pinned=True), layout)


@pytest.mark.cuda
def test_pinned_by_default_with_cuda() -> None:
    layout = small_layout()
    tier = HostTier(HostTierConfig(capacity=4 * layout.block_nbytes), layout)
    assert tier.pinned
    assert tier.stats()["prefault"] == "committed"  # pinned pages exist once allocated
    block = torch.randn(layout.block_shape, device="cuda").to(layout.dtype)
    key = b"g" * 16
    assert tier.put([key], [block]) == [True]
    slot = tier.view(key)  # a zero-copy view of the slab's slot
    assert slot is not None and slot.is_pinned()
    out = torch.empty_like(block)
    assert tier.get([key], [out]) == [True]
    assert torch.equal(out, block)
    tier.close()


def test_view_is_zero_copy_of_the_slot() -> None:
    layout = small_layout()
    tier = HostTier(HostTierConfig(capacity=2 * layout.block_nbytes), layout)
    key = b"k" * 16
    block = torch.ones(layout.block_shape, dtype=layout.dtype)
    tier.put([key], [block])
    view = tier.view(key)
    assert view is not None and torch.equal(view, block)
    assert tier.view(b"x" * 16) is None
    tier.close()


def test_delete_during_read_defers_the_slot_free() -> None:
    """A slot being copied out is not reused until the copy ends."""
    layout = small_layout()
    tier = HostTier(HostTierConfig(capacity=1 * layout.block_nbytes), layout)
    key = b"a" * 16
    tier.put([key], [torch.ones(layout.block_shape, dtype=layout.dtype)])

    with tier.reading([key]) as held:  # the slot held as an in-flight get holds it
        assert held == [True]
        tier.delete([key])
        assert tier.contains([key]) == [False]
        zeros = torch.zeros(layout.block_shape, dtype=layout.dtype)
        assert tier.put([b"b" * 16], [zeros]) == [False]
    assert tier.put([b"b" * 16], [torch.zeros(layout.block_shape, dtype=layout.dtype)]) == [True]
    tier.close()


def test_prefault_is_on_by_default_and_reported_in_stats() -> None:
    """Pageable memory (the default without CUDA; pinned memory, the default with it, is
    committed when allocated and reports ``committed``)."""
    layout = small_layout()
    tier = HostTier(HostTierConfig(capacity=8 * layout.block_nbytes, pinned=False), layout)
    assert tier.wait_prefault(30)
    stats = tier.stats()
    assert stats["prefault"] == "done" and stats["prefault_done"] is True
    assert stats["prefault_bytes_ready"] == stats["prefault_bytes_total"] == 8 * layout.block_nbytes
    tier.close()


def test_prefault_false_commits_pages_lazily() -> None:
    layout = small_layout()
    tier = HostTier(HostTierConfig(capacity=8 * layout.block_nbytes, prefault=False), layout)
    stats = tier.stats()
    assert stats["prefault"] == "off" and stats["prefault_bytes_total"] == 0
    tier.close()


def test_closing_a_store_while_its_host_tier_prefaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store closes at once: the prefault thread stops after the step in flight.

    The prefault's steps wait for a gate that opens only once close() has begun, so the
    tier is still prefaulting when the test looks, however fast the machine."""
    import threading
    import time

    from kvstore import KVStore
    from kvstore.runtime import memory

    gate = threading.Event()

    def held(address: int, length: int, advice: int) -> int:
        gate.wait(10)
        return 0

    monkeypatch.setattr(memory, "PREFAULT_CHUNK", 64 * 1024)
    monkeypatch.setattr(memory, "madvise", held)
    layout = small_layout()
    host = {"kind": "host", "capacity": 64 * layout.block_nbytes, "pinned": False}
    store = KVStore(layout, {"tiers": [host]})
    tier = store.stats()["tiers"][0]
    assert tier["prefault"] == "running" and not tier["prefault_done"]
    start = time.monotonic()
    threading.Timer(0.1, gate.set).start()  # the step in flight ends while close() waits
    store.close()
    assert time.monotonic() - start < 0.5
    assert store.engine.datapath.tiers[0].stats()["prefault"] == "stopped"
