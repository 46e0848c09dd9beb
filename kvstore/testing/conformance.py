"""The conformance suite every tier passes.

Use it from a test module::

    from kvstore.testing.conformance import TierConformance

    class TestHostTier(TierConformance):
        def make_tier(self, layout, capacity_blocks):
            return HostTier(HostTierConfig(capacity=capacity_blocks * layout.block_nbytes), layout)

pytest collects the inherited ``test_*`` methods. Class attributes tune the
suite for a medium: ``bounded`` (the tier refuses blocks past its capacity; an unbounded
one takes puts past its nominal capacity)
and ``capacity_blocks`` (the size the suite asks for).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator

import pytest
import torch

from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.testing.data import block_list, random_blocks, small_layout
from kvstore.tiers.base import Tier

__all__ = ["TierConformance", "make_keys"]


def make_keys(n: int, salt: int = 0) -> list[BlockKey]:
    """``n`` distinct 16-byte keys."""
    return [BlockKey(((salt << 64) | i).to_bytes(16, "little")) for i in range(n)]


class TierConformance(ABC):
    """Behaviour every :class:`~kvstore.tiers.base.Tier` must have."""

    layout: KVLayout = small_layout()
    capacity_blocks: int = 8
    bounded: bool = True

    @abstractmethod
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> Tier:
        """A new, empty tier of the medium under test."""

    @pytest.fixture
    def tier(self) -> Iterator[Tier]:
        tier = self.make_tier(self.layout, self.capacity_blocks)
        try:
            yield tier
        finally:
            tier.close()

    def _empty(self, n: int = 1) -> list[torch.Tensor]:
        return [torch.zeros(self.layout.block_shape, dtype=self.layout.dtype) for _ in range(n)]

    # -- basic round trips --------------------------------------------------
    def test_put_get_round_trip(self, tier: Tier) -> None:
        keys, blocks = make_keys(3), block_list(self.layout, 3, seed=1)
        assert tier.put(keys, blocks) == [True] * 3
        outs = self._empty(3)
        assert tier.get(keys, outs) == [True] * 3
        for out, block in zip(outs, blocks, strict=True):
            assert torch.equal(out, block)

    def test_get_missing_is_a_miss_and_leaves_out_alone(self, tier: Tier) -> None:
        outs = [torch.full(self.layout.block_shape, 7.0, dtype=self.layout.dtype)]
        assert tier.get(make_keys(1, salt=9), outs) == [False]
        assert bool((outs[0] == 7.0).all())

    def test_mixed_batch(self, tier: Tier) -> None:
        keys, blocks = make_keys(4), block_list(self.layout, 4, seed=2)
        tier.put(keys[::2], blocks[::2])
        outs = self._empty(4)
        assert tier.get(keys, outs) == [True, False, True, False]
        assert torch.equal(outs[2], blocks[2])
        assert tier.contains(keys) == [True, False, True, False]

    def test_stored_keys_lists_exactly_what_is_held(self, tier: Tier) -> None:
        keys, blocks = make_keys(5), block_list(self.layout, 5, seed=3)
        tier.put(keys, blocks)
        tier.delete(keys[:2])
        assert sorted(tier.stored_keys()) == sorted(keys[2:])

    def test_put_of_a_stored_key_keeps_one_copy(self, tier: Tier) -> None:
        keys, blocks = make_keys(1), block_list(self.layout, 2, seed=4)
        assert tier.put(keys, blocks[:1]) == [True]
        assert tier.put(keys, blocks[:1]) == [True]
        assert list(tier.stored_keys()) == keys
        out = self._empty()
        tier.get(keys, out)
        assert torch.equal(out[0], blocks[0])

    def test_delete(self, tier: Tier) -> None:
        keys, blocks = make_keys(2), block_list(self.layout, 2, seed=5)
        tier.put(keys, blocks)
        tier.delete([keys[0], *make_keys(1, salt=3)])  # absent keys are ignored
        assert tier.contains(keys) == [False, True]
        assert tier.get(keys, self._empty(2)) == [False, True]

    def test_distinct_blocks_never_alias(self, tier: Tier) -> None:
        n = self.capacity_blocks
        keys, blocks = make_keys(n), block_list(self.layout, n, seed=6)
        assert all(tier.put(keys, blocks))
        outs = self._empty(n)
        assert all(tier.get(keys, outs))
        for out, block in zip(outs, blocks, strict=True):
            assert torch.equal(out, block)

    # -- views and layers ---------------------------------------------------
    def test_strided_source_and_target(self, tier: Tier) -> None:
        kv = random_blocks(self.layout, 3, seed=7)  # the engine-side (L, kv, tokens, H, D) tensor
        step = self.layout.block_tokens
        keys = make_keys(3)
        views = [kv[:, :, i * step : (i + 1) * step] for i in range(3)]
        assert not views[1].is_contiguous()
        assert tier.put(keys, views) == [True] * 3
        out = torch.zeros_like(kv)
        targets = [out[:, :, i * step : (i + 1) * step] for i in range(3)]
        assert tier.get(keys, targets) == [True] * 3
        assert torch.equal(out, kv)

    def test_layer_range_get(self, tier: Tier) -> None:
        keys, blocks = make_keys(2), block_list(self.layout, 2, seed=8)
        tier.put(keys, blocks)
        first, last = 1, self.layout.num_layers
        outs = [
            torch.zeros((last - first, *self.layout.block_shape[1:]), dtype=self.layout.dtype)
            for _ in keys
        ]
        assert tier.get(keys, outs, layers=(first, last)) == [True, True]
        for out, block in zip(outs, blocks, strict=True):
            assert torch.equal(out, block[first:last])

    # -- capacity -----------------------------------------------------------
    def test_capacity_is_reported(self, tier: Tier) -> None:
        if self.bounded:
            assert tier.capacity_blocks == self.capacity_blocks
        else:
            assert tier.capacity_blocks >= self.capacity_blocks

    def test_full_tier_refuses_and_capacity_returns(self, tier: Tier) -> None:
        if not self.bounded:  # no hard block limit: puts past it land, deletes leave nothing
            n = tier.capacity_blocks + 2
            keys = make_keys(n, salt=7)
            assert tier.put(keys, block_list(self.layout, n)) == [True] * n
            tier.delete(keys)
            assert list(tier.stored_keys()) == []
            return
        n = tier.capacity_blocks
        for round_ in range(3):  # capacity comes back exactly after deletes
            keys = make_keys(n, salt=round_)
            blocks = block_list(self.layout, n, seed=round_)
            assert all(tier.put(keys, blocks))
            extra = make_keys(1, salt=100 + round_)
            assert tier.put(extra, blocks[:1]) == [False]
            tier.delete(keys)
            assert list(tier.stored_keys()) == []

    # -- two-step stores (optional: memory tiers hand out their memory) ------
    def test_two_step_store(self, tier: Tier) -> None:
        keys, blocks = make_keys(3), block_list(self.layout, 3, seed=9)
        views = tier.reserve(keys)
        assert len(views) == 3
        if all(v is None for v in views):
            assert tier.commit(keys) == [False] * 3  # not supported: nothing to publish
            tier.abort(keys)
            return
        for view, block in zip(views, blocks, strict=True):
            assert view is not None and tuple(view.shape) == self.layout.block_shape
            for layer in range(self.layout.num_layers):  # filled layer by layer
                view[layer].copy_(block[layer])
        assert tier.contains(keys) == [False] * 3  # invisible until committed
        assert tier.commit(keys[:2]) == [True, True]
        tier.abort(keys[2:])
        outs = self._empty(3)
        assert tier.get(keys, outs) == [True, True, False]
        assert torch.equal(outs[0], blocks[0]) and torch.equal(outs[1], blocks[1])
        if self.bounded:  # the aborted reservation's room came back
            n = tier.capacity_blocks - 2
            assert all(tier.put(make_keys(n, salt=7), block_list(self.layout, n, seed=10)))

    # -- concurrency and lifecycle -----------------------------------------
    def test_concurrent_writers_and_readers(self, tier: Tier) -> None:
        threads, per_thread = 4, max(1, self.capacity_blocks // 4)
        errors: list[str] = []

        def work(t: int) -> None:
            keys = make_keys(per_thread, salt=50 + t)
            blocks = block_list(self.layout, per_thread, seed=50 + t)
            for _ in range(5):
                if not all(tier.put(keys, blocks)):
                    errors.append(f"thread {t}: put failed")
                outs = self._empty(per_thread)
                if not all(tier.get(keys, outs)):
                    errors.append(f"thread {t}: get missed")
                for out, block in zip(outs, blocks, strict=True):
                    if not torch.equal(out, block):
                        errors.append(f"thread {t}: wrong bytes")
                tier.delete(keys)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert errors == []
        assert list(tier.stored_keys()) == []

    def test_close_is_idempotent(self) -> None:
        tier = self.make_tier(self.layout, self.capacity_blocks)
        tier.close()
        tier.close()
