"""Encryption at rest in the disk, Redis and S3 tiers: real files, a real redis-server,
moto S3 over HTTP. Round trips, layer ranges, tampered bytes, wrong and missing keys."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.codec import SEALED_VERSION, parse_header, read_header
from kvstore.config import DiskTierConfig, RedisTierConfig, S3TierConfig
from kvstore.config.encryption import TenantKeys
from kvstore.crypt import BlockCipher
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import block_list as blocks_of
from kvstore.testing.data import empty_blocks as empty
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.servers import RedisServer, S3Server
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_sealed import SealedFiles

K1, K2 = os.urandom(32), os.urandom(32)


def cipher(active: str = "k1", **keys: bytes) -> BlockCipher:
    return BlockCipher("default", TenantKeys(active, keys or {"k1": K1}))


def disk_tier(path: Path, layout: KVLayout, codec: str = "raw", **fields: Any) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity=1 << 24, codec=codec, **fields), layout)


def redis_tier(server: RedisServer, layout: KVLayout, prefix: str) -> Tier:
    from kvstore.tiers.redis import RedisTier

    config = RedisTierConfig(url=server.url, key_prefix=prefix, socket_timeout=1.0)
    return RedisTier(config, layout)


def s3_tier(server: S3Server, layout: KVLayout, prefix: str) -> Tier:
    from kvstore.tiers.s3 import S3Tier

    config = S3TierConfig(
        bucket=server.bucket,
        prefix=prefix,
        endpoint_url=server.url,
        region="us-east-1",
        read_timeout=2.0,
        deadline=5.0,
    )
    return S3Tier(config, layout)


@pytest.fixture(params=["disk", "disk-lz4", "redis", "s3"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """``open(cipher)``: a tier of the kind (a new instance on the same stored blocks each
    call), and ``damage(key)``: flip one payload byte of a stored block in place."""
    kind = request.param
    layout = small_layout()
    opened: list[Tier] = []
    prefix = f"enc{uuid.uuid4().hex[:10]}"

    def open_tier(with_cipher: BlockCipher | None) -> Tier:
        if kind.startswith("disk"):
            tier: Tier = disk_tier(tmp_path, layout, "lz4" if kind == "disk-lz4" else "raw")
        elif kind == "redis":
            tier = redis_tier(request.getfixturevalue("redis_server"), layout, prefix)
        else:
            request.getfixturevalue("aws_env")
            tier = s3_tier(request.getfixturevalue("s3_server"), layout, prefix)
        if with_cipher is not None:
            tier.encrypt_with(with_cipher)
        opened.append(tier)
        return tier

    def damage(tier: Tier, key: BlockKey) -> None:
        if kind.startswith("disk"):
            assert isinstance(tier, DiskTier)
            name = tier.block_path(key)
            data = bytearray(Path(name).read_bytes())
            data[4096 + 10] ^= 0x01  # the first layer's ciphertext (the file is page-padded)
            Path(name).write_bytes(data)
        elif kind == "redis":
            import redis

            client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
            name = tier.key_name(key)  # type: ignore[attr-defined]
            size = client.strlen(name)
            old = client.getrange(name, size - 40, size - 40)
            client.setrange(name, size - 40, bytes([old[0] ^ 1]))
            client.close()
        else:
            server = request.getfixturevalue("s3_server")
            name = tier.object_name(key)  # type: ignore[attr-defined]
            body = bytearray(
                server.client().get_object(Bucket=server.bucket, Key=name)["Body"].read()
            )
            body[-40] ^= 0x01
            server.client().put_object(Bucket=server.bucket, Key=name, Body=bytes(body))

    yield kind, layout, open_tier, damage
    for tier in opened:
        tier.close()


def test_round_trip_and_layer_ranges(medium: Any) -> None:
    _kind, layout, open_tier, _ = medium
    tier = open_tier(cipher())
    keys, blocks = make_keys(4), blocks_of(layout, 4)
    assert tier.put(keys, blocks) == [True] * 4
    outs = empty(layout, 4)
    assert tier.get(keys, outs) == [True] * 4
    for out, block in zip(outs, blocks, strict=True):
        assert torch.equal(out, block)
    part = empty(layout, 4, (1, 3))
    assert tier.get(keys, part, layers=(1, 3)) == [True] * 4
    for out, block in zip(part, blocks, strict=True):
        assert torch.equal(out, block[1:3])
    stats = tier.stats()
    assert stats["encrypted"] and stats["active_key"] == "k1"
    assert stats["decrypt_failures"] == 0 and stats["sealed"] == 4


def test_stored_bytes_are_sealed(tmp_path: Path) -> None:
    layout = small_layout()
    tier = disk_tier(tmp_path, layout)
    tier.encrypt_with(cipher())
    key, block = make_keys(1)[0], blocks_of(layout, 1)[0]
    assert tier.put([key], [block]) == [True]
    data = Path(tier.block_path(key)).read_bytes()
    header = read_header(data)
    assert header.sealed and header.key_id == "k1" and len(header.nonce) == 12
    assert data[4] == SEALED_VERSION
    plain = block.contiguous().view(torch.uint8).numpy().tobytes()
    assert plain[: layout.layer_nbytes // 2] not in data  # no plaintext layer bytes stored
    tier.close()


def test_plain_tier_bytes_unchanged(tmp_path: Path) -> None:
    """Encryption off: the block file is what the codec always wrote (format version 1)."""
    layout = small_layout()
    tier = disk_tier(tmp_path, layout)
    key, block = make_keys(1)[0], blocks_of(layout, 1)[0]
    tier.put([key], [block])
    data = Path(tier.block_path(key)).read_bytes()
    header = parse_header(data, layout, key)
    assert not header.sealed and data[4] == 1 and header.header_nbytes == 128
    tier.close()


def test_tampered_bytes_are_a_counted_miss(medium: Any) -> None:
    _kind, layout, open_tier, damage = medium
    tier = open_tier(cipher())
    keys, blocks = make_keys(2), blocks_of(layout, 2)
    tier.put(keys, blocks)
    damage(tier, keys[0])
    outs = empty(layout, 2)
    assert tier.get(keys, outs) == [False, True]
    assert torch.equal(outs[1], blocks[1])
    stats = tier.stats()
    assert stats["decrypt_failures"] == 1
    assert stats.get("corrupt", 0) == 0  # a key problem is not counted as rot
    assert tier.contains([keys[0]]) == [True]  # kept: deleting is not this reader's call


def test_wrong_or_missing_key_is_a_counted_miss(medium: Any) -> None:
    _kind, layout, open_tier, _ = medium
    writer = open_tier(cipher())
    keys, blocks = make_keys(1), blocks_of(layout, 1)
    writer.put(keys, blocks)
    wrong = open_tier(cipher(k1=os.urandom(32)))  # same id, other bytes
    assert wrong.get(keys, empty(layout, 1)) == [False]
    assert wrong.get(keys, empty(layout, 1, (0, 1)), layers=(0, 1)) == [False]
    assert wrong.stats()["decrypt_failures"] >= 2
    removed = open_tier(cipher("k2", k2=K2))  # k1 is no longer in the keyring
    assert removed.get(keys, empty(layout, 1)) == [False]
    assert removed.stats()["decrypt_failures"] == 1
    plain = open_tier(None)  # encryption turned off: an encrypted block is no data
    assert plain.get(keys, empty(layout, 1)) == [False]
    assert plain.stats()["decrypt_failures"] == 1
    again = open_tier(cipher())
    outs = empty(layout, 1)
    assert again.get(keys, outs) == [True] and torch.equal(outs[0], blocks[0])


def test_plain_block_refused_where_encryption_is_on(medium: Any) -> None:
    """A block written without encryption is not data to a tier that encrypts (anyone
    who can write the medium could forge one)."""
    _kind, layout, open_tier, _ = medium
    keys, blocks = make_keys(1), blocks_of(layout, 1)
    open_tier(None).put(keys, blocks)
    tier = open_tier(cipher())
    assert tier.get(keys, empty(layout, 1)) == [False]
    assert tier.stats()["decrypt_failures"] == 1


def test_rotation_reads_both_keys(medium: Any) -> None:
    _kind, layout, open_tier, _ = medium
    old, new = make_keys(2), make_keys(2, salt=7)
    old_blocks, new_blocks = blocks_of(layout, 2), blocks_of(layout, 2, seed=3)
    open_tier(cipher()).put(old, old_blocks)
    rotated = open_tier(cipher("k2", k1=K1, k2=K2))
    rotated.put(new, new_blocks)
    outs = empty(layout, 4)
    assert rotated.get(old + new, outs) == [True] * 4
    for out, block in zip(outs, old_blocks + new_blocks, strict=True):
        assert torch.equal(out, block)
    assert sorted(rotated.stale_keys(old + new)) == sorted(old)  # read under k1
    assert rotated.stats()["opened_old_key"] == 2


def test_non_contiguous_outputs(tmp_path: Path) -> None:
    """Engine chunk views (two pieces per layer) are opened into in place."""
    layout = small_layout()
    tier = disk_tier(tmp_path, layout)
    tier.encrypt_with(cipher())
    kv = random_blocks(layout, 2)
    step = layout.block_tokens
    keys = make_keys(2)
    views = [kv[:, :, i * step : (i + 1) * step] for i in range(2)]
    assert tier.put(keys, views) == [True, True]
    target = torch.zeros_like(kv)
    outs = [target[:, :, i * step : (i + 1) * step] for i in range(2)]
    assert tier.get(keys, outs) == [True, True]
    assert torch.equal(target, kv)
    tier.close()


class TestEncryptedDiskConformance(TierConformance):
    """The tier contract holds with encryption on (bad bytes are misses, not data)."""

    bounded = False  # files have no slots: the manager enforces capacity

    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path: Path) -> None:
        self.path = tmp_path / "disk"

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DiskTier:
        file_nbytes = SealedFiles(layout, None, lambda name, n: memoryview(b"")).file_nbytes
        config = DiskTierConfig(path=str(self.path), capacity=capacity_blocks * file_nbytes)
        tier = DiskTier(config, layout)
        tier.encrypt_with(cipher())
        return tier
