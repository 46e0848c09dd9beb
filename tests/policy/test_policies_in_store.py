"""Eviction policies chosen by name in a tier's config, working inside a real KVStore.

A hot prefix (a system prompt) is served between scans of one-off documents
bigger than the tier: LRU loses the prefix to every scan, S3-FIFO and ARC
keep it. Hot-block replication is off so the policy alone decides.
"""

from __future__ import annotations

import pytest
import torch

from kvharness.traces import TraceSpec, generate_trace, replay, trace_layout
from kvstore import KVStore
from kvstore.errors import ConfigError
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()
CAPACITY = 40  # blocks
HOT_CHUNKS = 8
DOC_CHUNKS = 30


def make_store(policy: str, blocks: int = CAPACITY) -> KVStore:
    tier = {"kind": "host", "capacity": blocks * LAYOUT.block_nbytes, "policy": policy}
    return KVStore(LAYOUT, {"tiers": [tier], "replication": {"enabled": False}})


def serve(store: KVStore, tokens: torch.Tensor) -> int:
    """One request, as an engine makes it: lookup, load the hit prefix, store the rest."""
    keys = store.hash_tokens(tokens, "model")
    n = store.lookup(keys)
    if n:
        n = store.get_prefix(keys[:n], torch.empty(LAYOUT.tensor_shape(n), dtype=LAYOUT.dtype))
    for start in range(n, len(keys), 8):
        part = keys[start : start + 8]
        store.put(part, random_blocks(LAYOUT, len(part), seed=start))
    return n


def hot_hits_between_scans(policy: str, rounds: int = 5) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    bt = LAYOUT.block_tokens
    hot = torch.randint(0, 50_000, (HOT_CHUNKS * bt,), generator=gen)
    hits = []
    with make_store(policy) as store:
        serve(store, hot)
        serve(store, hot)  # read once: no longer a one-off
        for _ in range(rounds):
            for _ in range(3):  # 90 one-off chunks: more than the tier holds
                serve(store, torch.randint(0, 50_000, (DOC_CHUNKS * bt,), generator=gen))
            hits.append(serve(store, hot))
        assert len(store.engine.datapath) <= CAPACITY
    return hits


@pytest.mark.parametrize("policy", ["s3fifo", "arc"])
def test_scan_resistant_policy_keeps_the_hot_prefix(policy):
    assert hot_hits_between_scans(policy) == [HOT_CHUNKS] * 5


def test_lru_loses_the_hot_prefix_to_each_scan():
    assert hot_hits_between_scans("lru") == [0] * 5


def test_policy_names_are_checked_in_the_config():
    with pytest.raises(ConfigError, match="s3fifo"):  # the message lists the known ones
        make_store("s4fifo")
    with make_store("s3fifo") as store:
        assert store.config.tiers[0].policy == "s3fifo"


def test_trace_replay_through_the_store():
    spec = TraceSpec(sessions=4, active_sessions=4, turns=(3, 4), burst_probability=0.3)
    trace = generate_trace(spec)
    assert generate_trace(spec).requests[5].tokens.tolist() == trace.requests[5].tokens.tolist()
    layout = trace_layout(spec)
    results = {}
    for policy in ("lru", "s3fifo"):
        tier = {"kind": "host", "capacity": 300 * layout.block_nbytes, "policy": policy}
        with KVStore(layout, {"tiers": [tier], "replication": {"enabled": False}}) as store:
            results[policy] = replay(store, trace)
    for result in results.values():
        assert result.looked_up["chat"] + result.looked_up["doc"] == trace.chunks()
        assert result.hit["doc"] == 0  # documents are never sent twice
        assert 0 < result.hit_rate("chat") < 1 and 0 < result.hit_rate("system") <= 1
        assert result.distinct <= trace.chunks()
    assert results["s3fifo"].hit_rate() >= results["lru"].hit_rate()
