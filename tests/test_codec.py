"""Block format: header, per-layer checksums, codecs; every failure is an error, never wrong KV."""

from __future__ import annotations

import dataclasses
import itertools
import struct

import lz4.block
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import CorruptBlockError, InvalidInputError, LayoutMismatchError
from kvstore.format import codec as codec_module
from kvstore.format.codec import (
    HEADER_ALIGN,
    MAGIC,
    VERSION,
    Codec,
    choose_codec,
    decode_block,
    decode_into,
    encode_block,
    header_size,
    layer_pieces,
    parse_header,
)
from kvstore.layout import KVLayout
from kvstore.native import memcopy

KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
CODECS = [Codec.RAW, Codec.LZ4, Codec.SHUFFLE_LZ4]
DTYPES = ["bf16", "fp16", "fp32", "fp8", "fp8_e5m2", "int8", "uint8"]
FIXED_NBYTES = 52  # magic .. stored payload bytes
LAYER_ENTRY = 12
CHECK_NBYTES = 8


def body_nbytes(num_layers: int) -> int:
    """Bytes of the header before its zero padding (fixed part, layer table, checksum)."""
    return FIXED_NBYTES + LAYER_ENTRY * num_layers + CHECK_NBYTES


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw_bytes(a), raw_bytes(b))


def make_block(layout: KVLayout, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = layout.block_shape
    if kind == "random":
        data = torch.randint(0, 256, (layout.block_nbytes,), dtype=torch.uint8, generator=gen)
        return data.view(layout.dtype).view(shape)
    if kind == "zeros":
        return torch.zeros(shape, dtype=layout.dtype)
    values = torch.randn(shape, generator=gen)  # "randn": realistic KV-like values
    if not layout.dtype.is_floating_point:
        values = (values * 40).clamp(-128, 127) + (128 if layout.dtype == torch.uint8 else 0)
    return values.to(layout.dtype)


layouts = st.builds(
    KVLayout,
    num_layers=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 16),
    block_tokens=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    kv_factor=st.sampled_from([1, 2]),
)
kinds = st.sampled_from(["random", "randn", "zeros"])
seeds = st.integers(0, 2**31 - 1)
codecs = st.sampled_from(CODECS)

SMALL = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=2, dtype="bf16")
MEDIUM = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=8, dtype="bf16")


# -- round trip ---------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(layout=layouts, kind=kinds, seed=seeds, codec=codecs, strided_src=st.booleans())
def test_round_trip_is_bit_identical(layout, kind, seed, codec, strided_src):
    block = make_block(layout, kind, seed)
    if strided_src:  # a chunk cut out of a multi-block tensor, as KVStore.put hands it over
        big = torch.cat([make_block(layout, "random", seed + 1), block], dim=2)
        block = big[:, :, layout.block_tokens :]
        assert not block.is_contiguous() or layout.num_layers * layout.kv_factor == 1
    enc = encode_block(KEY, layout, block, codec)
    data = enc.tobytes()
    assert len(data) == enc.nbytes == enc.header.total_nbytes
    assert len(enc.header_bytes) == header_size(layout.num_layers) == enc.header.header_nbytes
    assert enc.header.header_nbytes % HEADER_ALIGN == 0
    assert enc.header.codec == codec
    assert enc.header.raw_nbytes == layout.block_nbytes
    assert b"".join(bytes(p) for p in enc.parts()) == data
    for buf in (data, bytearray(data), memoryview(data)):
        out = decode_block(buf, layout, KEY)
        assert same_bits(out, block)
    assert same_bits(decode_block(data, layout), block)  # key=None: not checked
    assert parse_header(data, layout, KEY) == enc.header


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_and_codec(codec, dtype):
    layout = dataclasses.replace(MEDIUM, dtype=dtype)
    for kind in ("random", "randn", "zeros"):
        block = make_block(layout, kind, 7)
        assert same_bits(
            decode_block(encode_block(KEY, layout, block, codec).tobytes(), layout), block
        )


def test_header_fields_are_where_the_format_says():
    layout = MEDIUM
    block = make_block(layout, "randn", 1)
    enc = encode_block(KEY, layout, block, Codec.SHUFFLE_LZ4)
    h = enc.header_bytes
    assert h[:4] == MAGIC
    assert struct.unpack_from("<H", h, 4)[0] == VERSION
    assert h[6] == int(Codec.SHUFFLE_LZ4)
    assert h[7] == 0
    assert struct.unpack_from("<I", h, 8)[0] == layout.num_layers
    assert h[12:20] == layout.fingerprint
    assert h[20:36] == KEY
    assert struct.unpack_from("<QQ", h, 36) == (layout.block_nbytes, enc.header.payload_nbytes)
    end = body_nbytes(layout.num_layers)
    for i in range(layout.num_layers):
        n, c = struct.unpack_from("<IQ", h, FIXED_NBYTES + LAYER_ENTRY * i)
        assert n == enc.header.layer_nbytes[i]
        assert c == xxhash.xxh3_64_intdigest(bytes(enc.payload[i]))
    assert struct.unpack_from("<Q", h, end - 8)[0] == xxhash.xxh3_64_intdigest(h[: end - 8])
    assert h[end:] == bytes(len(h) - end)  # zero padding


@pytest.mark.parametrize("num_layers", [1, 2, 3, 4, 5, 10, 80])
def test_header_size(num_layers):
    raw = body_nbytes(num_layers)
    size = header_size(num_layers)
    assert size % HEADER_ALIGN == 0
    assert raw <= size < raw + HEADER_ALIGN


def test_raw_payload_is_stored_uncompressed():
    block = make_block(MEDIUM, "zeros", 0)
    enc = encode_block(KEY, MEDIUM, block, "raw")
    assert enc.header.payload_nbytes == MEDIUM.block_nbytes
    assert enc.tobytes()[enc.header.header_nbytes :] == bytes(raw_bytes(block).numpy())


def test_lz4_codecs_shrink_zeros():
    block = make_block(MEDIUM, "zeros", 0)
    for codec in (Codec.LZ4, Codec.SHUFFLE_LZ4):
        enc = encode_block(KEY, MEDIUM, block, codec)
        assert enc.header.payload_nbytes < MEDIUM.block_nbytes // 4


# -- decoding into a given tensor ---------------------------------------------------
@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_strided_view_of_a_bigger_tensor(codec):
    layout = MEDIUM
    block = make_block(layout, "randn", 3)
    data = encode_block(KEY, layout, block, codec).tobytes()
    big = torch.empty(layout.tensor_shape(3), dtype=layout.dtype)
    big.view(torch.uint8).fill_(0xA5)
    before = big.clone()
    bt = layout.block_tokens
    out = big[:, :, bt : 2 * bt]
    assert not out.is_contiguous()
    result = decode_block(data, layout, KEY, out=out)
    assert result is out
    assert same_bits(big[:, :, bt : 2 * bt], block)
    # nothing outside the view was touched
    assert same_bits(big[:, :, :bt], before[:, :, :bt])
    assert same_bits(big[:, :, 2 * bt :], before[:, :, 2 * bt :])


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_permuted_view(codec):
    layout = MEDIUM
    block = make_block(layout, "randn", 4)
    data = encode_block(KEY, layout, block, codec).tobytes()
    L, K, T, H, D = layout.block_shape
    # memory order (token, layer, kv, head, dim): same logical shape, other strides
    out = torch.zeros((T, L, K, H, D), dtype=layout.dtype).permute(1, 2, 0, 3, 4)
    assert out.shape == layout.block_shape and not out.is_contiguous()
    decode_block(data, layout, KEY, out=out)
    assert same_bits(out, block)


def test_decode_into_view_with_strided_last_dim():
    layout = MEDIUM
    block = make_block(layout, "randn", 5)
    data = encode_block(KEY, layout, block, Codec.RAW).tobytes()
    L, K, T, H, D = layout.block_shape
    out = torch.zeros((L, K, T, H, 2 * D), dtype=layout.dtype)[..., ::2]
    decode_block(data, layout, KEY, out=out)
    assert same_bits(out, block)


@pytest.mark.parametrize(
    "out",
    [
        torch.empty(MEDIUM.tensor_shape(2), dtype=torch.bfloat16),
        torch.empty(MEDIUM.block_shape, dtype=torch.float16),
        torch.empty(MEDIUM.block_shape[1:], dtype=torch.bfloat16),
    ],
    ids=["two_blocks", "wrong_dtype", "wrong_rank"],
)
def test_decode_into_wrong_target_raises(out):
    data = encode_block(KEY, MEDIUM, make_block(MEDIUM, "randn", 0)).tobytes()
    before = out.clone()
    with pytest.raises(InvalidInputError):
        decode_block(data, MEDIUM, KEY, out=out)
    assert same_bits(out, before)


# -- layer-range decode -------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(layout=layouts, kind=kinds, seed=seeds, codec=codecs, data=st.data())
def test_layer_range_decode(layout, kind, seed, codec, data):
    block = make_block(layout, kind, seed)
    encoded = encode_block(KEY, layout, block, codec).tobytes()
    hsize = header_size(layout.num_layers)
    header = parse_header(encoded[:hsize], layout, KEY)  # the header alone is enough
    first = data.draw(st.integers(0, layout.num_layers - 1))
    last = data.draw(st.integers(first + 1, layout.num_layers))
    offset, nbytes = header.layer_span(first, last)
    assert offset == sum(header.layer_nbytes[:first])
    assert nbytes == sum(header.layer_nbytes[first:last])
    payload = encoded[hsize + offset : hsize + offset + nbytes]
    out = torch.empty((last - first, *layout.block_shape[1:]), dtype=layout.dtype)
    decode_into(header, payload, layout, out, layers=(first, last))
    assert same_bits(out, block[first:last])


@pytest.mark.parametrize("codec", CODECS)
def test_layer_range_is_verified_on_its_own(codec):
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_tokens=4)
    block = make_block(layout, "randn", 9)
    encoded = bytearray(encode_block(KEY, layout, block, codec).tobytes())
    hsize = header_size(layout.num_layers)
    header = parse_header(encoded, layout, KEY)
    off3, _ = header.layer_span(3, 4)
    encoded[hsize + off3] ^= 0xFF  # corrupt layer 3 only
    out = torch.empty((2, *layout.block_shape[1:]), dtype=layout.dtype)
    off, n = header.layer_span(1, 3)
    decode_into(header, encoded[hsize + off : hsize + off + n], layout, out, layers=(1, 3))
    assert same_bits(out, block[1:3])  # layers 1..2 are intact and verified
    one = torch.empty((1, *layout.block_shape[1:]), dtype=layout.dtype)
    off, n = header.layer_span(3, 4)
    with pytest.raises(CorruptBlockError, match="layer 3"):
        decode_into(header, encoded[hsize + off : hsize + off + n], layout, one, layers=(3, 4))
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(encoded), layout, KEY)


def test_layer_range_errors():
    layout = MEDIUM
    encoded = encode_block(KEY, layout, make_block(layout, "randn", 0), Codec.LZ4).tobytes()
    header = parse_header(encoded, layout)
    for first, last in [(0, 0), (2, 1), (-1, 1), (0, 4), (3, 3)]:
        with pytest.raises(InvalidInputError):
            header.layer_span(first, last)
    _, n = header.layer_span(0, 2)
    hsize = header.header_nbytes
    out = torch.empty((2, *layout.block_shape[1:]), dtype=layout.dtype)
    with pytest.raises(CorruptBlockError, match="truncated"):
        decode_into(header, encoded[hsize : hsize + n - 1], layout, out, layers=(0, 2))
    with pytest.raises(InvalidInputError):  # out sized for 3 layers, range has 2
        decode_into(header, encoded[hsize:], layout, torch.empty(layout.block_shape), (0, 2))
    # the wrong layers' bytes for a range: checksum mismatch, not wrong data
    wrong = encoded[hsize + header.layer_nbytes[0] :]
    with pytest.raises(CorruptBlockError):
        decode_into(header, wrong, layout, out, layers=(0, 2))


# -- corruption ------------------------------------------------------------------------
def assert_flip_detected_or_harmless(layout, block, encoded: bytes, pos: int, mask: int):
    """Flip bits of byte ``pos``: decode must raise, unless the byte is header padding (not
    covered by any checksum) -- then decode must return exactly the original block."""
    corrupt = bytearray(encoded)
    corrupt[pos] ^= mask
    padding = range(body_nbytes(layout.num_layers), header_size(layout.num_layers))
    if pos in padding:
        out = decode_block(bytes(corrupt), layout, KEY)
        assert same_bits(out, block), f"flipped padding byte {pos} changed the decoded data"
        return
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(corrupt), layout, KEY)


@pytest.mark.parametrize("codec", CODECS)
def test_every_single_byte_flip_is_caught(codec):
    layout = SMALL
    block = make_block(layout, "randn", 11)
    encoded = encode_block(KEY, layout, block, codec).tobytes()
    for pos in range(len(encoded)):
        for mask in (0x01, 0x80, 0xFF):
            assert_flip_detected_or_harmless(layout, block, encoded, pos, mask)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, kind=kinds, seed=seeds, codec=codecs, data=st.data())
def test_random_byte_flip_is_caught(layout, kind, seed, codec, data):
    block = make_block(layout, kind, seed)
    encoded = encode_block(KEY, layout, block, codec).tobytes()
    hsize = header_size(layout.num_layers)
    # bias toward the header, where every field means something different
    region = data.draw(st.sampled_from(["header", "payload", "anywhere"]))
    lo, hi = {
        "header": (0, hsize),
        "payload": (hsize, len(encoded)),
        "anywhere": (0, len(encoded)),
    }[region]
    pos = data.draw(st.integers(lo, hi - 1))
    mask = data.draw(st.integers(1, 255))
    assert_flip_detected_or_harmless(layout, block, encoded, pos, mask)


def test_header_padding_is_zero_and_not_checksummed():
    """Documents the format: padding bytes are outside the header checksum."""
    layout = SMALL
    block = make_block(layout, "randn", 2)
    encoded = bytearray(encode_block(KEY, layout, block, Codec.RAW).tobytes())
    start, end = body_nbytes(layout.num_layers), header_size(layout.num_layers)
    assert end > start
    assert encoded[start:end] == bytes(end - start)
    encoded[start:end] = b"\xee" * (end - start)
    assert same_bits(decode_block(bytes(encoded), layout, KEY), block)


@pytest.mark.parametrize("codec", CODECS)
def test_every_truncation_is_caught(codec):
    layout = SMALL
    encoded = encode_block(KEY, layout, make_block(layout, "randn", 1), codec).tobytes()
    for n in range(len(encoded)):
        with pytest.raises(CorruptBlockError):
            decode_block(encoded[:n], layout, KEY)


@settings(max_examples=40, deadline=None)
@given(layout=layouts, kind=kinds, seed=seeds, codec=codecs, data=st.data())
def test_random_truncation_and_garbage_are_caught(layout, kind, seed, codec, data):
    encoded = encode_block(KEY, layout, make_block(layout, kind, seed), codec).tobytes()
    n = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(CorruptBlockError):
        decode_block(encoded[:n], layout, KEY)
    garbage = data.draw(st.binary(min_size=1, max_size=64))
    with pytest.raises(CorruptBlockError):
        decode_block(encoded + garbage, layout, KEY)


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_key_is_caught(codec):
    encoded = encode_block(KEY, MEDIUM, make_block(MEDIUM, "randn", 0), codec).tobytes()
    with pytest.raises(CorruptBlockError, match="key"):
        decode_block(encoded, MEDIUM, OTHER_KEY)
    with pytest.raises(CorruptBlockError):
        parse_header(encoded, MEDIUM, OTHER_KEY)


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "fp16"},  # same byte size, other dtype
        {"dtype": "fp32"},
        {"num_layers": 2},
        {"num_layers": 4},
        {"num_kv_heads": 1},
        {"head_dim": 8},
        {"block_tokens": 16},
        {"kv_factor": 1},
        {"num_kv_heads": 4, "head_dim": 8},  # same byte size, other geometry
    ],
)
@pytest.mark.parametrize("codec", CODECS)
def test_wrong_layout_is_caught(change, codec):
    encoded = encode_block(KEY, MEDIUM, make_block(MEDIUM, "randn", 0), codec).tobytes()
    other = dataclasses.replace(MEDIUM, **change)
    with pytest.raises(LayoutMismatchError):
        decode_block(encoded, other, KEY)
    with pytest.raises(LayoutMismatchError):
        parse_header(encoded, other)


@pytest.mark.parametrize(
    "data",
    [b"", b"KVSB", b"\x00" * 200, b"NOPE" + b"\x00" * 200],
    ids=["empty", "magic_only", "zeros", "bad_magic"],
)
def test_not_a_block(data):
    with pytest.raises(CorruptBlockError):
        decode_block(data, MEDIUM)


def _forge(header, payload: bytes) -> bytes:
    """A block whose header checksum is valid but whose content lies."""
    return header.pack() + payload


def test_forged_headers_with_valid_checksums_are_caught():
    layout = MEDIUM
    block = make_block(layout, "randn", 0)
    enc = encode_block(KEY, layout, block, Codec.RAW)
    payload = enc.tobytes()[enc.header.header_nbytes :]
    h = enc.header
    forged = [
        dataclasses.replace(h, raw_nbytes=h.raw_nbytes + 1),
        dataclasses.replace(h, payload_nbytes=h.payload_nbytes - 1),
        dataclasses.replace(h, layer_nbytes=(*h.layer_nbytes[:-1], h.layer_nbytes[-1] - 1)),
        dataclasses.replace(
            h, layer_nbytes=h.layer_nbytes[:-1], layer_checksums=h.layer_checksums[:-1]
        ),
        dataclasses.replace(h, layer_checksums=(0, *h.layer_checksums[1:])),
        dataclasses.replace(h, codec=Codec.LZ4),  # raw bytes are not an lz4 stream
    ]
    for bad in forged:
        with pytest.raises(CorruptBlockError):
            decode_block(_forge(bad, payload), layout, KEY)
    # sanity: the unmodified header packs back to a block that decodes
    assert same_bits(decode_block(_forge(h, payload), layout, KEY), block)


def test_forged_version_and_codec_are_caught():
    enc = encode_block(KEY, MEDIUM, make_block(MEDIUM, "randn", 0), Codec.RAW)
    data = bytearray(enc.tobytes())
    end = body_nbytes(MEDIUM.num_layers) - CHECK_NBYTES

    def reseal(buf: bytearray) -> bytes:
        struct.pack_into("<Q", buf, end, xxhash.xxh3_64_intdigest(bytes(buf[:end])))
        return bytes(buf)

    for offset, value in [(4, 2), (6, 7)]:  # version 2, codec 7 (checksum recomputed)
        buf = bytearray(data)
        buf[offset] = value
        with pytest.raises(CorruptBlockError):
            decode_block(reseal(buf), MEDIUM, KEY)
    buf = bytearray(data)
    struct.pack_into("<I", buf, 8, 0)  # zero layers
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(buf), MEDIUM, KEY)


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.SHUFFLE_LZ4])
def test_valid_checksum_but_wrong_decompressed_size_is_caught(codec):
    """A layer whose stored bytes match their checksum but do not decompress to a layer."""
    layout = MEDIUM
    enc = encode_block(KEY, layout, make_block(layout, "randn", 0), codec)
    stored = [bytes(p) for p in enc.payload]
    for fake in (lz4.block.compress(b"short", store_size=False), b"\xff\xff\xff\xff"):
        stored[1] = fake
        header = dataclasses.replace(
            enc.header,
            payload_nbytes=sum(len(s) for s in stored),
            layer_nbytes=tuple(len(s) for s in stored),
            layer_checksums=tuple(xxhash.xxh3_64_intdigest(s) for s in stored),
        )
        with pytest.raises(CorruptBlockError):
            decode_block(header.pack() + b"".join(stored), layout, KEY)


def test_raw_block_changed_after_encode_is_caught():
    """RAW encodes a zero-copy view; a block mutated before the bytes go out must not
    decode as if it were intact."""
    block = make_block(MEDIUM, "randn", 0)
    enc = encode_block(KEY, MEDIUM, block, Codec.RAW)
    block.view(torch.uint8).view(-1)[100] ^= 1
    with pytest.raises(CorruptBlockError):
        decode_block(enc.tobytes(), MEDIUM, KEY)


@pytest.mark.parametrize(
    "block",
    [
        torch.zeros(MEDIUM.tensor_shape(2), dtype=torch.bfloat16),
        torch.zeros(MEDIUM.block_shape, dtype=torch.float16),
        torch.zeros(MEDIUM.block_shape[1:], dtype=torch.bfloat16),
    ],
    ids=["two_blocks", "wrong_dtype", "wrong_rank"],
)
def test_encode_rejects_wrong_block(block):
    with pytest.raises(LayoutMismatchError):
        encode_block(KEY, MEDIUM, block)


# -- choose_codec ----------------------------------------------------------------------
KV_LAYOUT = KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, block_tokens=64, dtype="bf16")


def shuffle_ratio(block: torch.Tensor, layout: KVLayout) -> float:
    enc = encode_block(KEY, layout, block, Codec.SHUFFLE_LZ4)
    return enc.header.layer_nbytes[0] / layout.layer_nbytes


@pytest.mark.parametrize("seed", [0, 1])
def test_choose_codec_on_realistic_bf16_kv(seed):
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(KV_LAYOUT.block_shape, generator=gen).to(torch.bfloat16)
    ratio = shuffle_ratio(block, KV_LAYOUT)
    chosen = choose_codec(block, KV_LAYOUT)
    assert (chosen == Codec.SHUFFLE_LZ4) == (ratio <= 0.9), ratio
    # byte-plane shuffling does pay on bf16 KV (the design's premise) ...
    assert chosen == Codec.SHUFFLE_LZ4, ratio
    # ... while plain lz4 barely does
    lz4_ratio = encode_block(KEY, KV_LAYOUT, block, Codec.LZ4).header.payload_nbytes
    assert lz4_ratio / KV_LAYOUT.block_nbytes > ratio
    # the threshold is honoured both ways
    assert choose_codec(block, KV_LAYOUT, min_saving=0.0) == Codec.SHUFFLE_LZ4
    assert choose_codec(block, KV_LAYOUT, min_saving=0.5) == (
        Codec.SHUFFLE_LZ4 if ratio <= 0.5 else Codec.RAW
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8"])
def test_choose_codec_random_bytes_is_raw(dtype):
    layout = dataclasses.replace(KV_LAYOUT, dtype=dtype)
    block = make_block(layout, "random", 3)
    assert shuffle_ratio(block, layout) > 0.9
    assert choose_codec(block, layout) == Codec.RAW


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8"])
@pytest.mark.parametrize("kind", ["randn", "zeros"])
def test_choose_codec_consistent_with_measured_size(dtype, kind):
    layout = dataclasses.replace(KV_LAYOUT, dtype=dtype)
    block = make_block(layout, kind, 5)
    ratio = shuffle_ratio(block, layout)
    assert (choose_codec(block, layout) == Codec.SHUFFLE_LZ4) == (ratio <= 0.9)
    if kind == "zeros":
        assert choose_codec(block, layout) == Codec.SHUFFLE_LZ4


def test_choose_codec_looks_at_layer_zero_only():
    block = make_block(KV_LAYOUT, "random", 0)
    block[0].zero_()
    assert choose_codec(block, KV_LAYOUT) == Codec.SHUFFLE_LZ4


# -- Codec.parse -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "codec"),
    [
        ("raw", Codec.RAW),
        ("RAW", Codec.RAW),
        ("none", Codec.RAW),
        ("lz4", Codec.LZ4),
        ("LZ4", Codec.LZ4),
        ("shuffle-lz4", Codec.SHUFFLE_LZ4),
        ("shuffle_lz4", Codec.SHUFFLE_LZ4),
        ("shuffle+lz4", Codec.SHUFFLE_LZ4),
        ("Shuffle-LZ4", Codec.SHUFFLE_LZ4),
        ("shuffle", Codec.SHUFFLE_LZ4),
        (0, Codec.RAW),
        (1, Codec.LZ4),
        (2, Codec.SHUFFLE_LZ4),
        (Codec.LZ4, Codec.LZ4),
    ],
)
def test_codec_parse(name, codec):
    assert Codec.parse(name) is codec


@pytest.mark.parametrize("name", ["zstd", "", "lz5", "raw lz4"])
def test_codec_parse_unknown_name(name):
    with pytest.raises(InvalidInputError, match="codec"):
        Codec.parse(name)


@pytest.mark.parametrize("value", [7, -1, None, 1.5, b"raw"])
def test_codec_parse_bad_values_raise_invalid_input(value):
    with pytest.raises(InvalidInputError):
        Codec.parse(value)


def test_layer_pieces_alias_each_layer_of_a_chunk_view() -> None:
    """A chunk of an engine tensor: one writable 1-D byte view per (layer, kv) slab,
    aliasing the tensor (no copy); None where a slab is not contiguous."""
    kv = torch.randn(4, 2, 64, 4, 16).to(torch.bfloat16)
    chunk = kv[:, :, 16:32]
    pieces = layer_pieces(chunk)
    assert pieces is not None and [len(row) for row in pieces] == [2] * 4
    for layer, row in enumerate(pieces):
        for k, piece in enumerate(row):
            assert piece.ndim == 1 and len(piece) == 16 * 4 * 16 * 2 and not piece.readonly
            assert bytes(piece) == chunk[layer, k].contiguous().view(torch.uint8).numpy().tobytes()
    pieces[2][1][:2] = b"\x00\x00"  # writes land in the tensor itself
    assert chunk[2, 1].reshape(-1)[0].item() == 0
    whole = layer_pieces(kv[:1].contiguous())
    assert whole is not None and len(whole) == 1 and len(whole[0][0]) == 2 * 64 * 4 * 16 * 2
    assert layer_pieces(kv.transpose(3, 4)) is None
    assert layer_pieces(kv[:, :, :, :, ::2]) is None


# -- one pass: checksums verified while copying (csrc/memcopy.c) ----------------------
needs_native = pytest.mark.skipif(
    memcopy is None or not hasattr(memcopy, "copy_verified"),
    reason="kvstore.native._memcopy is not built",
)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_verified_hashes_as_xxhash_and_names_the_first_bad_region(threads):
    sizes = [1, 5, 65536, 65537, 300_000, 1 << 20, 0, 7]
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (sum(sizes) + 9,), dtype=torch.uint8, generator=gen).numpy()
    starts = np.cumsum([0, *sizes])
    sums = np.array(
        [xxhash.xxh3_64_intdigest(src[a:b].tobytes()) for a, b in itertools.pairwise(starts)],
        dtype=np.uint64,
    )
    table = np.array(sizes, dtype=np.uint64)
    dst = np.zeros_like(src)
    assert memcopy.copy_verified(dst, src, table, sums, threads) == -1
    assert np.array_equal(dst[: sum(sizes)], src[: sum(sizes)])
    assert not dst[sum(sizes) :].any()  # nothing past the regions
    bad = sums.copy()
    bad[[5, 7]] ^= np.uint64(1)
    assert memcopy.copy_verified(np.zeros_like(src), src, table, bad, threads) == 5
    with pytest.raises(ValueError, match="past the end"):
        memcopy.copy_verified(np.zeros(3, dtype=np.uint8), src, table, sums, threads)
    with pytest.raises(ValueError, match="one uint64 each"):
        memcopy.copy_verified(dst, src, table, sums[:-1], threads)


@needs_native
def test_raw_decode_verifies_in_the_copying_pass(monkeypatch):
    layout = MEDIUM
    block = make_block(layout, "randn", 5)
    encoded = bytearray(encode_block(KEY, layout, block, Codec.RAW).tobytes())
    calls = []
    real = codec_module._COPY_VERIFIED

    def counting(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(codec_module, "_COPY_VERIFIED", counting)
    assert same_bits(decode_block(bytes(encoded), layout, KEY), block)
    assert len(calls) == 1  # one C call for every layer
    monkeypatch.setattr(codec_module, "decode_layer", lambda *a: pytest.fail("a second pass"))
    last = len(encoded) - 1  # a byte of the last layer: the earlier ones were copied
    encoded[last] ^= 0x10
    with pytest.raises(CorruptBlockError, match=f"layer {layout.num_layers - 1}"):
        decode_block(
            bytes(encoded), layout, KEY, out=torch.empty(layout.block_shape, dtype=layout.dtype)
        )
