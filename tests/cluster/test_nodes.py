"""Three kvstore-server processes on loopback ports, one real redis-server (or a 3-node Redis
Cluster) for the shared index, one S3 endpoint (moto) as the shared cold tier.

A block stored on node A is found and fetched byte-exact through node B; routing ranks the
nodes by the prefix they hold; a hot block gets a copy on a second node and loses it once it
cools down; node A killed mid-run: B serves A's blocks from S3 and A's entries expire; a
node that stops answering is skipped; Redis restarted mid-run: the nodes work on and
register their blocks again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from cluster_nodes import HEARTBEAT, LAYOUT, Nodes, blocks, eventually, read

from kvstore import KVStore
from kvstore.cli.servers import RedisServer
from kvstore.cluster.router import NodeRank
from kvstore.testing.conformance import make_keys
from kvstore.wire.protocol import SlotStatus


def test_a_block_stored_on_a_is_fetched_byte_exact_through_b(nodes: Nodes) -> None:
    keys, data = make_keys(4, salt=1), blocks(4, seed=1)
    with nodes.client("a") as a, nodes.client("b") as b, nodes.client("c") as c:
        assert all(a.put(keys, data))
        assert eventually(lambda: nodes.holders(keys)["a"] == [True] * 4)
        assert b.exists(keys) == [True] * 4  # b's server asked the index
        for client in (b, c):
            ok, outs = read(client, keys)
            assert ok == [True] * 4
            assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
        ranged = [torch.zeros((1, *LAYOUT.block_shape[1:]), dtype=LAYOUT.dtype) for _ in keys]
        assert b.get(keys, ranged, layers=(2, 3)) == [True] * 4  # layer by layer from a peer
        assert all(torch.equal(r, d[2:3]) for r, d in zip(ranged, data, strict=True))
        tiers = b.server_stats()["stores"][0]["tiers"]
    assert [t["kind"] for t in tiers] == ["host", "disk", "cluster", "s3"]
    assert tiers[2]["fetched"] >= 4  # from a's server, not from S3


def test_an_in_process_store_with_a_cluster_config_reads_from_the_nodes(nodes: Nodes) -> None:
    """No server of its own: the cluster is just its last tier (prefix lookup, then
    layer-by-layer prefetch from the node that holds the blocks)."""
    keys, data = make_keys(3, salt=8), blocks(3, seed=8)
    with nodes.client("c") as c:
        assert all(c.put(keys, data))
    cluster = {**nodes.cluster.to_dict(), "node_id": "in-process"}
    config = {"tiers": [{"kind": "host", "capacity": "4MiB"}], "cluster": cluster}
    with KVStore(LAYOUT, config) as store:
        assert eventually(lambda: store.lookup(keys) == 3)
        handle = store.prefetch(keys)
        assert handle.result() == 3
        assert handle.out is not None
        assert torch.equal(handle.out, torch.cat(data, dim=2))
        assert [t.kind for t in store.engine.datapath.tiers] == ["host", "cluster"]


def test_routing_ranks_nodes_by_the_prefix_they_hold(nodes: Nodes, aws_env: None) -> None:
    """c computed a prompt's first 2 chunks, then a the whole prompt: a can load all 6
    (its own, and c's 2 from the bucket where a's put found them there and left them
    PRESENT: whether it does depends on when a last listed the bucket), c its first 2
    from memory and the other 4 from the bucket (a's write-through put them there, and the
    index knows it as soon as they land: issue 50), b nothing of its own."""
    keys, data = make_keys(6, salt=2), blocks(6, seed=2)
    with nodes.client("a") as a, nodes.client("c") as c:
        assert c.put_statuses(keys[:2], data[:2]) == [SlotStatus.STORED] * 2
        assert eventually(lambda: nodes.holders(keys[:2])["c"] == [True, True])
        assert eventually(lambda: nodes.on_s3(keys[:2]))
        statuses = a.put_statuses(keys, data)
    assert statuses[2:] == [SlotStatus.STORED] * 4
    assert set(statuses[:2]) <= {SlotStatus.STORED, SlotStatus.PRESENT}

    def loadable(rank: NodeRank) -> int:
        return rank.memory_blocks + rank.disk_blocks + rank.shared_blocks

    with nodes.router() as router:
        # The index first, each node's speeds with a later heartbeat.
        assert eventually(
            lambda: (
                (first := router.rank(keys)[0]).node_id == "a"
                and loadable(first) == 6
                and first.ready_ms is not None
            )
        )
        ranked = router.rank(keys)
        assert [r.node_id for r in ranked] == ["a", "c", "b"]
        assert ranked[0].memory_blocks >= 4  # its own; c's 2 too where it stored them
        assert (ranked[1].prefix_blocks, ranked[1].memory_blocks) == (2, 2)
        assert ranked[2].prefix_blocks == 0
        assert router.best(make_keys(3, salt=99)) is not None  # nobody holds it: any node
        # Each node publishes its tiers' read speeds: a's load of the prompt, in ms.
        assert ranked[0].restore_ms is not None and ranked[0].restore_ms > 0
        assert ranked[0].ready_ms == ranked[0].restore_ms  # nothing left to recompute
        assert eventually(lambda: router.rank(keys)[1].shared_blocks == 4)  # a's, in S3
        ranked = router.rank(keys)
        assert ranked[1].node_id == "c" and ranked[1].memory_blocks == 2
        assert ranked[1].ready_ms == ranked[1].restore_ms  # c loads all 6: none to recompute
        assert ranked[2].shared_blocks == 6 and ranked[2].prefix_blocks == 0  # b: S3 only


def test_a_hot_block_gets_a_replica_that_goes_when_it_cools(nodes: Nodes, aws_env: None) -> None:
    keys, data = make_keys(1, salt=3), blocks(1, seed=3)
    with nodes.client("a") as a, nodes.client("b") as b, nodes.client("c") as c:
        assert all(a.put(keys, data))
        assert eventually(lambda: nodes.holders(keys)["a"] == [True])
        for _ in range(4):  # fetched through b often enough to be hot (threshold 3)
            assert read(b, keys)[0] == [True]
        assert eventually(lambda: nodes.holders(keys)["b"] == [True])  # b copied it
        for _ in range(4):  # hot through c too, but a and b hold it: replicas=2 reached
            assert read(c, keys)[0] == [True]
        time.sleep(4 * HEARTBEAT)
        assert nodes.holders(keys)["c"] == [False]
        # No fetches any more: heat halves each second; below 1.5 the replica goes.
        assert eventually(
            lambda: nodes.holders(keys) == {"a": [True], "b": [False], "c": [False]}, 15
        )
        ok, outs = read(b, keys)
        assert ok == [True] and torch.equal(outs[0], data[0])
        # b gave up only its own copy: the block's copy in the shared bucket is still
        # there (it once went with it, and a node that lost its copy lost the block).
        assert nodes.on_s3(keys)


def test_node_killed_mid_run_b_serves_from_s3_and_its_entries_expire(
    own_nodes: tuple[Nodes, RedisServer], aws_env: None
) -> None:
    nodes, _ = own_nodes
    keys, data = make_keys(5, salt=4), blocks(5, seed=4)
    with nodes.client("a") as a:
        assert all(a.put(keys, data))
    assert eventually(lambda: nodes.on_s3(keys))  # written through host -> disk -> S3
    nodes.procs["a"].kill()
    with nodes.client("b") as b:
        ok, outs = read(b, keys)
    assert ok == [True] * 5
    assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
    with nodes.router() as router:
        assert eventually(lambda: "a" not in {r.node_id for r in router.rank(keys)}, 5)
    assert nodes.holders(keys)["a"] == [False] * 5  # a's entries expired with its lease


def test_a_node_that_stops_answering_is_skipped(
    own_nodes: tuple[Nodes, RedisServer], aws_env: None
) -> None:
    nodes, _ = own_nodes
    keys, data = make_keys(3, salt=5), blocks(3, seed=5)
    with nodes.client("a") as a:
        assert all(a.put(keys, data))
    assert eventually(lambda: nodes.on_s3(keys))
    pid = nodes.procs["a"].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with nodes.client("b") as b:
            start = time.monotonic()
            ok, outs = read(b, keys)
            assert time.monotonic() - start < 10  # the peer deadline, then S3
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ok == [True] * 3
    assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))


def test_redis_restarted_mid_run(own_nodes: tuple[Nodes, RedisServer]) -> None:
    nodes, redis = own_nodes
    keys, data = make_keys(3, salt=6), blocks(3, seed=6)
    with nodes.client("a") as a, nodes.client("b") as b:
        assert all(a.put(keys, data))
        assert eventually(lambda: nodes.holders(keys)["a"] == [True] * 3)
        redis.kill()  # the index is gone (nothing saved): nodes serve on from their tiers
        more, more_data = make_keys(2, salt=7), blocks(2, seed=7)
        assert all(a.put(more, more_data))
        ok, outs = read(a, keys + more)
        assert ok == [True] * 5
        redis.start()  # empty: every node writes its whole set again
        assert eventually(lambda: nodes.holders(keys + more)["a"] == [True] * 5, 10)
        ok, outs = read(b, more)
        assert ok == [True] * 2
        assert all(torch.equal(o, d) for o, d in zip(outs, more_data, strict=True))


def test_kvstore_route_on_the_command_line(
    nodes: Nodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import yaml

    from kvstore.cli import main

    keys, data = make_keys(3, salt=9), blocks(3, seed=9)
    with nodes.client("b") as b:
        assert all(b.put(keys, data))
    config, keyfile = tmp_path / "cluster.yaml", tmp_path / "keys.txt"
    config.write_text(yaml.safe_dump({"cluster": nodes.cluster.to_dict()}))
    keyfile.write_text("\n".join(bytes(k).hex() for k in keys))
    layout = ["--layers", "3", "--kv-heads", "2", "--head-dim", "32", "--block-tokens", "8"]
    args = ["route", "--config", str(config), "--keys", str(keyfile), *layout, "--json"]

    def top() -> tuple[str, int]:
        assert main(args) == 0
        ranked = json.loads(capsys.readouterr().out)
        return ranked[0]["node_id"], ranked[0]["prefix_blocks"]

    assert eventually(lambda: top() == ("b", 3))
    assert main(args[:-1]) == 0
    table = capsys.readouterr().out
    assert "prefix chunks" in table and "restore ms" in table
