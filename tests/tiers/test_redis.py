"""Redis tier against real redis-server processes (standalone and a 3-node Cluster).

Outages are real: the server is killed (SIGKILL) or frozen (SIGSTOP) under the
tier and brought back on the same port. Corrupt values are written with a
plain redis-py client. No client is mocked.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from kvstore import KVLayout, KVStore
from kvstore.cli.servers import RedisCluster, RedisServer, free_port, redis_command
from kvstore.config import HostTierConfig, RedisTierConfig
from kvstore.errors import InvalidInputError, LayoutMismatchError, TierError
from kvstore.format.codec import header_size
from kvstore.keys import BlockKey
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import block_list as blocks_of
from kvstore.testing.data import empty_blocks as empty
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import DAMAGES
from kvstore.testing.faults import wait_for_tier as wait_for
from kvstore.tiers.host import HostTier
from kvstore.tiers.redis import RedisTier


def redis_config(url: str, **fields: Any) -> RedisTierConfig:
    """A tier config with a fresh key prefix and short, test-sized timeouts."""
    base: dict[str, Any] = {
        "url": url,
        "key_prefix": f"r{uuid.uuid4().hex[:12]}",
        "socket_timeout": 0.5,
        "retry_interval": 0.2,
    }
    base.update(fields)
    return RedisTierConfig(**base)


@pytest.fixture
def make(redis_server: RedisServer) -> Iterator[Any]:
    """``make(layout=..., url=..., **config)`` -> a new Redis tier; all closed at the end."""
    made: list[RedisTier] = []

    def factory(layout: KVLayout | None = None, **fields: Any) -> RedisTier:
        fields.setdefault("url", redis_server.url)
        tier = RedisTier(redis_config(**fields), layout or small_layout())
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.close()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


class TestRedisTier(TierConformance):
    bounded = False  # capacity is the manager's to enforce (Redis evicts by maxmemory, not count)

    @pytest.fixture(autouse=True)
    def _on_server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> RedisTier:
        config = redis_config(self.url, capacity=capacity_blocks * layout.block_nbytes)
        return RedisTier(config, layout)


class TestRedisClusterTier(TestRedisTier):
    @pytest.fixture(autouse=True)
    def _on_server(self, redis_cluster: RedisCluster) -> None:  # type: ignore[override]
        self.url = redis_cluster.url

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> RedisTier:
        config = redis_config(
            self.url, cluster=True, capacity=capacity_blocks * layout.block_nbytes
        )
        return RedisTier(config, layout)


def test_cluster_spreads_blocks_over_the_nodes(redis_cluster: RedisCluster):
    layout = small_layout()
    tier = RedisTier(redis_config(redis_cluster.url, cluster=True), layout)
    keys = make_keys(48, salt=3)
    assert all(tier.put(keys, blocks_of(layout, 48)))
    sizes = [int(redis_command(s.port, "DBSIZE")[1:]) for s in redis_cluster.servers]
    assert sum(1 for n in sizes if n > 0) == 3, sizes
    outs = empty(layout, 48, layers=(1, 2))
    assert all(tier.get(keys, outs, layers=(1, 2)))
    assert sorted(tier.stored_keys()) == sorted(keys)
    tier.delete(keys)
    assert not any(tier.contains(keys))
    tier.close()


# -- naming, layers, TTL -----------------------------------------------------------------------
def test_key_names_and_values(make: Any, client: redis.Redis):
    layout = small_layout()
    tier = make(layout, key_prefix="names")
    key = BlockKey(bytes.fromhex("cd" * 16))
    assert tier.key_name(key) == f"names:{layout.fingerprint_hex}:{'cd' * 16}".encode()
    tier.put([key], blocks_of(layout, 1))
    value = client.get(tier.key_name(key))
    assert isinstance(value, bytes) and value[:4] == b"KVSB"
    assert client.pttl(tier.key_name(key)) == -1  # no TTL unless configured
    tier.delete([key])


def test_layer_get_reads_only_the_header_and_those_layers(make: Any):
    layout = small_layout(num_layers=8)
    tier = make(layout, codec="raw")
    keys, blocks = make_keys(2), blocks_of(layout, 2, seed=4)
    tier.put(keys, blocks)
    outs = empty(layout, 2, layers=(3, 5))
    assert tier.get(keys, outs, layers=(3, 5)) == [True, True]
    assert all(torch.equal(o, b[3:5]) for o, b in zip(outs, blocks, strict=True))
    assert tier.stats()["bytes_in"] == 2 * (header_size(8) + 2 * layout.layer_nbytes)


@pytest.mark.parametrize("codec", ["lz4", "shuffle-lz4", "auto"])
def test_compressed_values_round_trip(make: Any, codec: str):
    layout = small_layout(num_layers=4)
    tier = make(layout, codec=codec)
    keys, blocks = make_keys(3), blocks_of(layout, 3, seed=6)
    assert tier.put(keys, blocks) == [True] * 3
    outs = empty(layout, 3)
    assert tier.get(keys, outs) == [True] * 3
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    outs = empty(layout, 3, layers=(2, 4))
    assert tier.get(keys, outs, layers=(2, 4)) == [True] * 3
    assert all(torch.equal(o, b[2:4]) for o, b in zip(outs, blocks, strict=True))


def test_ttl_expires_blocks(make: Any, client: redis.Redis):
    tier = make(ttl=0.3)
    keys = make_keys(2)
    tier.put(keys, blocks_of(tier.layout, 2))
    assert 0 < client.pttl(tier.key_name(keys[0])) <= 300
    assert tier.get(keys, empty(tier.layout, 2)) == [True, True]
    assert wait_for(lambda: tier.contains(keys) == [False, False], timeout=3.0)
    assert tier.get(keys, empty(tier.layout, 2)) == [False, False]
    assert tier.stats()["misses"] == 2


def test_bad_input_raises_before_any_request(make: Any):
    tier = make()
    before = tier.stats()["requests"]
    wrong = torch.zeros(tier.layout.block_shape, dtype=torch.float32)
    with pytest.raises(LayoutMismatchError):
        tier.put(make_keys(1), [wrong])
    with pytest.raises(InvalidInputError):
        tier.get(make_keys(1), empty(tier.layout, 1), layers=(0, 9))
    assert tier.stats()["requests"] == before


# -- corrupt and foreign values ------------------------------------------------------------------
@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("layers", [None, (2, 3)])
def test_corrupt_value_is_a_counted_miss_and_is_deleted(
    make: Any, client: redis.Redis, damage: str, layers: tuple[int, int] | None
):
    layout = small_layout()
    tier = make(layout, codec="raw")
    keys = make_keys(1)
    tier.put(keys, blocks_of(layout, 1))
    name = tier.key_name(keys[0])
    good = client.get(name)
    assert isinstance(good, bytes)
    client.set(name, DAMAGES[damage](good))
    assert tier.get(keys, empty(layout, 1, layers), layers=layers) == [False]
    if damage == "empty" and layers is not None:
        assert tier.stats()["misses"] == 1  # an empty value reads like no value at all
    else:
        assert tier.stats()["corrupt"] == 1
        assert client.exists(name) == 0


def test_each_value_is_decoded_as_it_arrives_and_a_batch_mixes_hits_misses_and_damage(
    make: Any, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
):
    """A batch's GETs go in one write; each reply is verified into its tensor before the
    next is read (Redis sends the next meanwhile), and a missing or damaged value among
    them is a miss of its own."""
    layout = small_layout()
    tier = make(layout, codec="raw")
    keys = make_keys(4, salt=31)
    blocks = blocks_of(layout, 4)
    assert tier.put(keys[:3], blocks[:3]) == [True] * 3
    damaged = tier.key_name(keys[1])
    client.set(damaged, DAMAGES["flipped"](client.get(damaged)))
    events: list[str] = []
    conn_cls = redis.connection.Connection  # what a redis:// url's pool makes
    real_read, real_decode = conn_cls.read_response, RedisTier._decode

    def reading(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("read")
        return real_read(self, *args, **kwargs)

    def decoding(self: RedisTier, *args: Any) -> bool:
        events.append("decode")
        return real_decode(self, *args)

    monkeypatch.setattr(conn_cls, "read_response", reading)
    monkeypatch.setattr(RedisTier, "_decode", decoding)
    outs = empty(layout, 4)
    assert tier.get(keys, outs) == [True, False, True, False]
    assert events[:8] == ["read", "decode"] * 4
    assert torch.equal(outs[0], blocks[0]) and torch.equal(outs[2], blocks[2])
    stats = tier.stats()
    assert (stats["corrupt"], stats["misses"], stats["blocks_got"]) == (1, 1, 2)
    assert client.exists(damaged) == 0


def test_foreign_layout_values_are_ignored(make: Any, client: redis.Redis):
    ours_layout, other_layout = small_layout(), small_layout(head_dim=32)
    ours = make(ours_layout, key_prefix="shared")
    other = make(other_layout, key_prefix="shared")
    keys = make_keys(3, salt=77)
    assert other.put(keys, blocks_of(other_layout, 3)) == [True] * 3
    client.set(ours.key_name(keys[0])[:-1], b"stray")  # not a key name
    assert list(ours.stored_keys()) == []
    client.set(ours.key_name(keys[0]), client.get(other.key_name(keys[0])) or b"")
    assert ours.get(keys[:1], empty(ours_layout)) == [False]
    assert ours.stats()["corrupt"] == 1
    assert client.exists(ours.key_name(keys[0])) == 0
    assert sorted(other.stored_keys()) == sorted(keys)
    other.delete(keys)
    client.delete(ours.key_name(keys[0])[:-1])


def test_stored_keys_stops_at_capacity(make: Any):
    layout = small_layout()
    tier = make(layout, capacity=3 * layout.block_nbytes)
    keys = make_keys(5)
    tier.put(keys, blocks_of(layout, 5))
    found = list(tier.stored_keys())
    assert len(found) == 3 and set(found) <= set(keys)


# -- outages -------------------------------------------------------------------------------------
def test_down_at_open_then_up(make: Any):
    port = free_port()
    tier = make(url=f"redis://127.0.0.1:{port}/0")
    keys, blocks = make_keys(2), blocks_of(small_layout(), 2)
    assert not tier.available
    assert list(tier.stored_keys()) == []
    with pytest.raises(TierError, match="unavailable"):
        tier.put(keys, blocks)
    with pytest.raises(TierError, match="unavailable"):
        tier.delete(keys)
    with RedisServer(port=port):
        assert wait_for(lambda: tier.put(keys, blocks) == [True, True], timeout=3.0)
        assert tier.available
        outs = empty(tier.layout, 2)
        assert tier.get(keys, outs) == [True, True]
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    assert tier.stats()["reconnects"] == 1


def test_frozen_server_times_out_quickly_then_recovers(make: Any):
    with RedisServer() as server:
        tier = make(url=server.url, socket_timeout=0.3, retry_interval=0.2)
        keys, blocks = make_keys(2), blocks_of(small_layout(), 2)
        assert tier.put(keys, blocks) == [True, True]
        server.pause()
        try:
            start = time.monotonic()
            with pytest.raises(TierError, match="unavailable"):
                tier.get(keys, empty(tier.layout, 2))
            assert time.monotonic() - start < 1.0  # one socket timeout, no retry
            assert not tier.available
            start = time.monotonic()
            with pytest.raises(TierError, match="unavailable"):
                tier.get(keys, empty(tier.layout, 2))
            assert time.monotonic() - start < 0.1  # the breaker answers, not the network
        finally:
            server.resume()
        assert wait_for(lambda: tier.get(keys, empty(tier.layout, 2)) == [True, True])
        assert tier.available


def test_password_stays_out_of_stats_and_logs(make: Any, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    tier = make(url=f"redis://user:s3cret-pw@127.0.0.1:{free_port()}/0")
    with pytest.raises(TierError) as info:
        tier.get(make_keys(1), empty(tier.layout))
    assert "s3cret-pw" not in str(info.value)
    assert "s3cret-pw" not in repr(tier.stats())
    assert "s3cret-pw" not in caplog.text
    assert "***" in tier.stats()["url"]


def _spill(store: KVStore, keys: list[BlockKey], kv: torch.Tensor, batch: int) -> None:
    step = store.layout.block_tokens
    for i in range(0, len(keys), batch):
        assert store.put(keys[i : i + batch], kv[:, :, i * step : (i + batch) * step]) == batch


def test_killed_mid_workload_store_keeps_serving_then_reconnects():
    layout = small_layout()
    step = layout.block_tokens
    with RedisServer() as server:
        redis_tier = RedisTier(redis_config(server.url, retry_interval=0.3), layout)
        host = HostTier(HostTierConfig(capacity=8 * layout.block_nbytes), layout)
        with KVStore(layout, tiers=[host, redis_tier]) as store:
            keys, kv = make_keys(24), random_blocks(layout, 24, seed=12)
            _spill(store, keys, kv, batch=4)
            in_redis = [i for i, k in enumerate(keys) if store.engine.datapath.where(k) == [1]]
            assert in_redis and torch.equal(
                store.get([keys[i] for i in in_redis])[:, :, :step],
                kv[:, :, in_redis[0] * step : (in_redis[0] + 1) * step],
            )
            hot = [i for i, k in enumerate(keys) if 0 in store.engine.datapath.where(k)][-3:]
            fresh, fresh_kv = make_keys(400, salt=5), random_blocks(layout, 400, seed=13)
            state: dict[str, Any] = {"errors": [], "slowest": 0.0, "rounds": 0}
            stop = threading.Event()

            def workload() -> None:
                n = 0
                while not stop.is_set() and n + 2 <= len(fresh):
                    start = time.monotonic()
                    try:
                        for i in hot:  # host hits, whatever Redis does
                            got = store.get([keys[i]])
                            if not torch.equal(got, kv[:, :, i * step : (i + 1) * step]):
                                state["errors"].append(f"wrong bytes for block {i}")
                        # new blocks push older ones down towards Redis
                        store.put(fresh[n : n + 2], fresh_kv[:, :, n * step : (n + 2) * step])
                    except Exception as exc:
                        state["errors"].append(repr(exc))
                    n += 2
                    state["rounds"] += 1
                    state["slowest"] = max(state["slowest"], time.monotonic() - start)
                    time.sleep(0.01)

            worker = threading.Thread(target=workload)
            worker.start()
            try:
                time.sleep(0.3)
                server.kill()
                assert wait_for(lambda: not redis_tier.available, timeout=3.0)
                start = time.monotonic()
                outs = empty(layout, len(in_redis))
                with pytest.raises(TierError, match="unavailable"):
                    redis_tier.get([keys[i] for i in in_redis], outs)
                assert time.monotonic() - start < 0.1
                out = torch.empty(layout.tensor_shape(1), dtype=layout.dtype)
                assert store.get_prefix([keys[in_redis[0]]], out) == 0  # a miss, not an error
                time.sleep(0.3)
                server.start()  # same port, empty
                assert wait_for(lambda: redis_tier.available, timeout=5.0)
            finally:
                stop.set()
                worker.join()
            assert state["errors"] == []
            assert state["rounds"] > 5
            assert state["slowest"] < 1.5
            # Redis is back in the store: new evictions land there and read back.
            more, more_kv = make_keys(12, salt=9), random_blocks(layout, 12, seed=14)
            _spill(store, more, more_kv, batch=4)
            back = [i for i, k in enumerate(more) if store.engine.datapath.where(k) == [1]]
            assert back
            got = store.get([more[back[0]]])
            assert torch.equal(got, more_kv[:, :, back[0] * step : (back[0] + 1) * step])
            assert redis_tier.stats()["reconnects"] >= 1
