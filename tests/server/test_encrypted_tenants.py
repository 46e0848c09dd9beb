"""Encryption at rest on a kvstore-server with two tenants, each with its own key: every
tenant's blocks rest sealed under its own key id, bound to their namespace, and a block
placed where another namespace reads it (another tenant's, or another of the same
tenant's) is a miss counted in ``decrypt_failures``, never data."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharness.keyring import new_key
from kvstore import StoreConfig
from kvstore.cli.kvserver import server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.format.codec import read_header
from kvstore.format.sealing import use_tenant_resolver
from kvstore.keys import BlockKey
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import block_list, small_layout
from kvstore.tiers.files import BLOCK_SUFFIX

LAYOUT = small_layout()
A_RW = "a-rw-token-0123456789abcdef"
B_RW = "b-rw-token-0123456789abcdef"
TENANTS = {
    "team-a": {"namespaces": ["team-a", "team-a-eval"], "tokens": [{"name": "a", "token": A_RW}]},
    "team-b": {"namespaces": ["team-b"], "tokens": [{"name": "b", "token": B_RW}]},
}
#: Each tenant's one key id (``default``: the namespaces no tenant owns).
KEY_IDS = {"default": "d1", "team-a": "a1", "team-b": "b1"}


def keyring() -> str:
    """A keyring document: each tenant of :data:`KEY_IDS` with a fresh key of its own."""
    tenants = {t: {"active": kid, "keys": {kid: new_key()}} for t, kid in KEY_IDS.items()}
    return json.dumps({"tenants": tenants})


@pytest.fixture(params=["key_file", "key_env"])
def server(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ServerThread, Path]]:
    """A server whose only tier is an encrypted disk, its keyring in a file or a variable;
    and the disk tier's directory (``ns-<namespace>`` under it)."""
    if request.param == "key_file":
        fd = os.open(tmp_path / "keys.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(keyring())
        section = {"key_file": str(tmp_path / "keys.json"), "tiers": ["disk"]}
    else:
        monkeypatch.setenv("TEST_TENANT_KEYRING", keyring())
        section = {"key_env": "TEST_TENANT_KEYRING", "tiers": ["disk"]}
    work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")  # a short Unix socket path
    config = server_test_config(work, [{"kind": "disk", "capacity": "256MiB"}], tenants=TENANTS)
    config["encryption"] = section
    thread = ServerThread(StoreConfig.from_dict(config, environ={})).start()
    try:
        yield thread, Path(work) / "disk"
    finally:
        thread.stop()
        use_tenant_resolver(None)  # the server installed its tenants' mapping
        shutil.rmtree(work, ignore_errors=True)


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def client(server: ServerThread, token: str, namespace: str) -> Client:
    return Client(LAYOUT, ClientOptions(server.address, namespace, token.encode()))


def block_file(disk: Path, namespace: str, key: BlockKey) -> Path:
    return next((disk / f"ns-{namespace}").rglob(f"{key.hex()}{BLOCK_SUFFIX}"))


def disk_stats(c: Client) -> dict[str, Any]:
    """The encrypted disk tier's stats of ``c``'s namespace's store."""
    stores = [s for s in c.server_stats()["stores"] if s["namespace"] == c.options.namespace]
    assert len(stores) == 1, stores
    tier: dict[str, Any] = stores[0]["tiers"][0]
    assert tier["kind"] == "disk"
    return tier


def put_and_read(c: Client, keys: list[BlockKey], seed: int) -> list[torch.Tensor]:
    data = block_list(LAYOUT, len(keys), seed)
    assert c.put(keys, data, durable=True) == [True] * len(keys)
    outs = [torch.zeros_like(d) for d in data]
    assert c.get(keys, outs) == [True] * len(keys)
    assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
    return data


def test_each_tenant_seals_with_its_own_key(server: tuple[ServerThread, Path]) -> None:
    thread, disk = server
    keys = make_keys(3, salt=21)  # the same block keys in both tenants' namespaces
    with client(thread, A_RW, "team-a") as a, client(thread, B_RW, "team-b") as b:
        put_and_read(a, keys, seed=1)
        put_and_read(b, keys, seed=2)
        for c, tenant in ((a, "team-a"), (b, "team-b")):
            stats = disk_stats(c)
            assert (stats["tenant"], stats["namespace"]) == (tenant, tenant)
            assert stats["active_key"] == KEY_IDS[tenant] and stats["sealed"] == 3
    for namespace, key_id in (("team-a", "a1"), ("team-b", "b1")):
        files = list((disk / f"ns-{namespace}").rglob(f"*{BLOCK_SUFFIX}"))
        assert len(files) == 3
        assert {read_header(f.read_bytes()).key_id for f in files} == {key_id}


def test_a_block_placed_in_another_namespace_is_a_counted_miss(
    server: tuple[ServerThread, Path],
) -> None:
    """Team A's sealed files copied into team B's namespace, and into team A's other one
    (same tenant, same key: only the namespace tells them apart), before those stores
    open: each store finds them on its disk and reads none of them as data."""
    thread, disk = server
    keys = make_keys(2, salt=22)
    with client(thread, A_RW, "team-a") as a:
        mine = put_and_read(a, keys, seed=3)
    for target in ("team-b", "team-a-eval"):
        for key in keys:
            src = block_file(disk, "team-a", key)
            dst = disk / f"ns-{target}" / src.relative_to(disk / "ns-team-a")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    with client(thread, B_RW, "team-b") as b, client(thread, A_RW, "team-a-eval") as eval_:
        for c in (b, eval_):
            assert eventually(lambda c=c: c.lookup(keys) == 2)  # found on its disk ...
            outs = [torch.zeros_like(d) for d in mine]
            assert c.get(keys, outs) == [False, False]  # ... but not its data
            assert not any(torch.equal(o, d) for o, d in zip(outs, mine, strict=True))
            stats = disk_stats(c)
            assert stats["decrypt_failures"] == 2 and stats.get("corrupt", 0) == 0
        assert all(block_file(disk, "team-b", k).exists() for k in keys)  # kept
        put_and_read(b, keys, seed=4)  # the engine recomputes and puts: sealed under b1
    files = [block_file(disk, "team-b", k) for k in keys]
    assert {read_header(f.read_bytes()).key_id for f in files} == {"b1"}
    with client(thread, A_RW, "team-a") as a:
        outs = [torch.zeros_like(d) for d in mine]
        assert a.get(keys, outs) == [True, True]  # team A's own still read
        assert all(torch.equal(o, d) for o, d in zip(outs, mine, strict=True))
        assert disk_stats(a)["decrypt_failures"] == 0
