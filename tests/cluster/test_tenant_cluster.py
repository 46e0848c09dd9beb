"""Tenants across a cluster: three kvstore-server nodes with the same tenants (and one
operator token the nodes fetch from each other with). A tenant's blocks put on node A are
found through node B by that tenant, and another tenant sees, lists and deletes nothing
of them on any node; a token never opens another tenant's namespace anywhere; a hot
block's replica counts against its tenant's quota on the node that holds it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_nodes import LAYOUT, NodeOptions, Nodes, blocks, eventually, read

from kvstore.cli.servers import RedisServer, S3Server
from kvstore.client import Client, ClientOptions
from kvstore.errors import AccessDeniedError
from kvstore.testing.conformance import make_keys

OPERATOR = "operator-token-0123456789abcdef"
A = "team-a-token-0123456789abcdef"
B = "team-b-token-0123456789abcdef"
BLOCK = LAYOUT.block_nbytes
TENANTS = {
    "team-a": {"namespaces": ["team-a"], "tokens": [{"name": "a", "token": A}]},
    "team-b": {
        "namespaces": ["team-b"],
        "tokens": [{"name": "b", "token": B}],
        "quotas": {"host": {"share": 0, "limit": 2 * BLOCK}},  # per node
    },
}


@pytest.fixture(scope="module")
def tenant_nodes(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, s3_server: S3Server
) -> Iterator[Nodes]:
    root = tmp_path_factory.mktemp("tenant-nodes")
    options = NodeOptions(tokens=dict.fromkeys("abc", OPERATOR), server={"tenants": TENANTS})
    group = Nodes(root, redis_server.url, False, s3_server, options)
    group.start()
    yield group
    group.stop()


def client(nodes: Nodes, node: str, token: str, namespace: str) -> Client:
    options = ClientOptions(
        nodes.procs[node].address, namespace, token.encode(), shared_memory=False
    )
    return Client(LAYOUT, options)


def test_a_tenants_blocks_cross_nodes_for_it_alone(tenant_nodes: Nodes, aws_env: None) -> None:
    nodes = tenant_nodes
    keys, data = make_keys(3, salt=21), blocks(3, seed=21)
    with client(nodes, "a", A, "team-a") as a_on_a:
        assert all(a_on_a.put(keys, data))
    with client(nodes, "b", A, "team-a") as a_on_b:
        assert eventually(lambda: a_on_b.lookup(keys) == 3)  # through the cluster
        assert read(a_on_b, keys)[0] == [True] * 3
    for node in "abc":
        with client(nodes, node, B, "team-b") as b:
            assert b.exists(keys) == [False] * 3 and b.lookup(keys) == 0
            assert read(b, keys)[0] == [False] * 3
            assert b.delete(keys) == 0 and b.list_keys() == []
            assert {s["namespace"] for s in b.server_stats()["stores"]} <= {"team-b"}
    with client(nodes, "c", A, "team-a") as a_on_c:
        assert eventually(lambda: a_on_c.lookup(keys) == 3)  # team-b deleted nothing


def test_a_token_opens_no_other_tenants_namespace_on_any_node(tenant_nodes: Nodes) -> None:
    for node in "abc":
        for token, namespace in ((A, "team-b"), (B, "team-a"), (B, "default")):
            with (
                client(tenant_nodes, node, token, namespace) as c,
                pytest.raises(AccessDeniedError),
            ):
                c.ping()


def test_a_replica_counts_against_the_tenant_that_owns_the_block(
    tenant_nodes: Nodes, aws_env: None
) -> None:
    """team-b is at its host limit on node b (2 blocks) when one of its blocks on node a
    gets hot through b: b's copy of it reserves room under team-b's quota there, so
    team-b's own blocks on b make way (evicted to b's disk), not team-a's."""
    nodes = tenant_nodes
    mine, hot = make_keys(2, salt=31), make_keys(1, salt=32)
    with client(nodes, "b", B, "team-b") as b_on_b, client(nodes, "b", A, "team-a") as a_on_b:
        assert all(a_on_b.put(make_keys(3, salt=33), blocks(3, seed=33)))
        assert all(b_on_b.put(mine, blocks(2, seed=31)))

        def host(token_client: Client, tenant: str) -> dict[str, int]:
            return dict(token_client.server_stats()["tenants"][tenant]["tiers"]["host"])

        assert host(b_on_b, "team-b")["blocks"] == 2
        team_a = host(a_on_b, "team-a")["blocks"]
        with client(nodes, "a", B, "team-b") as b_on_a:
            assert all(b_on_a.put(hot, blocks(1, seed=32)))
        assert eventually(lambda: nodes.holders(hot, "team-b")["a"] == [True])
        for _ in range(4):  # fetched through b often enough to be hot (threshold 3)
            assert read(b_on_b, hot)[0] == [True]
        assert eventually(lambda: nodes.holders(hot, "team-b")["b"] == [True])  # b's replica
        figures = b_on_b.server_stats()["tenants"]["team-b"]
        assert figures["tiers"]["host"]["blocks"] == 2  # the limit held for the replica
        assert figures["evictions"] >= 1  # one of team-b's own blocks made way
        assert host(a_on_b, "team-a")["blocks"] == team_a  # team-a lost nothing
        assert b_on_b.lookup(mine) == 2  # on b's disk
