"""Lossy block encodings in the block format (issue 55): round trips within each
encoding's error bound, sizes, the version 4 header, blocks of older formats, damaged
encoded blocks, sealing the encoded bytes, and the settings that name them."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstore import KVLayout
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, CorruptBlockError, DecryptError, InvalidInputError
from kvstore.format import (
    ENCODED_VERSION,
    BlockCipher,
    BlockEncoding,
    Codec,
    Encoding,
    TenantKeys,
    decode_block,
    decode_into,
    decode_seconds_per_byte,
    encode_block,
    open_into,
    parse_header,
    read_header,
    seal,
)
from kvstore.format.quant import fp8_as_half

FIXTURES = Path(__file__).parent / "fixtures" / "blocks"
KEY = bytes(range(16))
ENCODINGS = ("fp8_e4m3", "int8", "int4")


def layout_of(dtype: torch.dtype = torch.bfloat16, kv_factor: int = 2, **kw: int) -> KVLayout:
    fields = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 32, "block_tokens": 32, **kw}
    return KVLayout(dtype=dtype, kv_factor=kv_factor, **fields)


def random_block(layout: KVLayout, seed: int = 0, outliers: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.block_shape, generator=gen)
    if outliers:  # channels of very different scales, as real K caches have
        x *= torch.randn((layout.num_layers, layout.kv_factor, 1, 1, layout.head_dim)).exp()
    return x.to(layout.dtype)


def enc(name: str, group: int = 16) -> BlockEncoding:
    parsed = BlockEncoding.parse(name, group)
    assert parsed is not None
    return parsed


def bound(name: str, x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Per value, the most an encoding may move it: half a quantization step (fp8: an
    eighth of the value's binade, or the subnormal step), plus the output dtype's
    rounding of the decoded value."""
    x = x.float()
    out_ulp = x.abs() * 2.0**-7 + 1e-30
    if name in ("fp8_e4m3", "int8"):
        amax = x.abs().amax(-1, keepdim=True)
        if name == "int8":
            return amax / 127 / 2 * 1.001 + out_ulp
        return torch.maximum(x.abs() / 16, amax / 448 * 2.0**-9) * 1.001 + out_ulp
    layers, kv, tokens, heads, dim = x.shape
    steps = []
    for plane in range(kv):
        p = x[:, plane]
        if plane == 0:  # keys: per channel, groups of tokens
            g = p.reshape(layers, tokens // group, group, heads, dim)
            span = g.amax(2, keepdim=True) - g.amin(2, keepdim=True)
            step = span.expand_as(g).reshape(p.shape)
        else:  # values: per token, groups of dims
            g = p.reshape(layers, tokens, heads, dim // group, group)
            span = g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)
            step = span.expand_as(g).reshape(p.shape)
        steps.append(step / 15)
    # bfloat16 minimum and step: a value is off by half a step plus their rounding
    return torch.stack(steps, 1) * 0.51 + x.abs().amax() * 2.0**-8 * 16 / 15 + out_ulp


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_factor", [2, 1])
def test_round_trip_is_within_the_encodings_bound(name, dtype, kv_factor):
    layout = layout_of(dtype, kv_factor)
    block = random_block(layout)
    before = block.clone()
    encoded = encode_block(KEY, layout, block, encoding=enc(name))
    assert torch.equal(block, before)  # the caller's block is never scaled in place
    out = decode_block(encoded.tobytes(), layout, KEY)
    assert out.dtype == dtype and out.shape == block.shape
    err = (out.float() - block.float()).abs()
    assert bool((err <= bound(name, block)).all()), float((err - bound(name, block)).max())
    assert float(err.mean()) > 0  # lossy: something moved


@pytest.mark.parametrize("name", ENCODINGS)
def test_sizes_and_the_version_4_header(name):
    layout = layout_of()
    encoding = enc(name)
    encoded = encode_block(KEY, layout, random_block(layout), encoding=encoding)
    data = encoded.tobytes()
    version, codec, flags = struct.unpack_from("<HBB", data, 4)
    assert (version, codec) == (ENCODED_VERSION, int(encoding.kind))
    assert flags == (4 << 4 if name == "int4" else 0)  # log2(16) in the high nibble
    header = read_header(data)
    assert header.encoding == encoding and header.version == ENCODED_VERSION
    assert header.raw_nbytes == layout.block_nbytes
    per_layer = encoding.layer_nbytes(layout)
    assert header.layer_nbytes == (per_layer,) * layout.num_layers
    rows = 2 * 32 * 2
    expected = {"fp8_e4m3": rows * (4 + 32), "int8": rows * (4 + 32)}
    # int4: keys 2 token groups x 64 channels, values 32 x 2 x 2 dim groups; bf16 pairs
    expected["int4"] = 4 * (2 * 64) + 4 * (32 * 2 * 2) + 2 * (32 * 2 * 32 // 2)
    assert per_layer == expected[name]
    assert len(data) == header.header_nbytes + per_layer * layout.num_layers
    assert per_layer / layout.layer_nbytes < (0.6 if name != "int4" else 0.4)


def test_encoding_none_writes_todays_format():
    layout = layout_of()
    block = random_block(layout)
    assert BlockEncoding.parse("none") is None
    plain = encode_block(KEY, layout, block, Codec.RAW, None).tobytes()
    assert struct.unpack_from("<H", plain, 4)[0] == 1
    assert plain == encode_block(KEY, layout, block, Codec.RAW).tobytes()


def test_blocks_written_before_the_encodings_still_read():
    """Bytes the encoder wrote before version 4 existed (tests/fixtures/blocks)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
    raw = (FIXTURES / "v1-raw.kvsb").read_bytes()
    expected = torch.randn(layout.block_shape, generator=torch.Generator().manual_seed(55))
    got = decode_block(raw, layout, KEY)
    assert torch.equal(got, expected.to(torch.bfloat16))
    shuffled = (FIXTURES / "v1-shuffle-lz4.kvsb").read_bytes()
    assert read_header(shuffled).codec == Codec.SHUFFLE_LZ4
    assert torch.equal(decode_block(shuffled, layout, KEY), got)
    sealed = (FIXTURES / "v3-sealed-raw.kvsb").read_bytes()
    header = parse_header(sealed, layout, KEY)
    assert header.sealed and header.version == 3 and header.encoding is None
    cipher = BlockCipher("default", TenantKeys("k1", {"k1": bytes(range(32))}), "default")
    out = torch.empty(layout.block_shape, dtype=layout.dtype)
    open_into(header, memoryview(sealed)[header.header_nbytes :], layout, out, None, cipher)
    assert torch.equal(out, got)


@pytest.mark.parametrize("name", ENCODINGS)
def test_decode_into_a_chunk_view_and_a_layer_range(name):
    layout = layout_of()
    block = random_block(layout)
    encoded = encode_block(KEY, layout, block, encoding=enc(name))
    whole = decode_block(encoded.tobytes(), layout, KEY)
    big = torch.zeros((3, 2, 96, 2, 32), dtype=layout.dtype)
    view = big[:, :, 32:64]  # the engine's chunk view: not contiguous
    decode_into(encoded.header, encoded.tobytes()[encoded.header.header_nbytes :], layout, view)
    assert torch.equal(view, whole)
    assert not big[:, :, :32].any() and not big[:, :, 64:].any()
    offset, span = encoded.header.layer_span(1, 3)
    body = encoded.tobytes()[encoded.header.header_nbytes :][offset : offset + span]
    part = torch.empty((2, *layout.block_shape[1:]), dtype=layout.dtype)
    decode_into(encoded.header, body, layout, part, (1, 3))
    assert torch.equal(part, whole[1:3])


def test_zeros_and_constant_rows_decode_exactly():
    layout = layout_of()
    zeros = torch.zeros(layout.block_shape, dtype=layout.dtype)
    for name in ENCODINGS:
        data = encode_block(KEY, layout, zeros, encoding=enc(name)).tobytes()
        assert not decode_block(data, layout, KEY).any()
    ones = torch.full(layout.block_shape, 3.0, dtype=layout.dtype)
    for name in ("fp8_e4m3", "int8"):  # the row's maximum is its scale: exact
        data = encode_block(KEY, layout, ones, encoding=enc(name)).tobytes()
        assert torch.equal(decode_block(data, layout, KEY), ones)


def test_fp8_bytes_widen_exactly():
    codes = np.arange(256, dtype=np.uint8)
    reference = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    widened = fp8_as_half(codes).astype(np.float32) * 256
    finite = ~np.isnan(reference)
    assert finite.sum() == 254
    assert np.array_equal(reference[finite], widened[finite])


@pytest.mark.parametrize("name", ENCODINGS)
def test_every_byte_flip_of_an_encoded_block_is_caught(name):
    layout = layout_of(num_layers=1, head_dim=16, block_tokens=16)
    data = encode_block(KEY, layout, random_block(layout), encoding=enc(name)).tobytes()
    header = read_header(data)
    used = list(range(52 + 12 + 8)) + list(range(header.header_nbytes, len(data)))
    for i in used:
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        with pytest.raises((CorruptBlockError, InvalidInputError)):
            decode_block(bytes(damaged), layout, KEY)


def test_an_encoded_block_of_the_wrong_sizes_is_corrupt():
    """A whole header (checksum recomputed) whose encoding or group does not match its
    layers' sizes, or whose layout the encoding cannot hold, is corrupt, not decoded."""
    layout = layout_of()
    encoded = encode_block(KEY, layout, random_block(layout), encoding=enc("int4"))
    for change in ({"group_size": 8}, {"codec": int(Encoding.FP8_E4M3), "group_size": 0}):
        forged = dataclasses.replace(encoded.header, **change).pack()
        with pytest.raises(CorruptBlockError):
            decode_block(forged + encoded.tobytes()[len(forged) :], layout, KEY)
    with pytest.raises(CorruptBlockError, match="group"):
        read_header(_with_flags(encoded.header_bytes, 0))  # int4 without a group


def _with_flags(header: bytes, flags: int) -> bytes:
    body = bytearray(header)
    body[7] = flags
    end = 52 + 12 * read_header(header).num_layers
    body[end : end + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body[:end])))
    return bytes(body)


def test_sealing_covers_the_encoded_bytes_and_binds_the_encoding():
    layout = layout_of()
    block = random_block(layout)
    cipher = BlockCipher("default", TenantKeys("k1", {"k1": os.urandom(32)}), "ns")
    plain = encode_block(KEY, layout, block, encoding=enc("int8"))
    sealed = seal(plain, cipher)
    data = sealed.tobytes()
    assert len(data) < layout.block_nbytes  # what is sealed is the encoded bytes
    header = parse_header(data, layout, KEY)
    assert header.sealed and header.version == ENCODED_VERSION and header.encoding == enc("int8")
    out = torch.empty(layout.block_shape, dtype=layout.dtype)
    open_into(header, memoryview(data)[header.header_nbytes :], layout, out, None, cipher)
    assert torch.equal(out, decode_block(plain.tobytes(), layout, KEY))
    # int8 and fp8 layers have the same sizes: naming the other one fails its tag
    forged = dataclasses.replace(header, codec=int(Encoding.FP8_E4M3)).pack()
    relabelled = parse_header(forged + data[len(forged) :], layout, KEY)
    with pytest.raises(DecryptError):
        body = memoryview(data)[header.header_nbytes :]
        open_into(relabelled, body, layout, out, None, cipher)


def test_layouts_an_encoding_cannot_hold_are_refused():
    with pytest.raises(ConfigError, match="group_size 64 does not divide block_tokens"):
        enc("int4", 64).check(layout_of())
    with pytest.raises(ConfigError, match="8-bit already"):
        enc("fp8_e4m3").check(layout_of(torch.float8_e4m3fn))
    with pytest.raises(InvalidInputError):
        encode_block(KEY, layout_of(), random_block(layout_of()), encoding=enc("int4", 64))
    with pytest.raises(ConfigError, match="use one of none, fp8_e4m3, int8, int4"):
        BlockEncoding.parse("fp4")
    with pytest.raises(ConfigError, match="power of two"):
        BlockEncoding.parse("int4", 48)


def test_decode_cost_is_measured():
    layout = layout_of()
    cost = decode_seconds_per_byte(enc("fp8_e4m3"), layout)
    assert 0 < cost < 1e-6  # at least 1 MB/s: a measurement, not a constant


@pytest.mark.parametrize(
    ("tier", "error"),
    [
        ({"kind": "disk", "encoding": "fp4"}, "unknown encoding 'fp4'; use one of none"),
        ({"kind": "disk", "encoding": "int4", "group_size": 24}, "group_size: must be a power"),
        ({"kind": "s3", "bucket": "b", "encoding": "int8", "codec": "lz4"}, "uncompressed"),
        ({"kind": "host", "encoding": "fp8_e4m3"}, "host tier stores no encoded blocks"),
        ({"kind": "device", "encoding": "int8"}, "device tier stores no encoded blocks"),
        ({"kind": "remote", "address": "h:1", "encoding": "int8"}, "server's tiers"),
    ],
)
def test_tier_settings_are_checked(tier, error):
    with pytest.raises(ConfigError, match=error):
        StoreConfig.from_dict({"tiers": [tier]})


def test_tier_settings_read():
    config = StoreConfig.from_dict(
        {
            "tiers": [
                {"kind": "disk", "encoding": "FP8_E4M3"},
                {"kind": "s3", "bucket": "b", "encoding": "int4", "group_size": 64},
                {"kind": "redis", "encoding": "none"},
            ]
        }
    )
    disk, s3, redis = config.tiers
    assert (disk.encoding, s3.encoding, s3.group_size, redis.encoding) == (
        "fp8_e4m3",
        "int4",
        64,
        "none",
    )
    assert StoreConfig.from_dict(config.to_dict()) == config
