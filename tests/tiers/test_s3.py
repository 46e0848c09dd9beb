"""S3 tier against a real S3 server (moto over HTTP on a free port), with injected faults.

Faults come from a real HTTP proxy in front of the server (5xx answers,
stalls past the read timeout) or from a port nothing listens on; corrupt
objects are written with a plain boto3 client. No client is mocked.
"""

from __future__ import annotations

import importlib.util
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import botocore.exceptions
import pytest
import torch

from kvharness.proxies.fault import FaultProxy
from kvstore import KVLayout, KVStore
from kvstore.cli.servers import DUMMY_AWS_ENV, S3Server, free_port
from kvstore.config import S3TierConfig
from kvstore.errors import InvalidInputError, LayoutMismatchError, TierError
from kvstore.format.codec import header_size
from kvstore.keys import BlockKey
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import block_list as blocks_of
from kvstore.testing.data import empty_blocks as empty
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import DAMAGES
from kvstore.testing.faults import wait_for_tier as wait_for
from kvstore.tiers.s3 import S3Tier

MiB = 1024**2


def unique_prefix(stem: str) -> str:
    """A prefix no other test uses, so tests sharing the server never see each other."""
    return f"{stem}{uuid.uuid4().hex[:12]}"


def s3_config(server: S3Server, **fields: Any) -> S3TierConfig:
    """A tier config on ``server`` with a fresh prefix and short, test-sized timeouts."""
    base: dict[str, Any] = {
        "bucket": server.bucket,
        "prefix": unique_prefix("s3-"),
        "endpoint_url": server.url,
        "region": "us-east-1",
        "connect_timeout": 1.0,
        "read_timeout": 2.0,
        "deadline": 5.0,
        "concurrency": 4,
    }
    base.update(fields)
    return S3TierConfig(**base)


@pytest.fixture
def make(s3_server: S3Server, aws_env: None) -> Iterator[Any]:
    """``make(layout=..., **config)`` -> a new S3 tier; all are closed at the end."""
    made: list[S3Tier] = []

    def factory(layout: KVLayout | None = None, **fields: Any) -> S3Tier:
        tier = S3Tier(s3_config(s3_server, **fields), layout or small_layout())
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.close()


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.port) as p:
        yield p


def object_exists(server: S3Server, name: str) -> bool:
    try:
        server.client().head_object(Bucket=server.bucket, Key=name)
    except botocore.exceptions.ClientError:
        return False
    return True


def write_object(server: S3Server, name: str, body: bytes) -> None:
    server.client().put_object(Bucket=server.bucket, Key=name, Body=body)


def read_object(server: S3Server, name: str) -> bytes:
    data: bytes = server.client().get_object(Bucket=server.bucket, Key=name)["Body"].read()
    return data


class TestS3Tier(TierConformance):
    bounded = False  # capacity is the manager's to enforce; S3 itself has no limit

    @pytest.fixture(autouse=True)
    def _on_server(self, s3_server: S3Server, aws_env: None) -> None:
        self.server = s3_server

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> S3Tier:
        config = s3_config(self.server, capacity=capacity_blocks * layout.block_nbytes)
        return S3Tier(config, layout)


# -- naming, codecs, layers ---------------------------------------------------------------------
def test_object_names_are_content_addressed_under_the_layout(make: Any, s3_server: S3Server):
    layout = small_layout()
    tier = make(layout, prefix="names/x/")
    key = BlockKey(bytes.fromhex("ab" * 16))
    assert tier.object_name(key) == f"names/x/{layout.fingerprint_hex}/ab/{'ab' * 16}"
    assert tier.put([key], blocks_of(layout, 1)) == [True]
    assert object_exists(s3_server, tier.object_name(key))


@pytest.mark.parametrize("codec", ["raw", "lz4", "shuffle-lz4", "auto"])
def test_every_codec_round_trips_whole_and_by_layer(make: Any, codec: str):
    layout = small_layout(num_layers=4)
    tier = make(layout, codec=codec)
    keys, blocks = make_keys(2), blocks_of(layout, 2, seed=3)
    assert tier.put(keys, blocks) == [True, True]
    outs = empty(layout, 2)
    assert tier.get(keys, outs) == [True, True]
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    fresh = make(layout, prefix=tier.cfg.prefix, codec=codec)  # empty header cache
    outs = empty(layout, 2, layers=(1, 3))
    assert fresh.get(keys, outs, layers=(1, 3)) == [True, True]
    assert all(torch.equal(o, b[1:3]) for o, b in zip(outs, blocks, strict=True))


def test_shuffle_lz4_sends_fewer_bytes(make: Any):
    layout = small_layout(num_layers=4, head_dim=64)
    raw, packed = make(layout, codec="raw"), make(layout, codec="shuffle-lz4")
    gen = torch.Generator().manual_seed(5)
    # Small integers: the exponent plane compresses well (random normals barely do).
    blocks = [
        torch.randint(-8, 8, layout.block_shape, generator=gen).to(layout.dtype) for _ in range(4)
    ]
    keys = make_keys(4)
    raw.put(keys, blocks)
    packed.put(keys, blocks)
    assert packed.stats()["bytes_out"] < 0.9 * raw.stats()["bytes_out"]


def test_layer_get_fetches_only_the_header_and_those_layers(make: Any):
    layout = small_layout(num_layers=8)
    writer = make(layout, codec="raw")
    keys, blocks = make_keys(1), blocks_of(layout, 1, seed=7)
    writer.put(keys, blocks)
    reader = make(layout, prefix=writer.cfg.prefix)  # a new process: nothing cached
    out = empty(layout, 1, layers=(2, 5))
    assert reader.get(keys, out, layers=(2, 5)) == [True]
    assert torch.equal(out[0], blocks[0][2:5])
    stats = reader.stats()
    assert stats["ranged_gets"] == 2
    assert stats["bytes_in"] == header_size(8) + 3 * layout.layer_nbytes
    out = empty(layout, 1, layers=(7, 8))
    assert reader.get(keys, out, layers=(7, 8)) == [True]  # header now cached: one request
    assert torch.equal(out[0], blocks[0][7:8])
    assert reader.stats()["ranged_gets"] == 3


def test_layer_get_after_a_rewrite_rereads_the_header(make: Any):
    layout = small_layout(num_layers=4)
    reader = make(layout, codec="raw")
    rewriter = make(layout, prefix=reader.cfg.prefix, codec="shuffle-lz4")
    keys, blocks = make_keys(1), blocks_of(layout, 1, seed=8)
    reader.put(keys, blocks)
    assert reader.get(keys, empty(layout, 1, (0, 1)), layers=(0, 1)) == [True]  # caches
    rewriter.put(keys, blocks)  # same key, other codec: other bytes, other ETag
    out = empty(layout, 1, layers=(2, 4))
    assert reader.get(keys, out, layers=(2, 4)) == [True]
    assert torch.equal(out[0], blocks[0][2:4])
    assert reader.stats()["corrupt"] == 0


def test_multipart_upload_and_parallel_ranged_get(make: Any, s3_server: S3Server):
    layout = KVLayout(num_layers=11, num_kv_heads=8, head_dim=128, block_tokens=256)  # 11 MiB
    tier = make(layout, codec="raw", multipart_threshold=6 * MiB, part_size=5 * MiB)
    keys, blocks = make_keys(2), blocks_of(layout, 2, seed=9)
    assert tier.put(keys, blocks) == [True, True]
    assert tier.stats()["multipart_uploads"] == 2
    client = s3_server.client()
    etag = client.head_object(Bucket=s3_server.bucket, Key=tier.object_name(keys[0]))["ETag"]
    assert etag.strip('"').endswith("-3")  # 5 + 5 + 1 MiB parts
    reader = make(layout, prefix=tier.cfg.prefix, multipart_threshold=6 * MiB, part_size=5 * MiB)
    outs = empty(layout, 2)
    assert reader.get(keys, outs) == [True, True]
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    assert reader.stats()["ranged_gets"] == 6  # 3 ranges per block
    out = empty(layout, 1, layers=(10, 11))
    assert reader.get(keys[:1], out, layers=(10, 11)) == [True]
    assert torch.equal(out[0], blocks[0][10:11])


def test_stored_keys_pages_through_the_listing(make: Any):
    tier = make()
    tier.list_page = 2
    keys = make_keys(5)
    tier.put(keys, blocks_of(tier.layout, 5))
    before = tier.stats()["requests"]
    assert sorted(tier.stored_keys()) == sorted(keys)
    assert tier.stats()["requests"] - before == 3


def test_contains_asks_the_server(make: Any, s3_server: S3Server):
    tier = make()
    keys = make_keys(2)
    tier.put(keys, blocks_of(tier.layout, 2))
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=tier.object_name(keys[0]))
    assert tier.contains(keys) == [False, True]
    assert tier.get(keys, empty(tier.layout, 2)) == [False, True]
    assert tier.stats()["misses"] == 1


def test_bad_input_raises_before_any_request(make: Any):
    tier = make()
    opened = tier.stats()["requests"]  # the bucket check at open
    wrong = torch.zeros((1, *tier.layout.block_shape[1:]), dtype=tier.layout.dtype)
    with pytest.raises(LayoutMismatchError):
        tier.put(make_keys(1), [wrong])
    with pytest.raises(InvalidInputError):
        tier.get(make_keys(2), empty(tier.layout, 1))
    with pytest.raises(InvalidInputError):
        tier.get(make_keys(1), empty(tier.layout, 1), layers=(2, 1))
    assert tier.stats()["requests"] == opened


# -- corrupt and foreign objects -----------------------------------------------------------------
@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("layers", [None, (2, 3)])
def test_corrupt_object_is_a_counted_miss_and_is_deleted(
    make: Any, s3_server: S3Server, damage: str, layers: tuple[int, int] | None
):
    layout = small_layout()
    tier = make(layout, codec="raw")
    keys = make_keys(1)
    tier.put(keys, blocks_of(layout, 1))
    name = tier.object_name(keys[0])
    write_object(s3_server, name, DAMAGES[damage](read_object(s3_server, name)))
    reader = make(layout, prefix=tier.cfg.prefix)
    assert reader.get(keys, empty(layout, 1, layers), layers=layers) == [False]
    assert reader.stats()["corrupt"] == 1
    assert not object_exists(s3_server, name)


@pytest.mark.parametrize("damaged_reads", [1, 2])
@pytest.mark.parametrize("layers", [None, (2, 3)])
def test_bytes_damaged_on_the_way_never_delete_the_object(
    make: Any,
    proxy: FaultProxy,
    s3_server: S3Server,
    damaged_reads: int,
    layers: tuple[int, int] | None,
):
    """The bucket is shared: a body that fails verification is read once more, and the
    object is deleted only when S3 vouches (its ETag) that the bytes it holds are bad.
    One damaged read: the re-read is a hit. Two: a miss that keeps the object."""
    layout = small_layout()
    tier = make(layout, codec="raw", endpoint_url=proxy.url)
    keys, data = make_keys(1), blocks_of(layout, 1)
    assert tier.put(keys, data) == [True]
    reader = make(layout, prefix=tier.cfg.prefix, endpoint_url=proxy.url)
    proxy.corrupt_next(damaged_reads)
    out = empty(layout, 1, layers)
    expected = data[0] if layers is None else data[0][layers[0] : layers[1]]
    got = reader.get(keys, out, layers=layers)
    stats = reader.stats()
    if layers is None:  # (a layer read spends a damaged read on its header's padding)
        assert got == [damaged_reads == 1] and stats["corrupt"] == 1
    assert stats["corrupt_deleted"] == 0 and proxy.corrupted == damaged_reads
    assert object_exists(s3_server, tier.object_name(keys[0]))
    if got == [True]:
        assert torch.equal(out[0], expected)
    out = empty(layout, 1, layers)
    assert reader.get(keys, out, layers=layers) == [True]  # the next read is whole
    assert torch.equal(out[0], expected)


def test_another_keys_block_under_this_name_is_corrupt(make: Any, s3_server: S3Server):
    tier = make()
    keys = make_keys(2)
    tier.put(keys[:1], blocks_of(tier.layout, 1))
    body = read_object(s3_server, tier.object_name(keys[0]))
    write_object(s3_server, tier.object_name(keys[1]), body)
    assert tier.get(keys[1:], empty(tier.layout)) == [False]
    assert tier.stats()["corrupt"] == 1
    assert tier.get(keys[:1], empty(tier.layout)) == [True]


def test_foreign_layout_objects_are_ignored(make: Any, s3_server: S3Server):
    ours_layout, other_layout = small_layout(), small_layout(head_dim=32)
    ours = make(ours_layout)
    other = make(other_layout, prefix=ours.cfg.prefix)
    keys = make_keys(3)
    assert other.put(keys, blocks_of(other_layout, 3)) == [True] * 3
    assert list(ours.stored_keys()) == []  # another layout lives in another directory
    assert ours.get(keys[:1], empty(ours_layout)) == [False]
    # Stray objects in our directory are not keys.
    write_object(s3_server, ours.directory + "README", b"hello")
    write_object(s3_server, ours.directory + "zz/" + keys[0].hex(), b"misplaced")
    assert list(ours.stored_keys()) == []
    # A block of the other layout copied under our name is refused and removed.
    body = read_object(s3_server, other.object_name(keys[0]))
    write_object(s3_server, ours.object_name(keys[0]), body)
    assert ours.get(keys[:1], empty(ours_layout)) == [False]
    assert ours.stats()["corrupt"] == 1
    assert not object_exists(s3_server, ours.object_name(keys[0]))
    assert sorted(other.stored_keys()) == sorted(keys)


# -- faults ---------------------------------------------------------------------------------------
def test_5xx_answers_are_retried_and_counted(make: Any, proxy: FaultProxy):
    tier = make(endpoint_url=proxy.url, max_attempts=5)
    keys, blocks = make_keys(2), blocks_of(tier.layout, 2)
    proxy.fail_next(3, 503, "SlowDown")
    assert tier.put(keys, blocks) == [True, True]
    assert tier.stats()["retries"] == 3
    proxy.fail_next(2, 500, "InternalError")
    outs = empty(tier.layout, 2)
    assert tier.get(keys, outs) == [True, True]
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    stats = tier.stats()
    assert stats["retries"] == 5 and proxy.faults == 5
    assert stats["errors"] == 0 and stats["corrupt"] == 0


def test_5xx_past_max_attempts_is_a_miss_that_keeps_the_object(make: Any, proxy: FaultProxy):
    tier = make(endpoint_url=proxy.url, max_attempts=3)
    keys = make_keys(1)
    tier.put(keys, blocks_of(tier.layout, 1))
    proxy.fail_next(1000, 503, "SlowDown")
    start = time.monotonic()
    assert tier.get(keys, empty(tier.layout)) == [False]
    assert time.monotonic() - start < 2.0
    stats = tier.stats()
    assert stats["retries_exhausted"] == 1 and stats["errors"] == 1 and stats["corrupt"] == 0
    proxy.fail_next(0)
    assert tier.get(keys, empty(tier.layout)) == [True]  # a server error deletes nothing


def test_stall_past_the_read_timeout_is_retried(make: Any, proxy: FaultProxy):
    tier = make(endpoint_url=proxy.url, read_timeout=0.3, deadline=3.0)
    keys, blocks = make_keys(1), blocks_of(small_layout(), 1)
    tier.put(keys, blocks)
    proxy.stall_next(1, 5.0)
    start = time.monotonic()
    outs = empty(tier.layout)
    assert tier.get(keys, outs) == [True]
    assert time.monotonic() - start < 2.0
    assert torch.equal(outs[0], blocks[0])
    assert tier.stats()["retries"] == 1


def test_stall_past_the_deadline_is_a_bounded_miss(make: Any, proxy: FaultProxy):
    tier = make(endpoint_url=proxy.url, read_timeout=0.3, deadline=1.0, max_attempts=20)
    keys = make_keys(3)
    tier.put(keys, blocks_of(tier.layout, 3))
    proxy.stall_next(10_000, 10.0)
    start = time.monotonic()
    with pytest.raises(TierError, match="unavailable"):  # nothing answered in time
        tier.get(keys, empty(tier.layout, 3))
    elapsed = time.monotonic() - start
    assert elapsed < 1.0 + 0.3 + 1.0  # deadline + one read timeout + slack for this machine
    assert tier.stats()["deadline_exceeded"] >= 3


def test_endpoint_down_gives_quick_misses_then_recovers(make: Any, s3_server: S3Server):
    port = free_port()
    tier = make(
        endpoint_url=f"http://127.0.0.1:{port}",
        connect_timeout=0.5,
        deadline=1.0,
        max_attempts=3,
        retry_interval=0.3,
    )
    keys, blocks = make_keys(2), blocks_of(small_layout(), 2)
    start = time.monotonic()
    with pytest.raises(TierError, match="unavailable"):  # finds the endpoint down
        tier.put(keys, blocks)
    assert time.monotonic() - start < 1.5
    assert not tier.stats()["available"]
    for call in (
        lambda: tier.put(keys, blocks),
        lambda: tier.get(keys, empty(tier.layout, 2)),
        lambda: tier.contains(keys),
    ):
        start = time.monotonic()
        with pytest.raises(TierError, match="unavailable"):
            call()
        assert time.monotonic() - start < 0.1  # the breaker answers, not the network
    assert list(tier.stored_keys()) == []
    with pytest.raises(TierError, match="deletes"):
        tier.delete(keys)
    assert tier.stats()["skipped_unavailable"] >= 6
    with FaultProxy(s3_server.port, port=port):  # the endpoint comes up
        # One probe per retry_interval: the first batch after the pause may be half done.
        assert wait_for(lambda: tier.put(keys, blocks) == [True, True], timeout=3.0)
        outs = empty(tier.layout, 2)
        assert tier.get(keys, outs) == [True, True]
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    stats = tier.stats()
    assert stats["available"] and stats["outages"] == 1 and stats["reconnects"] == 1


def test_credentials_stay_out_of_logs_stats_and_errors(
    make: Any, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)
    down = make(endpoint_url=f"http://127.0.0.1:{free_port()}", deadline=0.5, max_attempts=2)
    keys = make_keys(1)
    with pytest.raises(TierError) as put_error:
        down.put(keys, blocks_of(down.layout, 1))
    with pytest.raises(TierError) as excinfo:
        down.delete(keys)
    flaky = make(endpoint_url=proxy.url, max_attempts=2)
    proxy.fail_next(10, 403, "AccessDenied")
    flaky.get(keys, empty(flaky.layout))
    secret = DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"]
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("kvstore"))
    assert ours and secret not in caplog.text
    for value in DUMMY_AWS_ENV.values():
        if value.startswith("kvstore-test"):
            assert value not in ours
            assert value not in str(excinfo.value) + str(put_error.value)
            assert value not in repr(down.stats()) + repr(flaky.stats())


# -- the whole store ------------------------------------------------------------------------------
def _store_config(server: S3Server, layout: KVLayout, prefix: str, tmp_path: Any) -> dict[str, Any]:
    nb = layout.block_nbytes
    tiers: list[dict[str, Any]] = [{"kind": "host", "capacity": 4 * nb}]
    if importlib.util.find_spec("kvstore.tiers.disk") is not None:
        tiers.append({"kind": "disk", "path": str(tmp_path / "disk"), "capacity": 4 * nb})
    tiers.append(
        {
            "kind": "s3",
            "bucket": server.bucket,
            "prefix": prefix,
            "endpoint_url": server.url,
            "region": "us-east-1",
            "read_timeout": 2.0,
            "deadline": 5.0,
        }
    )
    return {"tiers": tiers}


def test_store_finds_evicted_blocks_in_s3_and_after_reopen(
    s3_server: S3Server, aws_env: None, tmp_path: Any
):
    layout = small_layout()
    config = _store_config(s3_server, layout, unique_prefix("store-"), tmp_path)
    s3_index = len(config["tiers"]) - 1
    n = 16
    kv = random_blocks(layout, n, seed=11)
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(list(range(n * layout.block_tokens)), namespace="model@rev")
        for i in range(0, n, 2):  # several puts, so earlier blocks get evicted downwards
            step = layout.block_tokens
            assert store.put(keys[i : i + 2], kv[:, :, i * step : (i + 2) * step]) == 2
        in_s3 = [k for k in keys if store.engine.datapath.where(k) == [s3_index]]
        assert len(in_s3) >= n - 8  # the upper tiers hold at most 4 blocks each
        assert torch.equal(store.get(keys), kv)  # evicted blocks come back from S3, byte-exact
        evicted = sorted(keys.index(k) for k in in_s3)
    with KVStore(layout, config) as reopened:
        assert all(reopened.engine.datapath.contains(keys[i]) for i in evicted)
        step = layout.block_tokens
        for i in evicted:
            assert torch.equal(reopened.get([keys[i]]), kv[:, :, i * step : (i + 1) * step]), (
                f"block {i}"
            )
