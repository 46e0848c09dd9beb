"""Tenants across a cluster: three kvstore-server nodes with the same tenants (and one
operator token the nodes fetch from each other with). A tenant's blocks put on node A are
found through node B by that tenant, and another tenant sees, lists and deletes nothing
of them on any node; a token never opens another tenant's namespace anywhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_nodes import LAYOUT, NodeOptions, Nodes, blocks, eventually, read

from kvstore.client import Client, ClientOptions
from kvstore.errors import AccessDeniedError
from kvstore.testing.conformance import make_keys
from kvstore.testing.servers import RedisServer, S3Server

OPERATOR = "operator-token-0123456789abcdef"
A = "team-a-token-0123456789abcdef"
B = "team-b-token-0123456789abcdef"
TENANTS = {
    "team-a": {"namespaces": ["team-a"], "tokens": [{"name": "a", "token": A}]},
    "team-b": {"namespaces": ["team-b"], "tokens": [{"name": "b", "token": B}]},
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
