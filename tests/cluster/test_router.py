"""The router against a real redis-server: prefix first, then load; load_weight trades them."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.cli.servers import RedisServer
from kvstore.cluster import ClusterIndex, NodeInfo, NodeSpeeds, Router
from kvstore.config import ClusterConfig
from kvstore.datapath.contracts import Medium
from kvstore.errors import InvalidInputError
from kvstore.keys import Namespace, chain_keys, tokens_to_bytes
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import small_layout

LAYOUT = small_layout()
_names = itertools.count()


def cluster(redis_server: RedisServer) -> tuple[ClusterConfig, ClusterIndex]:
    config = ClusterConfig(redis_url=redis_server.url, name=f"r{next(_names)}", heartbeat_s=2.0)
    return config, ClusterIndex(config)


def test_prefix_first_then_load_then_weight(redis_server: RedisServer) -> None:
    config, index = cluster(redis_server)
    keys = make_keys(10)
    fp = LAYOUT.fingerprint_hex
    index.heartbeat(NodeInfo("busy", "127.0.0.1:1", load=50.0))
    index.heartbeat(NodeInfo("idle", "127.0.0.1:2", load=1.0))
    index.heartbeat(NodeInfo("empty", "127.0.0.1:3", load=0.0))
    index.add("default", fp, "busy", keys)  # the whole prompt
    index.add("default", fp, "idle", keys[:8])  # most of it
    with Router(config, LAYOUT) as router:
        ranked = router.rank(keys)
        assert [(r.node_id, r.prefix_blocks) for r in ranked] == [
            ("busy", 10),
            ("idle", 8),
            ("empty", 0),
        ]
        assert router.best(make_keys(3, salt=5)).node_id == "empty"  # a tie: least load
    with Router(config, LAYOUT, load_weight=0.1) as balanced:  # 50 req/s cost 5 chunks
        assert [r.node_id for r in balanced.rank(keys)] == ["idle", "busy", "empty"]
    index.close()


def test_rank_tokens_hashes_as_the_engines_do(redis_server: RedisServer) -> None:
    config, index = cluster(redis_server)
    namespace = Namespace(model="m", layout=LAYOUT)
    tokens = list(range(5 * LAYOUT.block_tokens + 3))  # a partial chunk at the end
    keys = chain_keys(tokens_to_bytes(tokens[: 5 * LAYOUT.block_tokens]), 8, namespace.seed)
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.add("default", LAYOUT.fingerprint_hex, "a", keys[:4])
    with Router(config, LAYOUT) as router:
        assert router.rank_tokens(tokens, namespace)[0].prefix_blocks == 4
    index.close()


def test_rank_tokens_takes_a_model_name_as_every_other_api_does(
    redis_server: RedisServer,
) -> None:
    config, index = cluster(redis_server)
    tokens = list(range(4 * LAYOUT.block_tokens))
    keys = chain_keys(tokens_to_bytes(tokens), 8, Namespace(model="my-model", layout=LAYOUT).seed)
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.add("default", LAYOUT.fingerprint_hex, "a", keys[:3])
    with Router(config, LAYOUT) as router:
        assert router.rank_tokens(tokens, "my-model")[0].prefix_blocks == 3
        with pytest.raises(InvalidInputError, match="namespace"):
            router.rank_tokens(tokens, 7)  # type: ignore[arg-type]
    index.close()


def test_memory_ranks_above_disk_above_s3_above_nothing(redis_server: RedisServer) -> None:
    """Same prefix everywhere, held where it loads at different speeds: the node holding
    it in memory first, on disk second, then nodes that would read it from S3."""
    config, index = cluster(redis_server)
    keys = make_keys(8)
    fp = LAYOUT.fingerprint_hex
    for node in ("disk", "memory", "none", "half"):
        index.heartbeat(NodeInfo(node, f"127.0.0.1:{len(node)}"))
    index.add("default", fp, "disk", keys, Medium.DISK)
    index.add("default", fp, "memory", keys, Medium.MEMORY)
    index.add("default", fp, "half", keys[:4], Medium.MEMORY)
    index.publish("default", fp, "gone", {k: (Medium.DISK, Medium.SHARED) for k in keys[:6]})
    with Router(config, LAYOUT) as router:
        ranked = router.rank(keys)
        assert [r.node_id for r in ranked] == ["memory", "disk", "half", "none"]
        by = {r.node_id: r for r in ranked}
        assert (by["memory"].memory_blocks, by["memory"].merit) == (8, 8.0)
        assert (by["disk"].disk_blocks, by["disk"].merit) == (8, pytest.approx(8 * 0.6))
        # half: 4 chunks of its own, then 2 more from S3; none: 6 from S3.
        assert (by["half"].prefix_blocks, by["half"].shared_blocks) == (4, 2)
        assert by["half"].merit == pytest.approx(4 + 2 * 0.3)
        assert (by["none"].prefix_blocks, by["none"].shared_blocks) == (0, 6)
    weights = dataclasses.replace(config, route_disk_weight=0.1, route_shared_weight=0.05)
    with Router(weights, LAYOUT) as router:  # weights in config: disk now worth little
        assert [r.node_id for r in router.rank(keys)][:2] == ["memory", "half"]
    index.close()


def speeds(memory: float, disk: float, shared: float, prefill: float | None) -> NodeSpeeds:
    """A node's published speeds: GB/s of memory, disk and S3 (1 ms a call on disk, 50 on
    S3), and its prefill tokens a second."""
    report = {
        "memory": [memory, 0.0],
        "disk": [disk, 1.0],
        "shared": [shared, 50.0],
        "prefill_tokens_per_s": prefill,
    }
    return NodeSpeeds.of(report)


def test_nodes_rank_by_time_when_they_publish_their_speeds(redis_server: RedisServer) -> None:
    """The same prefix on two nodes' disks, one disk slow today: the node with the fast
    disk first, then a node that reads the prefix from S3 faster than it recomputes it,
    and the slow-disk node last, recomputing the prefix rather than loading it (246 ms
    from its disk, 100 ms of prefill) -- merit alone would rank the disks first."""
    config, index = cluster(redis_server)
    keys = make_keys(8)
    fp, nbytes = LAYOUT.fingerprint_hex, LAYOUT.block_nbytes
    rate = 640  # tokens a second: 8 chunks of 8 tokens recompute in 100 ms
    index.heartbeat(NodeInfo("fast-disk", "127.0.0.1:1", speeds=speeds(10, 1.0, 0.5, rate)))
    index.heartbeat(NodeInfo("slow-disk", "127.0.0.1:2", speeds=speeds(10, 1e-4, 0.5, rate)))
    index.heartbeat(NodeInfo("from-s3", "127.0.0.1:3", speeds=speeds(10, 1.0, 0.5, rate)))
    index.add("default", fp, "fast-disk", keys, Medium.DISK)
    index.add("default", fp, "slow-disk", keys, Medium.DISK)
    index.publish("default", fp, "gone", {k: (Medium.DISK, Medium.SHARED) for k in keys})
    with Router(config, LAYOUT) as router:
        ranked = router.rank(keys)
        assert [r.node_id for r in ranked] == ["fast-disk", "from-s3", "slow-disk"]
        by = {r.node_id: r for r in ranked}
        assert by["fast-disk"].restore_ms == pytest.approx(1.0 + 8 * nbytes / 1e9 * 1e3, rel=1e-3)
        assert by["from-s3"].restore_ms == pytest.approx(50 + 8 * nbytes / 0.5e9 * 1e3, rel=1e-3)
        assert by["from-s3"].ready_ms == by["from-s3"].restore_ms  # loading pays
        assert by["slow-disk"].restore_ms == pytest.approx(1.0 + 8 * nbytes / 1e5 * 1e3, rel=1e-3)
        assert by["slow-disk"].ready_ms == pytest.approx(100.0)  # recomputing is faster
        half = router.rank(keys[:4] + make_keys(4, salt=9))  # 4 chunks nobody holds
        recompute_ms = 4 * LAYOUT.block_tokens / rate * 1e3
        first = half[0]
        assert first.ready_ms == pytest.approx(first.restore_ms + recompute_ms, rel=1e-3)
    index.close()


def test_a_node_without_figures_keeps_the_merit_ranking(redis_server: RedisServer) -> None:
    config, index = cluster(redis_server)
    keys = make_keys(6)
    fp = LAYOUT.fingerprint_hex
    index.heartbeat(NodeInfo("timed", "127.0.0.1:1", speeds=speeds(10, 1e-4, 0.5, None)))
    index.heartbeat(NodeInfo("mute", "127.0.0.1:2"))
    index.add("default", fp, "timed", keys, Medium.DISK)
    index.add("default", fp, "mute", keys[:2], Medium.MEMORY)
    with Router(config, LAYOUT) as router:
        ranked = router.rank(keys)
        assert [r.node_id for r in ranked] == ["timed", "mute"]  # merit: 6 * 0.6 > 2
        by = {r.node_id: r for r in ranked}
        assert by["mute"].restore_ms is None and by["timed"].restore_ms is not None
        assert by["timed"].ready_ms is not None  # whole prefix held: no prefill needed
    index.close()


def test_bad_published_speeds_are_ignored() -> None:
    assert NodeSpeeds.decode("{not json") == NodeSpeeds()
    assert NodeSpeeds.decode("[1, 2]") == NodeSpeeds()
    odd = NodeSpeeds.of({"memory": [0, 1], "disk": ["x", 1], "shared": [1.0, 2.0], "x": 3})
    assert odd == NodeSpeeds((("shared", 1.0, 2.0),), None)
    assert NodeSpeeds.decode(odd.encode()) == odd


def test_ready_ms_is_the_lesser_of_loading_and_recomputing_by_the_planners_rule() -> None:
    """A node's ready time follows its restore planner (plan_restore) over its published
    speeds: chunks of 1 MB read at 1 GB/s (1 ms) behind 10 ms a call, against 5 ms of
    prefill a chunk (100 tokens at 20K tokens a second)."""
    node = NodeSpeeds((("memory", 10.0, 0.0), ("disk", 1.0, 10.0), ("shared", 0.01, 50.0)), 2e4)
    mb, ct = 1_000_000, 100
    # 2 chunks on disk: 12 ms to load, 10 ms to recompute: recomputed.
    assert node.restore_ms({"disk": 2}, mb) == pytest.approx(12.0)
    assert node.ready_ms({"disk": 2}, mb, 0, ct) == pytest.approx(10.0)
    # 4 chunks: the call's latency is paid once, 14 ms against 20 ms: loaded.
    assert node.ready_ms({"disk": 4}, mb, 0, ct) == pytest.approx(14.0)
    # On disk, then 2 chunks in a slow bucket (150 ms to load): the disk loads, the
    # bucket's chunks and the 3 unheld chunks' tokens recompute (25 ms).
    plan = node.plan({"disk": 4, "shared": 2}, mb, 3 * ct, ct)
    assert plan is not None and (plan.load, plan.tier_chunks) == (4, {1: 4})
    assert node.ready_ms({"disk": 4, "shared": 2}, mb, 3 * ct, ct) == pytest.approx(14.0 + 25.0)
    # What the memory holds is always loaded, as the planner does, however it compares.
    slow_memory = NodeSpeeds((("memory", 0.001, 0.0),), 2e4)
    assert slow_memory.ready_ms({"memory": 1}, mb, 0, ct) == pytest.approx(1000.0)
    # No prefill speed: every chunk loads; with tokens to recompute, no figure at all.
    unknown = NodeSpeeds((("disk", 1.0, 10.0),), None)
    assert unknown.ready_ms({"disk": 2}, mb, 0, ct) == pytest.approx(12.0)
    assert unknown.ready_ms({"disk": 2}, mb, ct, ct) is None
    # A medium the node reads but published no speed for: no figure.
    assert NodeSpeeds((), 2e4).ready_ms({"disk": 1}, mb, 0, ct) is None


media_speed = st.tuples(st.floats(1e-4, 100.0), st.floats(0.0, 100.0))


@settings(max_examples=500, deadline=None)
@given(
    memory=st.none() | media_speed,
    disk=st.none() | media_speed,
    shared=st.none() | media_speed,
    rate=st.none() | st.floats(10.0, 1e6),
    counts=st.tuples(st.integers(0, 600), st.integers(0, 600), st.integers(0, 600)),
    recompute=st.integers(0, 5000),
)
def test_the_closed_form_ready_time_is_the_full_plans(
    memory: tuple[float, float] | None,
    disk: tuple[float, float] | None,
    shared: tuple[float, float] | None,
    rate: float | None,
    counts: tuple[int, int, int],
    recompute: int,
) -> None:
    """Router.rank prices each node in a few operations per medium (NodeSpeeds.ready_ms),
    not with a plan per node: for any published speeds and prefix, the same ready time
    as the node's full restore plan (NodeSpeeds.plan, plan_restore over every chunk)."""
    published = tuple(
        (name, *speed)
        for name, speed in (("memory", memory), ("disk", disk), ("shared", shared))
        if speed is not None
    )
    node = NodeSpeeds(published, rate)
    chunks = dict(zip(("memory", "disk", "shared"), counts, strict=True))
    plan = node.plan(chunks, 3 << 20, recompute, 256)
    ready = node.ready_ms(chunks, 3 << 20, recompute, 256)
    if plan is None or plan.ready_s is None:
        assert ready is None
    else:
        assert ready == pytest.approx(plan.ready_s * 1e3, rel=1e-5)
