"""Chunks as event blocks: stable signed 64-bit hashes, chained through the parent chunk."""

from __future__ import annotations

import pytest
import xxhash

pytest.importorskip("msgspec", reason="pip install 'kvstore-tiers[events]'")

from kvstore.config.events import EventsConfig
from kvstore.datapath.contracts import Medium
from kvstore.errors import ConfigError
from kvstore.events.blocks import BlockMapper, medium_of, parent_first, sub_block_hash
from kvstore.keys import BlockKey

A, B, C = (BlockKey(bytes([i]) * 16) for i in (1, 2, 3))


def test_sub_block_hashes_are_signed_int64_of_xxh3_of_key_and_index() -> None:
    mapper = BlockMapper(64, EventsConfig(block_size=16))
    hashes = mapper.hashes(A)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    for i, h in enumerate(hashes):
        unsigned = xxhash.xxh3_64_intdigest(A + i.to_bytes(4, "little"))
        assert isinstance(h, int) and -(2**63) <= h < 2**63
        assert h % 2**64 == unsigned == sub_block_hash(A, i) % 2**64
    assert mapper.hashes(A) == hashes and mapper.hashes(B) != hashes
    assert mapper.last_hash(A) == hashes[-1]


def test_a_stored_chunk_chains_from_its_parents_last_sub_block() -> None:
    mapper = BlockMapper(32, EventsConfig(block_size=16))
    tokens = list(range(32))
    first = mapper.stored(A, None, tokens, Medium.MEMORY)
    second = mapper.stored(B, A, tokens, Medium.DISK)
    assert first.parent_block_hash is None and first.token_ids == tokens
    assert first.block_size == 16 and (first.medium, first.locality) == ("CPU", "LOCAL")
    assert second.parent_block_hash == first.block_hashes[-1]
    assert (second.medium, second.locality) == ("STORAGE", "LOCAL")
    removed = mapper.removed([A, B], Medium.SHARED)
    assert removed.block_hashes == first.block_hashes + second.block_hashes
    assert (removed.medium, removed.locality) == ("STORAGE", "REMOTE")


def test_the_block_size_must_divide_the_chunk() -> None:
    with pytest.raises(ConfigError, match="block_size: 16 must divide"):
        BlockMapper(24, EventsConfig(block_size=16))
    assert BlockMapper(256, EventsConfig(block_size=16)).per_chunk == 16


def test_media_and_parent_first_order() -> None:
    assert medium_of(Medium.MEMORY) == ("CPU", "LOCAL")
    parents = {C: B, B: A, A: None}
    assert parent_first([C, A, B], parents.get) == [A, B, C]
    assert parent_first([C, B], parents.get) == [B, C]  # A outside: not added
    assert parent_first([], parents.get) == []
