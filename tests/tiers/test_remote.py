"""Remote tier: the conformance suite over TCP and shared memory, a store using a server
as a tier, and failures -- a server down, bytes damaged on the wire -- as misses."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvharness.proxies.corrupting import CorruptingProxy
from kvstore import KVStore, StoreConfig
from kvstore.cli.kvserver import server_test_config
from kvstore.client.tier import RemoteTier
from kvstore.config import RemoteTierConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.server import ServerThread
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
_names = itertools.count()
_SERVER: dict[str, ServerThread] = {}


@pytest.fixture(scope="module", autouse=True)
def shared_server() -> Iterator[ServerThread]:
    work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    config = StoreConfig.from_dict(server_test_config(work, None), environ={})
    with ServerThread(config) as server:
        _SERVER["server"] = server
        yield server
    shutil.rmtree(work, ignore_errors=True)


def remote_tier(layout: KVLayout, capacity_blocks: int, shared_memory: bool) -> RemoteTier:
    """A remote tier on a namespace of its own (every test sees an empty store)."""
    config = RemoteTierConfig(
        capacity=capacity_blocks * layout.block_nbytes,
        address=_SERVER["server"].address,
        namespace=f"conformance-{next(_names)}",
        shared_memory=shared_memory,
    )
    return RemoteTier(config, layout)


class TestRemoteTierOverTCP(TierConformance):
    bounded = False  # the server evicts by itself; this tier never refuses for room

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> RemoteTier:
        return remote_tier(layout, capacity_blocks, shared_memory=False)


class TestRemoteTierThroughSharedMemory(TierConformance):
    bounded = False

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> RemoteTier:
        tier = remote_tier(layout, capacity_blocks, shared_memory=True)
        tier.client.ping()
        assert tier.client.shared_memory
        return tier


def store_config(address: str, namespace: str, **remote: object) -> dict[str, object]:
    layout = small_layout()
    return {
        "tiers": [
            {"kind": "host", "capacity": 8 * layout.block_nbytes},
            {"kind": "remote", "address": address, "namespace": namespace, **remote},
        ]
    }


def test_two_stores_share_blocks_through_a_server(shared_server: ServerThread) -> None:
    layout = small_layout()
    kv = random_blocks(layout, 4, seed=1)
    config = store_config(shared_server.address, "share")
    with KVStore(layout, config) as writer:
        keys = writer.hash_tokens(list(range(4 * layout.block_tokens)), namespace="m")
        assert writer.put(keys, kv) == 4
        assert writer.flush() == 4  # memory-only blocks go to the server
    with KVStore(layout, config) as reader:  # another process's store, say
        assert reader.lookup(keys) == 4
        assert reader.engine.datapath.where(keys[0]) == [1]  # the server holds it, not this process
        assert torch.equal(reader.get(keys), kv)


def test_a_server_that_is_down_is_a_miss_not_a_crash(kv_server: Start) -> None:
    layout = small_layout()
    server = kv_server()
    config = store_config(server.address, "down", connect_timeout=0.5, timeout=1.0)
    kv = random_blocks(layout, 2, seed=2)
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(list(range(2 * layout.block_tokens)), namespace="m")
        store.put(keys, kv)
        store.flush()
        store.evict(2)  # now only the server holds them
        server.stop()
        start = time.monotonic()
        out = torch.zeros(layout.tensor_shape(2), dtype=layout.dtype)
        assert store.get_prefix(keys, out) == 0
        assert time.monotonic() - start < 3
        assert store.stats()["tier_errors"] >= 1


def test_a_store_opens_while_its_server_is_down(kv_server: Start) -> None:
    server = kv_server()
    address = server.address
    server.stop()
    config = store_config(address, "later", connect_timeout=0.3)
    with KVStore(small_layout(), config) as store:  # no crash: an empty remote tier for now
        assert store.lookup(make_keys(1)) == 0


def test_bytes_damaged_on_the_wire_are_a_miss_never_data(shared_server: ServerThread) -> None:
    layout = small_layout(head_dim=64)  # 12 KiB blocks: chunks the proxy damages
    kv = random_blocks(layout, 3, seed=3)
    with CorruptingProxy(shared_server.address) as proxy:
        config = {
            "tiers": [
                {
                    "kind": "remote",
                    "address": proxy.address,
                    "namespace": "wire",
                    "shared_memory": False,
                }
            ]
        }
        with KVStore(layout, config) as store:
            keys = store.hash_tokens(list(range(3 * layout.block_tokens)), namespace="m")
            assert store.put(keys, kv) == 3
            proxy.corrupt = True
            out = torch.zeros(layout.tensor_shape(3), dtype=layout.dtype)
            assert store.get_prefix(keys, out) == 0  # every block failed its checksum
            assert proxy.flipped >= 3
            proxy.corrupt = False
            # The server's copies were intact all along: the books forgot them for that
            # read, but nothing was deleted there (other clients read them too).
            assert store.get_prefix(keys, out) == 3
            assert torch.equal(out, kv)


def test_damage_in_one_transfer_is_read_again(shared_server: ServerThread) -> None:
    """Transient damage costs a second read, not the server's good copy."""
    from kvstore.client import Client, ClientOptions

    layout = small_layout(head_dim=64)
    kv = random_blocks(layout, 2, seed=4)
    blocks = [kv[:, :, : layout.block_tokens], kv[:, :, layout.block_tokens :]]
    keys = make_keys(2, salt=4)
    with CorruptingProxy(shared_server.address) as proxy:
        options = ClientOptions(proxy.address, namespace="once", shared_memory=False)
        with Client(layout, options) as client:
            assert all(client.put(keys, blocks))
            proxy.corrupt, proxy.chunks_to_damage = True, 1
            outs = [torch.zeros(layout.block_shape, dtype=layout.dtype) for _ in keys]
            assert client.get(keys, outs) == [True, True]
            assert client.stats["corrupt_retries"] >= 1 and proxy.flipped >= 1
            assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))


def test_bad_remote_configs_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="HOST:PORT or unix:/path"):
        StoreConfig.from_dict({"tiers": [{"kind": "remote", "address": "nowhere"}]}, environ={})
    with pytest.raises(ConfigError, match="namespace"):
        StoreConfig.from_dict({"tiers": [{"kind": "remote", "namespace": "../etc"}]}, environ={})
    with pytest.raises(ConfigError, match="token or token_file"):
        StoreConfig.from_dict(
            {"tiers": [{"kind": "remote", "token": "x" * 20, "token_file": "/f"}]}, environ={}
        )


@pytest.mark.parametrize("shared_memory", [True, False])
def test_prefetch_into_an_inference_tensor(
    shared_server: ServerThread, shared_memory: bool
) -> None:
    """vLLM starts loads under torch.inference_mode(): the loader thread must be able to
    fill the tensor it allocated there (found with real vLLM, shared memory path)."""
    layout = small_layout()
    kv = random_blocks(layout, 3, seed=6)
    config = {
        "tiers": [
            {
                "kind": "remote",
                "address": shared_server.address,
                "namespace": f"inference-{shared_memory}",
                "shared_memory": shared_memory,
            }
        ]
    }
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(list(range(3 * layout.block_tokens)), namespace="m")
        assert store.put(keys, kv) == 3
        with torch.inference_mode():
            handle = store.prefetch(keys)
        assert handle.result() == 3 and handle.error is None
        assert handle.out is not None and torch.equal(handle.out, kv)
