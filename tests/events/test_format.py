"""The msgspec structs encode what vLLM 0.32.0's kv_events structs encode."""

from __future__ import annotations

import subprocess
import sys

import pytest

msgspec = pytest.importorskip("msgspec", reason="pip install 'kvstore-tiers[events]'")

from kvstore.events.format import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)


def stored(**extra: object) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": [-1, 2**63 - 1],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    fields.update(extra)
    return BlockStored(**fields)  # type: ignore[arg-type]


def test_a_batch_is_an_array_and_events_are_tagged_maps_without_defaults() -> None:
    events = [
        stored(locality="LOCAL"),
        BlockRemoved(block_hashes=[5], medium="STORAGE"),
        AllBlocksCleared(),
    ]
    raw = msgspec.msgpack.decode(encode_batch(1.5, events, None))
    assert raw[0] == 1.5 and raw[2] is None  # [ts, events, data_parallel_rank]
    first, second, third = raw[1]
    assert list(first) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
        "lora_id", "medium", "lora_name", "locality",
    ]  # fmt: skip
    assert first["type"] == "BlockStored" and first["block_hashes"] == [-1, 2**63 - 1]
    assert second == {"type": "BlockRemoved", "block_hashes": [5], "medium": "STORAGE"}
    assert third == {"type": "AllBlocksCleared"}
    assert msgspec.msgpack.decode(encode_batch(2.0, [], 3)) == [2.0, [], 3]


def test_decode_gives_back_the_batch() -> None:
    events = [stored(parent_block_hash=7, session_id="s"), AllBlocksCleared()]
    batch = decode_batch(encode_batch(3.25, events, 1))
    assert isinstance(batch, KVEventBatch)
    assert batch.ts == 3.25 and batch.data_parallel_rank == 1
    assert batch.events == events


def test_importing_the_package_loads_neither_zmq_nor_msgspec() -> None:
    code = (
        "import sys, kvstore.events as e; from kvstore.config.events import EventsConfig; "
        "e.TokenBook(16); assert 'zmq' not in sys.modules and 'msgspec' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_missing_dependency_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['zmq'] = None\n"
        "from kvstore.errors import ConfigError\n"
        "try:\n    from kvstore.events import EventPublisher\n"
        "except ConfigError as exc:\n"
        "    assert \"pip install 'kvstore-tiers[events]'\" in str(exc), exc\n"
        "else:\n    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
