"""The README's pattern over a damaged disk file: ``n = store.lookup(keys)`` then
``store.get(keys[:n])`` returns the prefix that loaded instead of raising; the damaged
block is never returned, is counted, and is no longer claimed by ``lookup``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import BlockNotFoundError, KVLayout, KVStore
from kvstore.keys import BlockKey
from kvstore.testing.data import random_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
CHUNKS = 6


def config(path: Path) -> dict[str, Any]:
    """The embedded default's shape (host memory over disk), small, under ``path``."""
    return {
        "tiers": [
            {"kind": "host", "capacity": "1MiB", "prefault": False},
            {"kind": "disk", "path": str(path), "capacity": "4MiB"},
        ]
    }


def block_file(root: Path, key: BlockKey) -> Path:
    (found,) = root.rglob(f"{key.hex()}.kvb")
    return found


def damage(path: Path) -> None:
    """Flip the last bytes of a block file (its last layer's payload), in place."""
    data = bytearray(path.read_bytes())
    for i in range(1, 9):
        data[-i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, list[BlockKey], torch.Tensor]:
    """Six chunks written by one store and closed, so they live in the disk tier's files."""
    kv = random_blocks(LAYOUT, CHUNKS, seed=7)
    with KVStore(LAYOUT, config(tmp_path)) as store:
        keys = store.hash_tokens(list(range(CHUNKS * LAYOUT.block_tokens)), "llama-3-8b@rev")
        assert store.put(keys, kv) == CHUNKS
    return tmp_path, keys, kv


def chunks(n: int) -> slice:
    return slice(0, n * LAYOUT.block_tokens)


def test_the_readme_pattern_returns_the_intact_prefix(
    stored: tuple[Path, list[BlockKey], torch.Tensor],
) -> None:
    root, keys, kv = stored
    damage(block_file(root, keys[1]))
    with KVStore(LAYOUT, config(root)) as store:
        n = store.lookup(keys)  # leading chunks already stored (the prefix hit)
        assert n == CHUNKS  # the index knows the file; nothing has read it yet
        past = store.get(keys[:n])  # raised BlockNotFoundError ("failed to load")
        n = LAYOUT.tokens_to_blocks(past.shape[2])
        assert n == 1
        assert past.shape == LAYOUT.tensor_shape(1)
        assert torch.equal(past, kv[:, :, chunks(1)])  # block 0 intact, block 1 not in it
        stats = store.stats()
        disk = next(t for t in stats["tiers"] if t["kind"] == "disk")
        assert disk["corrupt"] == 1
        assert stats["copies_lost"] == 1
        assert stats["blocks_missed"] == CHUNKS - 1
        assert store.lookup(keys) == 1  # the damaged block is forgotten
        assert not block_file_exists(root, keys[1])  # and its file deleted
        assert store.put(keys[n:], kv[:, :, n * LAYOUT.block_tokens :]) == CHUNKS - 1
        assert torch.equal(store.get(keys[: store.lookup(keys)]), kv)  # recomputed, whole


def block_file_exists(root: Path, key: BlockKey) -> bool:
    return any(root.rglob(f"{key.hex()}.kvb"))


def test_a_damaged_first_block_is_an_empty_result(
    stored: tuple[Path, list[BlockKey], torch.Tensor],
) -> None:
    root, keys, _ = stored
    damage(block_file(root, keys[0]))
    with KVStore(LAYOUT, config(root)) as store:
        n = store.lookup(keys)
        past = store.get(keys[:n])
        assert past.shape == LAYOUT.tensor_shape(0)
        assert store.lookup(keys) == 0
        assert store.get(keys[: store.lookup(keys)]).shape == LAYOUT.tensor_shape(0)


def test_into_a_buffer_get_is_all_or_nothing_and_get_prefix_says_how_much(
    stored: tuple[Path, list[BlockKey], torch.Tensor],
) -> None:
    root, keys, kv = stored
    damage(block_file(root, keys[2]))
    with KVStore(LAYOUT, config(root)) as store:
        out = torch.zeros(LAYOUT.tensor_shape(CHUNKS), dtype=LAYOUT.dtype)
        with pytest.raises(BlockNotFoundError, match=r"block 2 .*failed to load"):
            store.get(keys, out=out)  # a buffer cannot shrink: the caller must hear
        assert store.stats()["copies_lost"] == 1
        assert store.lookup(keys) == 2
        assert store.get_prefix(keys, out, plan=False) == 2
        assert torch.equal(out[:, :, chunks(2)], kv[:, :, chunks(2)])


def test_a_key_never_stored_still_raises(
    stored: tuple[Path, list[BlockKey], torch.Tensor],
) -> None:
    root, keys, _ = stored
    with KVStore(LAYOUT, config(root)) as store:
        other = store.hash_tokens(list(range(LAYOUT.block_tokens)), "another-model")
        with pytest.raises(BlockNotFoundError, match="is not stored"):
            store.get(keys[:2] + other)
