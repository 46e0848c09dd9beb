"""The rig of the convergence tests: a store publishing KV events under churn, faults
and restarts, and the truth its tiers hold (tests/events/test_convergence*.py)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvharness.event_view import EventView, compare, held_media
from kvstore import KVStore
from kvstore.cli.servers import free_port
from kvstore.config import StoreConfig
from kvstore.datapath.contracts import Medium
from kvstore.errors import CapacityError
from kvstore.events.blocks import BlockMapper
from kvstore.keys import BlockKey
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import FaultyTier
from kvstore.tiers import create_tier

LAYOUT = small_layout()
BT = LAYOUT.block_tokens
#: Tokens per published block (two a chunk).
BLOCK = BT // 2


def events_config(tmp_path: Path) -> dict[str, Any]:
    """Events on free ports, heartbeats every 0.2 s, a token journal in ``tmp_path``."""
    first = free_port()
    second = next(p for p in iter(free_port, None) if p != first)
    return {
        "enabled": True,
        "endpoint": f"tcp://127.0.0.1:{first}",
        "replay_endpoint": f"tcp://127.0.0.1:{second}",
        "heartbeat_s": 0.2,
        "block_size": BLOCK,
        "token_journal": str(tmp_path / "tokens.journal"),
    }


def opened_rig(tmp_path: Path) -> Iterator[Rig]:
    """A fixture's body: a :class:`Rig` on free ports in ``tmp_path``, closed after."""
    rig = Rig(tmp_path, events_config(tmp_path))
    rig.open()
    try:
        yield rig
    finally:
        rig.close()


@dataclass
class Rig:
    """A store with a host tier (small: blocks demote to disk all the time) over a disk
    tier, both behind fault switches, publishing its events; reopened on the same disk."""

    path: Path
    events: dict[str, Any]
    store: KVStore | None = None
    faulty: list[FaultyTier] = field(default_factory=list)
    announced: set[BlockKey] = field(default_factory=set)

    def config(self) -> dict[str, Any]:
        return {
            "tiers": [
                {"kind": "host", "capacity": 12 * LAYOUT.block_nbytes},
                {"kind": "disk", "path": str(self.path / "disk"), "capacity": "64MiB"},
            ],
            "events": self.events,
        }

    def open(self) -> KVStore:
        tiers = StoreConfig.from_dict(self.config()).tiers
        self.faulty = [FaultyTier(create_tier(t, LAYOUT), seed=i) for i, t in enumerate(tiers)]
        self.store = KVStore(LAYOUT, self.config(), tiers=self.faulty)
        return self.store

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def truth(self) -> dict[int | bytes, str]:
        assert self.store is not None
        mapper = BlockMapper(BT, StoreConfig.from_dict(self.config()).events)
        media = [(self.faulty[0], Medium.MEMORY), (self.faulty[1].inner, Medium.DISK)]
        return held_media(media, mapper, self.announced)


def churn(
    rig: Rig, rng: random.Random, steps: int, on_step: Callable[[int], None]
) -> list[list[int]]:
    """Prompts of 1-6 chunks sharing prefixes (put with their tokens), gets, evictions
    from memory, and now and then a clear; ``on_step`` injects the faults. The prompts."""
    prompts = [[rng.randrange(50_000) for _ in range(8 * BT)] for _ in range(6)]
    for step in range(steps):
        on_step(step)
        store = rig.store
        assert store is not None
        tokens = rng.choice(prompts)[: rng.randint(1, 6) * BT]
        keys = store.hash_tokens(tokens, namespace="m")
        action = rng.random()
        if action < 0.6:
            kv = random_blocks(LAYOUT, len(keys), seed=step)
            store.put(keys, kv, tokens=tokens)
            rig.announced.update(keys)
        elif action < 0.85:
            out = torch.empty(LAYOUT.tensor_shape(len(keys)), dtype=LAYOUT.dtype)
            store.get_prefix(keys, out, plan=False)
        elif action < 0.98:
            with contextlib.suppress(CapacityError):  # fewer than that in memory
                store.evict(rng.randint(1, 4), tier=0)
        else:
            store.clear()
    return prompts


def converged(rig: Rig, view: EventView, timeout: float = 20.0) -> dict[str, int]:
    """Wait (flushing the store, then a heartbeat) until the view equals the truth;
    the differences left at the timeout otherwise."""
    assert rig.store is not None
    rig.store.flush()
    deadline = time.monotonic() + timeout
    while True:
        diff = compare(view.view(), rig.truth())
        if diff.none or time.monotonic() > deadline:
            return diff.counts()
        time.sleep(0.2)


def soak(rig: Rig, views: list[EventView], steps: int = 200, seed: int = 7) -> list[list[int]]:
    """``steps`` of churn: for a while the disk refuses blocks and fails batch writes,
    the subscribers restart twice (all of it again from the replay socket), the store
    restarts once on its disk; then the faults stop. The prompts used, for queries."""
    rng = random.Random(seed)

    def faults(step: int) -> None:
        disk = rig.faulty[1]
        disk.put_drop = 0.2 if 40 <= step < 120 else 0.0  # blocks a full disk refuses
        disk.put_error = 0.1 if 60 <= step < 100 else 0.0  # a failing batch write
        if step in (50, 150):
            for view in views:
                view.restart()
        if step == 100:  # the journal names the tokens of what the disk kept
            rig.close()
            rig.open()

    prompts = churn(rig, rng, steps, faults)
    for tier in rig.faulty:
        tier.put_drop = tier.put_error = 0.0
    return prompts


def dynamo_prefix(rig: Rig, tokens: list[int]) -> int:
    """Tokens of ``tokens``' prefix Dynamo's indexer should match from the truth: leading
    published blocks held, walking from CPU down to STORAGE, never back up."""
    assert rig.store is not None
    truth = rig.truth()
    mapper = BlockMapper(BT, StoreConfig.from_dict(rig.config()).events)
    keys = rig.store.hash_tokens(tokens[: len(tokens) // BT * BT], namespace="m")
    rank, matched = 0, 0
    for key in keys:
        for h in mapper.hashes(key):
            medium = truth.get(h)
            if medium is None or _RANK[medium] < rank:
                return matched
            rank, matched = _RANK[medium], matched + BLOCK
    return matched


_RANK = {"CPU": 1, "STORAGE": 2}
