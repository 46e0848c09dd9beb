"""Codecs of one's own (:mod:`kvstore.format.codecs`): registered by name or through an installed
package's ``kvstore.codecs`` entry point, named in a disk tier's YAML config, written in
each block's header, and a block whose codec is not there reads as a miss."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVStore
from kvstore.cli.servers import RedisServer, S3Server
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, CorruptBlockError, InvalidInputError
from kvstore.format.codec import codec_number, decode_block, encode_block, read_header
from kvstore.format.codecs import CODECS, LayerCodec, codec_names
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()


def _compress(layer: np.ndarray, itemsize: int) -> bytes:
    return zlib.compress(layer.tobytes(), 1)


def _decompress(stored: bytes, raw_nbytes: int, itemsize: int) -> np.ndarray:
    return np.frombuffer(zlib.decompress(stored), dtype=np.uint8)


ZLIB = LayerCodec(200, _compress, _decompress)


@pytest.fixture(autouse=True)
def fresh_codecs() -> Iterator[None]:
    with CODECS.scoped():
        yield


def test_a_registered_codec_round_trips_and_is_named_in_the_header() -> None:
    CODECS.register("zlib", f"{__name__}:ZLIB")
    assert "zlib" in codec_names() and codec_number("zlib") == 200
    block = torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype)
    data = encode_block(b"k" * 16, LAYOUT, block, "zlib").tobytes()
    assert read_header(data).codec == 200
    assert torch.equal(decode_block(data, LAYOUT, b"k" * 16), block)
    CODECS.register("zlib", LayerCodec(201, _compress, _decompress), clobber=True)
    with pytest.raises(CorruptBlockError, match="unknown codec 200"):  # gone: never wrong KV
        decode_block(data, LAYOUT, b"k" * 16)


def test_a_codec_name_is_refused_twice_and_a_number_must_be_a_plugins() -> None:
    CODECS.register("zlib", ZLIB)
    with pytest.raises(ConfigError, match=r"'zlib' is registered already.*clobber=True"):
        CODECS.register("zlib", LayerCodec(201, _compress, _decompress))
    with pytest.raises(ConfigError, match="'raw' is registered already"):
        CODECS.register("raw", ZLIB)
    CODECS.register("low", LayerCodec(3, _compress, _decompress))
    with pytest.raises(InvalidInputError, match=r"number 3 is not in 16\.\.255"):
        codec_number("low")
    CODECS.register("twin", LayerCodec(200, _compress, _decompress))
    with pytest.raises(InvalidInputError, match="both have number 200"):
        codec_number("twin")
    with pytest.raises(ConfigError, match="'auto' is taken"):
        CODECS.register("auto", ZLIB)


def test_a_disk_tier_stores_with_a_registered_codec_named_in_yaml(tmp_path: Path) -> None:
    CODECS.register("zlib", ZLIB)
    path = tmp_path / "store.yaml"
    path.write_text(
        f"tiers:\n  - {{kind: disk, path: {tmp_path / 'blocks'}, capacity: 1MiB, codec: zlib}}\n"
    )
    kv = random_blocks(LAYOUT, 2)
    with KVStore(LAYOUT, path) as store:
        keys = store.hash_tokens(range(2 * LAYOUT.block_tokens), "m")
        assert store.put(keys, kv) == 2
    with KVStore(LAYOUT, path) as store:  # read back from the files
        assert torch.equal(store.get(keys), kv)
    files = [p for p in (tmp_path / "blocks").rglob("*.kvb") if p.stat().st_size]
    assert any(read_header(f.read_bytes()).codec == 200 for f in files if f.stat().st_size > 64)
    with pytest.raises(ConfigError, match=r"unknown codec 'zstd'; use one of raw, lz4.*zlib"):
        StoreConfig.from_dict({"tiers": [{"kind": "disk", "codec": "zstd"}]}, environ={})


def test_s3_and_redis_tiers_store_with_a_registered_codec(
    s3_server: S3Server, redis_server: RedisServer, aws_env: None
) -> None:
    CODECS.register("zlib", ZLIB)
    s3 = {"kind": "s3", "bucket": s3_server.bucket, "endpoint_url": s3_server.url}
    s3.update(prefix=f"codec-{uuid.uuid4().hex[:12]}", region="us-east-1", codec="zlib")
    redis = {"kind": "redis", "url": redis_server.url, "codec": "zlib"}
    redis["key_prefix"] = f"codec-{uuid.uuid4().hex[:12]}"
    kv = random_blocks(LAYOUT, 2)
    for tier in (s3, redis):
        with KVStore(LAYOUT, {"tiers": [tier]}) as store:
            keys = store.hash_tokens(range(2 * LAYOUT.block_tokens), str(tier["kind"]))
            assert store.put(keys, kv) == 2
        with KVStore(LAYOUT, {"tiers": [tier]}) as store:  # a new store: read from the server
            assert torch.equal(store.get(keys), kv)
    stored = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=s3["prefix"])
    body = s3_server.client().get_object(Bucket=s3_server.bucket, Key=stored["Contents"][0]["Key"])
    assert read_header(body["Body"].read()).codec == 200


PLUGIN = """
import zlib

import numpy as np

from kvstore.format.codecs import LayerCodec

DEFLATE = LayerCodec(
    201,
    lambda layer, itemsize: zlib.compress(layer.tobytes()),
    lambda stored, n, itemsize: np.frombuffer(zlib.decompress(stored), dtype=np.uint8),
)
"""


def test_a_codec_from_an_installed_packages_entry_point_works_from_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    info = site / "deflate_codec-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deflate-codec\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvstore.codecs]\ndeflate = deflate_codec:DEFLATE\n")
    (site / "deflate_codec.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    assert "deflate" not in CODECS
    path = tmp_path / "store.yaml"
    path.write_text(
        f"tiers:\n  - {{kind: disk, path: {tmp_path / 'b'}, capacity: 1MiB, codec: deflate}}\n"
    )
    kv = random_blocks(LAYOUT, 1)
    with KVStore(LAYOUT, path) as store:
        keys = store.hash_tokens(range(LAYOUT.block_tokens), "m")
        store.put(keys, kv)
    with KVStore(LAYOUT, path) as store:
        assert torch.equal(store.get(keys), kv)
