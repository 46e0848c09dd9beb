"""The vLLM connector's KV events without vLLM: what the scheduler side announces when a
lookup finds chunks or the workers save them, what it withdraws, and what it announces
again after a restart (kvstore.connectors.vllm_events)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config.events import EventsConfig
from kvstore.datapath.contracts import Medium
from kvstore.keys import chain_keys, tokens_to_bytes

pytest.importorskip("msgspec")

from kvstore.connectors.vllm_events import ConnectorEvents
from kvstore.events.format import BlockRemoved, BlockStored

CHUNK, BLOCK = 32, 16
SEED = b"\x01" * 16


def _keys(tokens: list[int]) -> list[bytes]:
    return list(chain_keys(tokens_to_bytes(tokens), CHUNK, SEED))


def _events(journal: Path | None = None) -> ConnectorEvents:
    config = EventsConfig(
        enabled=True,
        block_size=BLOCK,
        token_journal=None if journal is None else str(journal),
    )
    return ConnectorEvents(CHUNK, config, Medium.DISK)


def test_chunks_found_or_saved_are_announced_once_parents_first() -> None:
    events = _events()
    tokens = list(range(3 * CHUNK))
    keys = _keys(tokens)
    events.held(keys[:1], tokens[:CHUNK])  # a lookup found the first chunk
    events.held(keys, tokens)  # the workers saved the rest
    events.held(keys, tokens)  # nothing new
    got = events.take()
    assert [type(e) for e in got] == [BlockStored] * 3
    assert [t for e in got for t in e.token_ids] == tokens
    assert all(len(e.block_hashes) == CHUNK // BLOCK and e.block_size == BLOCK for e in got)
    assert got[0].parent_block_hash is None
    assert got[1].parent_block_hash == got[0].block_hashes[-1]
    assert got[2].parent_block_hash == got[1].block_hashes[-1]
    assert {(e.medium, e.locality) for e in got} == {("STORAGE", "LOCAL")}
    assert events.take() == []


def test_only_announced_chunks_found_gone_are_withdrawn() -> None:
    events = _events()
    tokens = list(range(2 * CHUNK))
    keys = _keys(tokens)
    events.held(keys, tokens)
    stored = events.take()
    events.gone([*keys[1:], b"\x09" * 16])  # one never announced
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == stored[1].block_hashes
    events.gone(keys[1:])
    assert events.take() == []  # withdrawn once
    events.held(keys, tokens)
    assert [e.block_hashes for e in events.take()] == [stored[1].block_hashes]


def test_a_restarted_scheduler_announces_what_the_store_still_holds(tmp_path: Path) -> None:
    journal = tmp_path / "tokens.journal"
    first = _events(journal)
    tokens = list(range(3 * CHUNK))
    keys = _keys(tokens)
    first.held(keys, tokens)
    before = first.take()
    first.close()
    again = _events(journal)
    assert again.restore(lambda ks: [k != keys[2] for k in ks]) == 2  # chunk 2 was evicted
    got = again.take()
    assert [e.block_hashes for e in got] == [e.block_hashes for e in before[:2]]
    assert [t for e in got for t in e.token_ids] == tokens[: 2 * CHUNK]
    again.close()
    third = _events(journal)
    assert third.restore(lambda ks: [True] * len(ks)) == 2  # the evicted one was forgotten
    third.close()
