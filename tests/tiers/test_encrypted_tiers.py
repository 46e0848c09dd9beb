"""Encryption at rest in the disk, Redis and S3 tiers: real files, a real redis-server,
moto S3 over HTTP. Round trips, layer ranges, tampered bytes, wrong and missing keys,
blocks moved to another key or namespace, blocks of the earlier format."""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvstore.cli.servers import RedisServer, S3Server
from kvstore.config import DiskTierConfig, RedisTierConfig, S3TierConfig
from kvstore.errors import DecryptError
from kvstore.format.codec import (
    SEALED_VERSION,
    TAG_BYTES,
    encode_block,
    header_size,
    parse_header,
    read_header,
)
from kvstore.format.keyring import TenantKeys
from kvstore.format.sealing import BlockCipher, open_into, seal
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import block_list as blocks_of
from kvstore.testing.data import empty_blocks as empty
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_sealed import SealedFiles

K1, K2 = os.urandom(32), os.urandom(32)


def cipher(active: str = "k1", namespace: str = "default", **keys: bytes) -> BlockCipher:
    return BlockCipher("default", TenantKeys(active, keys or {"k1": K1}), namespace)


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


# -- blocks moved to another key or namespace ---------------------------------------------

#: ``open(place, namespace)``: a tier of the kind in its own place (a directory, a Redis key
#: prefix, an S3 prefix) sealing under k1, bound to ``namespace``.
Opener = Callable[[str, str], Tier]
#: ``copy(src, key, dst, key2, edit)``: ``src``'s stored bytes of ``key``, through ``edit``,
#: written verbatim where ``dst`` keeps ``key2``.
Copier = Callable[..., None]


@pytest.fixture(params=["disk", "redis", "s3"])
def places(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Opener, Copier, str]]:
    kind, layout, base = request.param, small_layout(), f"mv{uuid.uuid4().hex[:10]}"
    opened: list[Tier] = []
    if kind == "s3":
        request.getfixturevalue("aws_env")

    def open_tier(place: str, namespace: str) -> Tier:
        if kind == "disk":
            tier: Tier = disk_tier(tmp_path / place, layout)
        elif kind == "redis":
            tier = redis_tier(request.getfixturevalue("redis_server"), layout, f"{base}:{place}")
        else:
            tier = s3_tier(request.getfixturevalue("s3_server"), layout, f"{base}/{place}")
        tier.encrypt_with(cipher(namespace=namespace))
        opened.append(tier)
        return tier

    def copy(src: Any, key: BlockKey, dst: Any, key2: BlockKey, edit: Any = None) -> None:
        change = edit or (lambda data: data)
        if kind == "disk":
            Path(dst.block_path(key2)).parent.mkdir(parents=True, exist_ok=True)
            Path(dst.block_path(key2)).write_bytes(change(Path(src.block_path(key)).read_bytes()))
        elif kind == "redis":
            import redis

            client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
            client.set(dst.key_name(key2), change(client.get(src.key_name(key))))
            client.close()
        else:
            server = request.getfixturevalue("s3_server")
            got = server.client().get_object(Bucket=server.bucket, Key=src.object_name(key))
            body = change(got["Body"].read())
            server.client().put_object(Bucket=server.bucket, Key=dst.object_name(key2), Body=body)

    yield open_tier, copy, kind
    for tier in opened:
        tier.close()


def rewritten(data: bytes, *, key: bytes | None = None, version: int | None = None) -> bytes:
    """A sealed block with its header's key or format version changed, the header's
    checksum made right again: what someone who can write the medium can do."""
    out = bytearray(data)
    if key is not None:
        out[20:36] = key
    if version is not None:
        struct.pack_into("<H", out, 4, version)
    end = 52 + 12 * small_layout().num_layers + 44  # the sealed header's checked bytes
    struct.pack_into("<Q", out, end, xxhash.xxh3_64_intdigest(bytes(out[:end])))
    return bytes(out)


def assert_counted_misses(tier: Tier, key: BlockKey, misses: int = 2) -> None:
    """Whole and ranged reads of ``key`` miss; each is a decrypt failure, nothing deleted."""
    layout = tier.layout
    assert tier.get([key], empty(layout, 1)) == [False]
    assert tier.get([key], empty(layout, 1, (1, 2)), layers=(1, 2)) == [False]
    stats = tier.stats()
    assert stats["decrypt_failures"] == misses, stats
    assert stats.get("corrupt", 0) == 0  # moved is not rot ...
    assert tier.contains([key]) == [True]  # ... and not deleted: a later put overwrites it


def test_block_moved_to_another_key_is_a_counted_miss(places: Any) -> None:
    open_tier, copy, _ = places
    tier = open_tier("a", "team-a")
    keys, blocks = make_keys(3, salt=11), blocks_of(tier.layout, 1)
    assert tier.put(keys[:1], blocks) == [True]
    copy(tier, keys[0], tier, keys[1])  # as it is: its header names keys[0]
    assert_counted_misses(tier, keys[1])
    # Its header made to name the new key: the tag, which binds the key, fails.
    copy(tier, keys[0], tier, keys[2], lambda data: rewritten(data, key=keys[2]))
    fresh = open_tier("a", "team-a")
    assert_counted_misses(fresh, keys[2])
    outs = empty(tier.layout, 1)
    assert fresh.get(keys[:1], outs) == [True] and torch.equal(outs[0], blocks[0])


def test_block_moved_to_another_namespace_is_a_counted_miss(places: Any) -> None:
    """The same tenant, the same key, the same block key: only the namespace differs."""
    open_tier, copy, _ = places
    a, b = open_tier("ns-team-a", "team-a"), open_tier("ns-team-a-eval", "team-a-eval")
    keys, blocks = make_keys(1, salt=12), blocks_of(a.layout, 1)
    assert a.put(keys, blocks) == [True]
    copy(a, keys[0], b, keys[0])
    assert_counted_misses(b, keys[0])
    # The bytes are sound: a store of namespace team-a reads them in any place.
    elsewhere = open_tier("ns-team-a-copy", "team-a")
    copy(a, keys[0], elsewhere, keys[0])
    outs = empty(a.layout, 1)
    assert elsewhere.get(keys, outs) == [True] and torch.equal(outs[0], blocks[0])
    assert elsewhere.stats()["decrypt_failures"] == 0


def first_format(data: bytes, start: int, namespace: str) -> bytes:
    """``data`` (sealed now, its payload at ``start``) sealed again as format version 2
    sealed it, under the same key and nonce: each layer's associated data without the
    namespace. What a store of the first encrypting release wrote."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    header, out, offset = read_header(data), bytearray(rewritten(data, version=2)), start
    for i, n in enumerate(header.layer_nbytes):
        plain = bytearray(n - TAG_BYTES)
        stored = memoryview(data)[offset : offset + n]
        cipher(namespace=namespace).open_layer(header, i, stored, [memoryview(plain)])
        tail = (int.from_bytes(header.nonce[-4:], "little") ^ i).to_bytes(4, "little")
        aad = b"kvstore-aead-v1\0default\0k1\0" + header.layout_fp + header.key
        aad += struct.pack("<IB", i, int(header.codec))
        out[offset : offset + n] = AESGCM(K1).encrypt(header.nonce[:-4] + tail, plain, aad)
        offset += n
    return bytes(out)


def test_block_of_the_first_sealed_format_is_a_counted_miss(places: Any) -> None:
    """Format version 2 did not bind the namespace: its blocks are not opened, even where
    their tags verify by their own rule; a later put replaces them."""
    open_tier, copy, kind = places
    tier = open_tier("a", "default")
    keys, blocks = make_keys(1, salt=13), blocks_of(tier.layout, 1)
    assert tier.put(keys, blocks) == [True]
    start = 4096 if kind == "disk" else header_size(tier.layout.num_layers, sealed=True)
    copy(tier, keys[0], tier, keys[0], lambda data: first_format(data, start, "default"))
    assert_counted_misses(tier, keys[0])
    assert tier.put(keys, blocks) == [True]
    outs = empty(tier.layout, 1)
    assert tier.get(keys, outs) == [True] and torch.equal(outs[0], blocks[0])


def test_associated_data_binds_tenant_namespace_and_key() -> None:
    """One block, one key's bytes: it opens only for its own tenant and namespace."""
    layout = small_layout()
    key, block = make_keys(1, salt=14)[0], blocks_of(layout, 1)[0]
    keys = TenantKeys("k1", {"k1": K1})
    sealed = seal(encode_block(key, layout, block, 0), BlockCipher("team-a", keys, "ns-1"))
    header, payload = sealed.header, sealed.payload[0]
    assert (
        header.sealed_version == SEALED_VERSION == read_header(sealed.header_bytes).sealed_version
    )
    out = empty(layout, 1)[0]
    open_into(header, payload, layout, out, None, BlockCipher("team-a", keys, "ns-1"))
    assert torch.equal(out, block)
    for tenant, namespace in (("team-b", "ns-1"), ("team-a", "ns-2"), ("team-a", "ns-1\0")):
        with pytest.raises(DecryptError, match="does not verify"):
            open_into(header, payload, layout, out, None, BlockCipher(tenant, keys, namespace))
