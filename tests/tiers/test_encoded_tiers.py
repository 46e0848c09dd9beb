"""Encoded slow tiers (issue 55) through the real media: files, a real redis-server,
moto S3 over HTTP. Blocks are stored encoded (fewer bytes), read back within the
encoding's error into the engine's dtype, sealed when the tier encrypts, and a damaged
encoded block is a miss."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, S3TierConfig
from kvstore.errors import ConfigError
from kvstore.format import TAG_BYTES, BlockCipher, TenantKeys, read_header
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import empty_blocks as empty
from kvstore.testing.data import small_layout
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier

#: small_layout: 8 tokens a block, head_dim 16: int4 groups of 8.
GROUP = 8
#: The most a value may move, over the block's largest magnitude (int4: half a step of
#: a group's range, bfloat16 minimum and step; the 8-bit ones far less).
TOLERANCE = {"fp8_e4m3": 0.07, "int8": 0.01, "int4": 0.1}


def blocks(layout: KVLayout, n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.block_shape, generator=gen).to(layout.dtype) for _ in range(n)]


def close(out: torch.Tensor, block: torch.Tensor, encoding: str) -> bool:
    err = (out.float() - block.float()).abs().max()
    return bool(err <= TOLERANCE[encoding] * block.float().abs().max()) and not torch.equal(
        out, block
    )


@pytest.fixture(params=["disk", "redis", "s3"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """``open(encoding, cipher)``: a tier of the kind on the same stored blocks each call;
    ``stored(tier, key)``: the bytes it holds for a key; ``damage(tier, key)``: flip one
    byte of them in place."""
    kind = request.param
    layout = small_layout()
    opened: list[Tier] = []
    prefix = f"q{uuid.uuid4().hex[:10]}"

    def open_tier(encoding: str, cipher: BlockCipher | None = None) -> Tier:
        fields = {"encoding": encoding, "group_size": GROUP}
        if kind == "disk":
            tier: Tier = DiskTier(
                DiskTierConfig(path=str(tmp_path), capacity=1 << 24, **fields), layout
            )
        elif kind == "redis":
            from kvstore.tiers.redis import RedisTier

            server = request.getfixturevalue("redis_server")
            tier = RedisTier(RedisTierConfig(url=server.url, key_prefix=prefix, **fields), layout)
        else:
            from kvstore.tiers.s3 import S3Tier

            request.getfixturevalue("aws_env")
            server = request.getfixturevalue("s3_server")
            config = S3TierConfig(
                bucket=server.bucket,
                prefix=prefix,
                endpoint_url=server.url,
                region="us-east-1",
                read_timeout=2.0,
                deadline=5.0,
                **fields,
            )
            tier = S3Tier(config, layout)
        if cipher is not None:
            tier.encrypt_with(cipher)
        opened.append(tier)
        return tier

    def stored(tier: Tier, key: BlockKey) -> bytes:
        if kind == "disk":
            assert isinstance(tier, DiskTier)
            return Path(tier.block_path(key)).read_bytes()
        if kind == "redis":
            import redis

            client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
            try:
                return bytes(client.get(tier.key_name(key)))  # type: ignore[attr-defined]
            finally:
                client.close()
        server = request.getfixturevalue("s3_server")
        name = tier.object_name(key)  # type: ignore[attr-defined]
        return bytes(server.client().get_object(Bucket=server.bucket, Key=name)["Body"].read())

    def damage(tier: Tier, key: BlockKey) -> None:
        data = bytearray(stored(tier, key))
        end = len(data)
        if kind == "disk":  # a sealed block file is padded to a page
            assert isinstance(tier, DiskTier)
            end = tier.data_offset + read_header(data).payload_nbytes
        data[end - 3] ^= 0x04  # in the last layer's encoded values (or its tag)
        if kind == "disk":
            Path(tier.block_path(key)).write_bytes(data)
        elif kind == "redis":
            import redis

            client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
            client.set(tier.key_name(key), bytes(data))  # type: ignore[attr-defined]
            client.close()
        else:
            server = request.getfixturevalue("s3_server")
            name = tier.object_name(key)  # type: ignore[attr-defined]
            server.client().put_object(Bucket=server.bucket, Key=name, Body=bytes(data))

    yield kind, layout, open_tier, stored, damage
    for tier in opened:
        tier.close()


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8", "int4"])
def test_blocks_are_stored_encoded_and_read_back_within_the_error(medium, encoding):
    _kind, layout, open_tier, stored, _ = medium
    tier = open_tier(encoding)
    keys, data = make_keys(3), blocks(layout, 3)
    assert tier.put(keys, data) == [True] * 3
    raw = read_header(stored(tier, keys[0]))
    assert raw.encoding is not None and raw.encoding.name == encoding
    per_layer = raw.encoding.layer_nbytes(layout)  # head_dim 16: a float32 scale is 1/8
    assert raw.payload_nbytes == layout.num_layers * per_layer < 0.65 * layout.block_nbytes
    outs = empty(layout, 3)
    assert tier.get(keys, outs) == [True] * 3
    for out, block in zip(outs, data, strict=True):
        assert out.dtype == layout.dtype and close(out, block, encoding)
    part = empty(layout, 3, (1, 3))
    assert tier.get(keys, part, layers=(1, 3)) == [True] * 3
    for out, whole in zip(part, outs, strict=True):
        assert torch.equal(out, whole[1:3])
    ratio, decode = tier.stored_bytes()
    assert ratio == raw.payload_nbytes / layout.block_nbytes and decode > 0


def test_a_damaged_encoded_block_is_a_miss(medium):
    _kind, layout, open_tier, _, damage = medium
    tier = open_tier("fp8_e4m3")
    keys, data = make_keys(2), blocks(layout, 2)
    assert tier.put(keys, data) == [True, True]
    damage(tier, keys[0])
    outs = empty(layout, 2)
    assert tier.get(keys, outs) == [False, True]
    assert close(outs[1], data[1], "fp8_e4m3")


def test_sealed_tiers_seal_the_encoded_bytes(medium):
    _kind, layout, open_tier, stored, damage = medium
    cipher = BlockCipher("default", TenantKeys("k1", {"k1": os.urandom(32)}), "default")
    tier = open_tier("int8", cipher)
    keys, data = make_keys(2), blocks(layout, 2)
    assert tier.put(keys, data) == [True, True]
    header = read_header(stored(tier, keys[0]))
    assert header.sealed and header.encoding is not None and header.encoding.name == "int8"
    each = header.encoding.layer_nbytes(layout) + TAG_BYTES
    assert header.payload_nbytes == layout.num_layers * each < 0.7 * layout.block_nbytes
    outs = empty(layout, 2)
    assert tier.get(keys, outs) == [True, True]
    assert all(close(o, b, "int8") for o, b in zip(outs, data, strict=True))
    damage(tier, keys[1])
    assert tier.get(keys, empty(layout, 2)) == [True, False]


def test_a_plain_tier_reads_what_an_encoded_one_wrote(medium):
    """Turning the encoding off later: the blocks stored encoded still read (each block
    says its encoding), and new ones are stored plain."""
    _kind, layout, open_tier, stored, _ = medium
    keys, data = make_keys(2), blocks(layout, 2)
    assert open_tier("int4").put(keys[:1], data[:1]) == [True]
    plain = open_tier("none")
    assert plain.put(keys[1:], data[1:]) == [True]
    assert read_header(stored(plain, keys[1])).encoding is None
    outs = empty(layout, 2)
    assert plain.get(keys, outs) == [True, True]
    assert close(outs[0], data[0], "int4") and torch.equal(outs[1], data[1])
    assert plain.stored_bytes() == (1.0, 0.0)


def test_a_layout_the_encoding_cannot_hold_is_refused_at_open(tmp_path: Path) -> None:
    config = DiskTierConfig(path=str(tmp_path), capacity=1 << 24, encoding="int4", group_size=32)
    with pytest.raises(ConfigError, match="does not divide block_tokens 8"):
        DiskTier(config, small_layout())


def test_an_encoded_disk_tier_counts_its_capacity_in_encoded_files(tmp_path: Path) -> None:
    layout = small_layout(block_tokens=64, head_dim=128)
    plain = DiskTier(DiskTierConfig(path=str(tmp_path / "a"), capacity=1 << 22), layout)
    fp8 = DiskTier(
        DiskTierConfig(path=str(tmp_path / "b"), capacity=1 << 22, encoding="fp8_e4m3"), layout
    )
    assert fp8.file_nbytes < plain.file_nbytes
    assert fp8.capacity_blocks > plain.capacity_blocks
    plain.close()
    fp8.close()


def test_memory_tier_configs_have_no_encoding() -> None:
    assert not HostTierConfig.encodable and DiskTierConfig.encodable
    assert "encoding" not in HostTierConfig().to_dict()


def test_a_store_writes_back_to_an_encoded_disk_and_reads_it_into_the_engine_dtype(
    tmp_path: Path,
) -> None:
    """Blocks evicted from memory land encoded on disk; reading them decodes them."""
    from kvstore import KVStore
    from kvstore.config import StoreConfig

    layout = small_layout()
    config = StoreConfig.from_dict(
        {
            "tiers": [
                {"kind": "host", "capacity": 2 * layout.block_nbytes},
                {"kind": "disk", "path": str(tmp_path), "capacity": "16MiB", "encoding": "int8"},
            ]
        }
    )
    keys = make_keys(6)
    kv = torch.randn(layout.tensor_shape(6), generator=torch.Generator().manual_seed(3))
    kv = kv.to(layout.dtype)
    with KVStore(layout, config) as store:
        assert store.put(keys, kv) == 6
        store.drain()
        out = store.get(keys)
    assert out.shape == kv.shape and out.dtype == layout.dtype
    files = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    headers = [read_header(data) for data in files if data[:4] == b"KVSB"]
    assert len(headers) >= 4 and all(h.encoding is not None for h in headers)
    assert close(out, kv, "int8")
