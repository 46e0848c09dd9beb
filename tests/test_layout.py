"""KVLayout: shapes, byte sizes, per-layer ranges, fingerprint, validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidInputError, LayoutMismatchError
from kvstore.layout import KVLayout, parse_dtype

DTYPES = [
    ("bf16", torch.bfloat16, 2),
    ("fp16", torch.float16, 2),
    ("fp32", torch.float32, 4),
    ("fp8", torch.float8_e4m3fn, 1),
    ("fp8_e5m2", torch.float8_e5m2, 1),
    ("int8", torch.int8, 1),
]


@pytest.mark.parametrize("kv_factor", [1, 2])
@pytest.mark.parametrize(("name", "dtype", "itemsize"), DTYPES)
def test_shapes_and_sizes(kv_factor, name, dtype, itemsize):
    lay = KVLayout(
        num_layers=3, num_kv_heads=4, head_dim=16, block_tokens=8, dtype=name, kv_factor=kv_factor
    )
    assert lay.dtype is dtype
    assert lay.itemsize == itemsize
    assert lay.block_shape == (3, kv_factor, 8, 4, 16)
    assert lay.tensor_shape(0) == (3, kv_factor, 0, 4, 16)
    assert lay.tensor_shape(1) == lay.block_shape
    assert lay.tensor_shape(5) == (3, kv_factor, 40, 4, 16)
    assert lay.layer_nbytes == kv_factor * 8 * 4 * 16 * itemsize
    assert lay.block_nbytes == 3 * lay.layer_nbytes
    # the sizes agree with a real tensor of that shape
    block = torch.zeros(lay.block_shape, dtype=dtype)
    assert block.numel() * block.element_size() == lay.block_nbytes
    assert block[0].numel() * block.element_size() == lay.layer_nbytes
    for layer in range(3):
        assert lay.layer_range(layer) == (layer * lay.layer_nbytes, lay.layer_nbytes)


def test_worked_example_llama_8b():
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)  # defaults: 256 tokens, bf16, K+V
    assert lay.block_tokens == 256 and lay.dtype is torch.bfloat16 and lay.kv_factor == 2
    assert lay.layer_nbytes == 2 * 256 * 8 * 128 * 2 == 1 << 20
    assert lay.block_nbytes == 32 << 20
    assert lay.layer_range(31) == (31 << 20, 1 << 20)
    assert lay.tokens_to_blocks(0) == 0
    assert lay.tokens_to_blocks(255) == 0
    assert lay.tokens_to_blocks(256) == 1
    assert lay.tokens_to_blocks(1000) == 3


def test_layer_range_matches_contiguous_tensor_bytes():
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_tokens=2, dtype="fp16")
    block = torch.arange(np.prod(lay.block_shape), dtype=torch.float16).reshape(lay.block_shape)
    raw = block.view(torch.uint8).reshape(-1)
    for layer in range(3):
        off, n = lay.layer_range(layer)
        assert torch.equal(raw[off : off + n], block[layer].contiguous().view(torch.uint8).view(-1))


@pytest.mark.parametrize("layer", [-1, 3, 100])
def test_layer_range_out_of_range(layer):
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4)
    with pytest.raises(InvalidInputError):
        lay.layer_range(layer)


@pytest.mark.parametrize("n", [-1, 1.0, "2", None])
def test_tensor_shape_rejects_bad_counts(n):
    with pytest.raises(InvalidInputError):
        KVLayout(num_layers=3, num_kv_heads=2, head_dim=4).tensor_shape(n)


# -- dtypes -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("names", "dtype"),
    [
        (["bf16", "bfloat16", "BF16", "torch.bfloat16", torch.bfloat16], torch.bfloat16),
        (["fp16", "float16", "half", torch.float16], torch.float16),
        (["fp32", "float32", "float", torch.float32], torch.float32),
        (["fp8", "fp8_e4m3", "float8_e4m3fn", torch.float8_e4m3fn], torch.float8_e4m3fn),
        (["fp8_e5m2", "float8_e5m2", torch.float8_e5m2], torch.float8_e5m2),
    ],
)
def test_dtype_names_are_equivalent(names, dtype):
    layouts = [KVLayout(4, 2, 8, dtype=n) for n in names]
    for lay in layouts:
        assert lay.dtype is dtype
        assert parse_dtype(lay.dtype) is dtype
        assert lay == layouts[0]
        assert hash(lay) == hash(layouts[0])
        assert lay.fingerprint == layouts[0].fingerprint


@pytest.mark.parametrize("bad", ["bf17", "", "int32", torch.int64, torch.complex64, 2, None])
def test_unknown_dtype_raises(bad):
    with pytest.raises(InvalidInputError):
        KVLayout(4, 2, 8, dtype=bad)


# -- fingerprint --------------------------------------------------------------------
BASE = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "block_tokens": 16,
    "dtype": "bf16",
    "kv_factor": 2,
}


def test_fingerprint_is_stable_and_equal_for_equal_layouts():
    a, b = KVLayout(**BASE), KVLayout(**BASE)
    assert a == b and a is not b
    assert len(a.fingerprint) == 8
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint_hex == a.fingerprint.hex() == b.fingerprint_hex
    assert a.fingerprint == a.fingerprint  # cached, stable


def test_fingerprint_golden_value():
    # Stored in every block header and key seed: changing it makes every stored block unreadable.
    assert KVLayout(**BASE).fingerprint_hex == GOLDEN_FP
    assert KVLayout(32, 8, 128).fingerprint_hex == GOLDEN_FP_LLAMA


GOLDEN_FP = "a664ccda15eb2643"
GOLDEN_FP_LLAMA = "51c82709e14c590c"


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_dim": 16},
        {"block_tokens": 32},
        {"dtype": "fp16"},  # same itemsize as bf16: the dtype name must be covered
        {"dtype": "fp32"},
        {"dtype": "fp8"},
        {"dtype": "fp8_e5m2"},  # same itemsize as fp8_e4m3
        {"kv_factor": 1},
        # same byte size per block, different geometry
        {"num_kv_heads": 4, "head_dim": 4},
        {"num_layers": 2, "block_tokens": 32},
        {"kv_factor": 1, "num_kv_heads": 4},
    ],
)
def test_fingerprint_differs_when_any_field_differs(change):
    base = KVLayout(**BASE)
    other = KVLayout(**{**BASE, **change})
    assert other != base
    assert other.fingerprint != base.fingerprint
    with pytest.raises(LayoutMismatchError):
        base.check_same(other)
    with pytest.raises(LayoutMismatchError):
        other.check_same(base)


def test_check_same_accepts_equal_layout():
    KVLayout(**BASE).check_same(KVLayout(**{**BASE, "dtype": torch.bfloat16}))


def test_describe_is_plain():
    desc = KVLayout(**BASE).describe()
    assert desc == {
        "num_layers": 4,
        "kv_factor": 2,
        "block_tokens": 16,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "bfloat16",
        "order": "layer,kv,token,head,dim",
    }


def test_layout_is_frozen():
    lay = KVLayout(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_layers = 8  # type: ignore[misc]


# -- invalid values -----------------------------------------------------------------
@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "4", None])
def test_invalid_geometry_raises(field, value):
    with pytest.raises(InvalidInputError, match=field):
        KVLayout(**{**BASE, field: value})


@pytest.mark.parametrize(
    "value",
    [
        0,
        3,
        -2,
        "2",
        None,
        True,
        2.0,
    ],
)
def test_invalid_kv_factor_raises(value):
    with pytest.raises(InvalidInputError, match="kv_factor"):
        KVLayout(**{**BASE, "kv_factor": value})


# -- check_tensor ---------------------------------------------------------------------
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype="bf16")


@pytest.mark.parametrize("n", [0, 1, 3])
def test_check_tensor_accepts_right_tensor(n):
    kv = torch.zeros(LAY.tensor_shape(n), dtype=torch.bfloat16)
    assert LAY.check_tensor(kv, n) is kv
    # a non-contiguous view of the right shape is fine too
    big = torch.zeros(LAY.tensor_shape(n + 1), dtype=torch.bfloat16)
    view = big[:, :, : n * LAY.block_tokens]
    assert LAY.check_tensor(view, n) is view


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8, torch.int64])
def test_check_tensor_wrong_dtype(dtype):
    kv = torch.zeros(LAY.tensor_shape(2), dtype=dtype)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        LAY.check_tensor(kv, 2)


@pytest.mark.parametrize(
    "shape",
    [
        (2, 2, 12, 2, 4),  # 3 blocks of tokens, 2 asked for
        (2, 2, 7, 2, 4),  # not a whole number of blocks
        (3, 2, 8, 2, 4),  # layers
        (2, 1, 8, 2, 4),  # kv factor
        (2, 2, 8, 1, 4),  # heads
        (2, 2, 8, 2, 8),  # head_dim
    ],
)
def test_check_tensor_wrong_geometry(shape):
    kv = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatchError, match="shape"):
        LAY.check_tensor(kv, 2)


@pytest.mark.parametrize("shape", [(2, 2, 8, 8), (2, 2, 8, 2, 4, 1), (64,), ()])
def test_check_tensor_wrong_rank(shape):
    kv = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match="shape") as info:
        LAY.check_tensor(kv, 2)
    assert not isinstance(info.value, LayoutMismatchError)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 2, 8, 2, 4), dtype=np.float16),
        [[0.0]],
        None,
        b"\x00" * 256,
    ],
    ids=["numpy", "list", "None", "bytes"],
)
def test_check_tensor_non_tensor(bad):
    with pytest.raises(InvalidInputError, match=r"torch\.Tensor"):
        LAY.check_tensor(bad, 2)


def test_check_tensor_meta_device():
    kv = torch.empty(LAY.tensor_shape(2), dtype=torch.bfloat16, device="meta")
    with pytest.raises(InvalidInputError, match="device") as info:
        LAY.check_tensor(kv, 2)
    assert not isinstance(info.value, LayoutMismatchError)


def test_check_tensor_names_the_argument():
    with pytest.raises(InvalidInputError, match=r"^out "):
        LAY.check_tensor(torch.zeros(3), 1, what="out")
