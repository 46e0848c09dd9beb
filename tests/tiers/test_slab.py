"""The memory tiers' slab: a put whose copy fails gives its slots back."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import kvstore.tiers.slab as slab
from kvstore.config import HostTierConfig
from kvstore.copies import CopyPair
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers.host import HostTier

LAYOUT = small_layout()


class FailingEngine:
    """A copy engine whose copies raise: a fault no real copy of valid views produces
    on demand (a CUDA error, a device lost mid-copy)."""

    def copy_all(self, pairs: Sequence[CopyPair]) -> None:
        raise RuntimeError("injected: copy failed")


def blocks(n: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step] for i in range(n)]


def test_a_put_whose_copy_raises_frees_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = HostTier(HostTierConfig(capacity=2 * LAYOUT.block_nbytes, prefault=False), LAYOUT)
    keys, data = make_keys(2), blocks(2)
    with monkeypatch.context() as patched:
        patched.setattr(slab, "engine_for_pairs", lambda pairs: FailingEngine())
        with pytest.raises(RuntimeError, match="injected"):
            tier.put(keys[:1], data[:1])
    assert tier.stats()["slots_used"] == 0  # was 1: the slot leaked
    assert len(tier) == 0
    assert tier.contains(keys) == [False, False]
    assert tier.put(keys, data) == [True, True]  # the whole slab is there for the next put
    outs = [torch.empty_like(b) for b in data]
    assert tier.get(keys, outs) == [True, True]
    assert all(torch.equal(out, block) for out, block in zip(outs, data, strict=True))
    tier.close()
