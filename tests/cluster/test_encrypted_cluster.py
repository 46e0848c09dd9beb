"""Encryption at rest in a cluster: three kvstore-server nodes sharing one Redis index and
one S3 bucket, every node with the same keyring. A block stored on node A rests sealed on
A's disk and in the bucket, and is fetched byte-exact (whole and by layers) through B."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cluster_nodes import LAYOUT, NodeOptions, Nodes, blocks, eventually, read

from kvharness.keyring import new_key, write_keyring
from kvstore.cli.servers import RedisServer, S3Server
from kvstore.format.codec import read_header
from kvstore.testing.conformance import make_keys
from kvstore.tiers.files import BLOCK_SUFFIX


@pytest.fixture(scope="module")
def sealed_nodes(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, s3_server: S3Server
) -> Iterator[Nodes]:
    root = tmp_path_factory.mktemp("sealed-nodes")
    key_file = write_keyring(root / "keys.json", {"c1": new_key()}, "c1")
    group = Nodes(root, redis_server.url, False, s3_server, NodeOptions(key_file=key_file))
    group.start()
    yield group
    group.stop()


def test_blocks_rest_sealed_and_peers_read_them(sealed_nodes: Nodes, aws_env: None) -> None:
    nodes = sealed_nodes
    keys, data = make_keys(3, salt=9), blocks(3, seed=9)
    with nodes.client("a") as a, nodes.client("b") as b:
        assert all(a.put(keys, data))
        assert eventually(lambda: nodes.holders(keys)["a"] == [True] * 3)
        ok, outs = read(b, keys)
        assert ok == [True] * 3
        assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
        ranged = [torch.zeros((1, *LAYOUT.block_shape[1:]), dtype=LAYOUT.dtype) for _ in keys]
        assert b.get(keys, ranged, layers=(1, 2)) == [True] * 3
        assert all(torch.equal(r, d[1:2]) for r, d in zip(ranged, data, strict=True))
    files = list(nodes.procs["a"].workdir.rglob(f"*{BLOCK_SUFFIX}"))
    assert files and all(read_header(f.read_bytes()).key_id == "c1" for f in files)
    assert eventually(lambda: nodes.on_s3(keys))  # written through to the shared bucket
    client = nodes.s3.client()
    listing = client.list_objects_v2(Bucket=nodes.s3.bucket, Prefix=nodes.cluster.name)
    objects = [o["Key"] for o in listing.get("Contents", [])]
    assert objects
    for name in objects:
        body = client.get_object(Bucket=nodes.s3.bucket, Key=name)["Body"].read()
        assert read_header(body).key_id == "c1"
