"""Chunk keys: chained xxh3-128 over int32-LE token bytes, namespaced, deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVStore
from kvstore import keys as keys_mod
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, LayoutMismatchError
from kvstore.keys import (
    KEY_BYTES,
    Namespace,
    chain_keys,
    check_keys,
    engine_keys,
    format_key,
    tail_key,
    tokens_to_bytes,
)
from kvstore.layout import KVLayout

B = 16  # block_tokens of the main test layout
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=B, dtype="bf16")
MODEL = "org/model@rev1"
SMALL_CONFIG = {"tiers": [{"kind": "host", "capacity": "1MiB"}]}


def make_store(layout: KVLayout = LAYOUT) -> KVStore:
    # environ={}: a developer's KVSTORE_* variables must not change what these tests build.
    return KVStore(layout, StoreConfig.from_dict(SMALL_CONFIG, environ={}))


@pytest.fixture(scope="module")
def store():
    s = make_store()
    yield s
    s.close()


def tokens(n: int, start: int = 1000) -> list[int]:
    return [(start + 7919 * i) % 50_000 for i in range(n)]


def le_int32(chunk: list[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk)


# -- determinism ------------------------------------------------------------
_CHILD = """
import json, sys
from kvstore import KVStore, KVLayout
from kvstore.config import StoreConfig
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype="bf16")
cfg = StoreConfig.from_dict({"tiers": [{"kind": "host", "capacity": "1MiB"}]}, environ={})
store = KVStore(layout, cfg)
keys = store.hash_tokens(json.loads(sys.argv[1]), sys.argv[2])
print(layout.fingerprint.hex(), store.namespace(sys.argv[2]).seed.hex())
print(",".join(k.hex() for k in keys))
store.close()
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(extra)
    return env


def test_keys_identical_across_processes_and_hash_seeds(store):
    toks = tokens(5 * B + 3)
    keys = ",".join(k.hex() for k in store.hash_tokens(toks, MODEL))
    assert keys.count(",") == 4
    expected = f"{LAYOUT.fingerprint.hex()} {store.namespace(MODEL).seed.hex()}\n{keys}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(toks), MODEL],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_clean_env(PYTHONHASHSEED=seed),
        )
        for seed in ("0", "4242")
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    assert outputs == [expected] * len(procs)


def test_golden_keys_are_stable_across_versions(store):
    # Keys are persisted (disk, S3, a shared Redis index): changing the seed or chain format
    # silently turns every stored block into a miss. Update only with a format version bump.
    keys = store.hash_tokens(list(range(2 * B)), "golden-model@1")
    assert [k.hex() for k in keys] == GOLDEN_KEYS


GOLDEN_KEYS = [
    "4d610e4c743e6839f292de53805c29c6",
    "f75c0f29b1a1786ca86d793d86c58e2f",
]


# Many keys at several block sizes, from the implementation before the C path (a digest of
# their concatenation): the C loop and the Python fallback must both keep giving these.
GOLDEN_TOKENS = b"".join(
    ((2654435761 * i + 12345) % 2**32).to_bytes(4, "little") for i in range(4096)
)
GOLDEN_CHAIN_DIGESTS = {
    1: "cc1369c14ca0a9e57a044263f2e99133",
    3: "c2017815431207d88d5a1631c6504a27",
    16: "e8bce63df90017af62425608f7744c8a",
    100: "8c3c81f60b167ea801ec3c73a2402bcd",
    256: "9ad91e04ba97ad73ed454a08a513a0d3",
    512: "cf425ce495ee02ca5db742cf537e8c0d",
}


def _impls():
    """The chain implementations this install has: the Python fallback, and C if built."""
    impls = {"python": keys_mod.chain_keys_python}
    native = keys_mod.chain_keys_native
    if native is not None:
        impls["c"] = lambda data, bt, parent: native(data, 4 * bt, parent)
    return impls


@pytest.mark.parametrize("impl", ["public", "python", "c"])
@pytest.mark.parametrize("block_tokens", sorted(GOLDEN_CHAIN_DIGESTS))
def test_golden_chain_digests(impl, block_tokens):
    fn = chain_keys if impl == "public" else _impls().get(impl)
    if fn is None:
        pytest.skip("kvstore.native._chain is not built")
    keys = fn(GOLDEN_TOKENS, block_tokens, bytes(range(16)))
    assert len(keys) == 4096 // block_tokens
    digest = xxhash.xxh3_128_hexdigest(b"".join(keys))
    assert digest == GOLDEN_CHAIN_DIGESTS[block_tokens]


# -- the chain formula ----------------------------------------------------------
def test_chain_formula(store):
    toks = tokens(4 * B)
    ns = store.namespace(MODEL)
    keys = store.hash_tokens(toks, ns)
    assert len(keys) == 4
    prev = ns.seed
    assert len(prev) == 16
    for i, key in enumerate(keys):
        chunk = le_int32(toks[i * B : (i + 1) * B])
        assert len(chunk) == 4 * B
        expected = xxhash.xxh3_128_digest(prev, seed=xxhash.xxh3_64_intdigest(chunk))
        assert key == expected, f"key {i}"
        assert type(key) is bytes and len(key) == KEY_BYTES
        prev = key


def test_negative_and_extreme_int32_tokens_use_signed_le_bytes(store):
    toks = [-(2**31), 2**31 - 1, -1, 0] * (B // 4)
    ns = store.namespace(MODEL)
    (key,) = store.hash_tokens(toks, ns)
    assert key == xxhash.xxh3_128_digest(ns.seed, seed=xxhash.xxh3_64_intdigest(le_int32(toks)))


def test_string_namespace_equals_explicit_namespace(store):
    toks = tokens(2 * B)
    assert store.hash_tokens(toks, MODEL) == store.hash_tokens(toks, Namespace(MODEL, LAYOUT))
    assert store.hash_tokens(toks, MODEL) == store.hash_tokens(toks, store.namespace(MODEL))


def test_format_key_is_hex(store):
    (key,) = store.hash_tokens(tokens(B), MODEL)
    assert format_key(key) == key.hex()
    assert len(format_key(key)) == 32


# -- namespaces -----------------------------------------------------------------
@pytest.mark.parametrize(
    "extra",
    [
        {"model": "org/model@rev2"},
        {"model": "other/model@rev1"},
        {"tp_rank": 0},
        {"tp_rank": 1},
        {"tp_size": 2},
        {"tp_rank": 0, "tp_size": 2},
        {"adapter": "lora-a"},
        {"salt": "tenant-1"},
    ],
)
def test_namespace_fields_separate_keys(store, extra):
    toks = tokens(3 * B)
    base = store.hash_tokens(toks, Namespace(MODEL, LAYOUT))
    fields = {"model": MODEL, **extra}
    other = store.hash_tokens(toks, Namespace(layout=LAYOUT, **fields))
    assert len(other) == len(base) == 3
    assert set(base).isdisjoint(other)


def test_namespace_field_values_separate_keys(store):
    toks = tokens(B)
    variants = [
        Namespace(MODEL, LAYOUT, tp_rank=0, tp_size=2),
        Namespace(MODEL, LAYOUT, tp_rank=1, tp_size=2),
        Namespace(MODEL, LAYOUT, tp_rank=1, tp_size=4),
        Namespace(MODEL, LAYOUT, adapter="a"),
        Namespace(MODEL, LAYOUT, adapter="b"),
        Namespace(MODEL, LAYOUT, salt="a"),  # same value as the adapter above, other field
        Namespace(MODEL, LAYOUT, salt="b"),
        # length-prefixed fields: moving a character between fields must not collide
        Namespace("ab", LAYOUT, adapter="c"),
        Namespace("a", LAYOUT, adapter="bc"),
    ]
    keys = [store.hash_tokens(toks, ns)[0] for ns in variants]
    assert len(set(keys)) == len(variants)
    assert len({ns.seed for ns in variants}) == len(variants)


@pytest.mark.parametrize(
    "other",
    [
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=B, dtype="fp16"),
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=B, dtype="fp32"),
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=B, dtype="bf16"),
        KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=B, dtype="bf16"),
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=B, dtype="bf16"),
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=B, kv_factor=1),
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=B // 2, dtype="bf16"),
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=2 * B, dtype="bf16"),
    ],
    ids=["fp16", "fp32", "head_dim", "layers", "heads", "kv_factor1", "bt_half", "bt_double"],
)
def test_layout_separates_keys_and_foreign_namespace_is_rejected(store, other):
    toks = tokens(4 * B)
    base = store.hash_tokens(toks, MODEL)
    other_store = make_store(other)
    try:
        other_keys = other_store.hash_tokens(toks, MODEL)
        assert len(other_keys) == len(toks) // other.block_tokens
        assert set(base).isdisjoint(other_keys)
        # A Namespace built for one layout is refused by a store of another.
        with pytest.raises(LayoutMismatchError):
            other_store.hash_tokens(toks, store.namespace(MODEL))
        with pytest.raises(LayoutMismatchError):
            store.hash_tokens(toks, other_store.namespace(MODEL))
        with pytest.raises(LayoutMismatchError):
            store.engine_keys([b"h"], other_store.namespace(MODEL))
    finally:
        other_store.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"model": 5},
        {"model": MODEL, "tp_rank": -1},
        {"model": MODEL, "tp_size": "2"},
        {"model": MODEL, "adapter": 3},
        {"model": MODEL, "salt": b"x"},
    ],
)
def test_bad_namespace_fields_raise(kwargs):
    with pytest.raises(InvalidInputError):
        Namespace(layout=LAYOUT, **kwargs)


def test_namespace_needs_a_layout():
    with pytest.raises(InvalidInputError):
        Namespace(MODEL, layout="not a layout")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, 5, b"model", ["m"]])
def test_bad_namespace_argument_raises(store, bad):
    with pytest.raises(InvalidInputError):
        store.hash_tokens(tokens(B), bad)


# -- partial chunks -------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, B - 1, B, B + 1, 2 * B - 1, 2 * B, 5 * B + 7])
def test_only_full_chunks_get_keys(store, n):
    toks = tokens(n)
    keys = store.hash_tokens(toks, MODEL)
    assert len(keys) == n // B
    assert len(store.hash_tokens(np.asarray(toks, dtype=np.int64), MODEL)) == n // B


def test_partial_tail_does_not_change_full_chunk_keys(store):
    toks = tokens(3 * B)
    keys = store.hash_tokens(toks, MODEL)
    for extra in (1, B // 2, B - 1):
        longer = toks + tokens(extra, start=7)
        assert store.hash_tokens(longer, MODEL) == keys
        assert store.hash_tokens(torch.tensor(longer), MODEL) == keys
    # one more full chunk adds exactly one key
    assert store.hash_tokens(toks + tokens(B, start=7), MODEL)[:3] == keys


@pytest.mark.parametrize("n", [0, 1, B - 1])
def test_fewer_tokens_than_a_chunk_give_no_keys(store, n):
    assert store.hash_tokens(tokens(n), MODEL) == []
    assert store.hash_tokens(np.arange(n, dtype=np.int32), MODEL) == []
    assert store.hash_tokens(torch.arange(n), MODEL) == []


# -- input types ----------------------------------------------------------------
def _as_types(toks: list[int]):
    return {
        "list": list(toks),
        "tuple": tuple(toks),
        "np_int32": np.asarray(toks, dtype=np.int32),
        "np_int64": np.asarray(toks, dtype=np.int64),
        "np_uint16": np.asarray(toks, dtype=np.uint16),
        "np_int32_be": np.asarray(toks, dtype=">i4"),
        "np_strided": np.repeat(np.asarray(toks, dtype=np.int64), 2)[::2],
        "torch_int32": torch.tensor(toks, dtype=torch.int32),
        "torch_int64": torch.tensor(toks, dtype=torch.int64),
        "torch_strided": torch.tensor(toks, dtype=torch.int64).repeat_interleave(2)[::2],
        "np_int_scalars": [np.int64(t) for t in toks],
    }


def test_input_types_give_identical_keys(store):
    toks = tokens(3 * B + 5)  # values < 50_000 fit uint16
    assert max(toks) < 2**16
    expected = store.hash_tokens(toks, MODEL)
    assert len(expected) == 3
    for name, value in _as_types(toks).items():
        assert store.hash_tokens(value, MODEL) == expected, name


def test_range_and_iterables_are_accepted(store):
    toks = list(range(100, 100 + 2 * B))
    expected = store.hash_tokens(toks, MODEL)
    assert store.hash_tokens(range(100, 100 + 2 * B), MODEL) == expected
    assert store.hash_tokens(iter(toks), MODEL) == expected


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(np.arange(2 * B, dtype=np.float32), id="np_float32"),
        pytest.param(np.arange(2 * B, dtype=np.float64), id="np_float64"),
        pytest.param(np.ones(2 * B, dtype=np.bool_), id="np_bool"),
        pytest.param(torch.arange(2 * B, dtype=torch.float32), id="torch_float32"),
        pytest.param(torch.arange(2 * B, dtype=torch.bfloat16), id="torch_bf16"),
        pytest.param(torch.ones(2 * B, dtype=torch.bool), id="torch_bool"),
        pytest.param(torch.ones(2 * B, dtype=torch.complex64), id="torch_complex"),
        pytest.param(np.arange(2 * B).reshape(2, B), id="np_2d"),
        pytest.param(torch.arange(2 * B).reshape(2, B), id="torch_2d"),
        pytest.param(torch.tensor(5), id="torch_0d"),
        pytest.param([[1, 2]] * (2 * B), id="list_2d"),
        pytest.param("a" * (2 * B), id="str"),
        pytest.param(b"a" * (2 * B), id="bytes"),
        pytest.param(bytearray(2 * B), id="bytearray"),
        pytest.param(12345, id="int"),
        pytest.param(None, id="None"),
        pytest.param(np.asarray([object()] * (2 * B)), id="np_object"),
    ],
)
def test_bad_token_containers_raise(store, bad):
    with pytest.raises(InvalidInputError):
        store.hash_tokens(bad, MODEL)


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**40, 2**70, -(2**70)])
def test_tokens_outside_int32_raise(store, value):
    toks = tokens(2 * B)
    toks[3] = value
    with pytest.raises(InvalidInputError):
        store.hash_tokens(toks, MODEL)
    if -(2**63) <= value < 2**63:
        with pytest.raises(InvalidInputError):
            store.hash_tokens(np.asarray(toks, dtype=np.int64), MODEL)
        with pytest.raises(InvalidInputError):
            store.hash_tokens(torch.tensor(toks, dtype=torch.int64), MODEL)


def test_uint32_array_above_int32_raises(store):
    arr = np.full(B, 2**31, dtype=np.uint32)
    with pytest.raises(InvalidInputError):
        store.hash_tokens(arr, MODEL)


@pytest.mark.parametrize(
    "element",
    [
        None,
        "x",
        object(),
        [1],
        1.5,
        2.0,
        "7",
    ],
    ids=["None", "str_x", "object", "nested_list", "float_1.5", "float_2.0", "str_7"],
)
def test_non_int_list_elements_raise(store, element):
    toks: list = tokens(2 * B)
    toks[5] = element
    with pytest.raises(InvalidInputError):
        store.hash_tokens(toks, MODEL)


def test_float_token_never_aliases_an_int_token(store):
    ints = tokens(B)
    ints[0] = 1
    floats: list = list(ints)
    floats[0] = 1.5
    try:
        keys = store.hash_tokens(floats, MODEL)
    except InvalidInputError:
        return
    assert keys != store.hash_tokens(ints, MODEL)


@pytest.mark.parametrize("element", ["x", None, 2**40], ids=["str", "None", "int40"])
def test_bad_value_in_partial_tail_of_list_raises(store, element):
    toks: list = [*tokens(2 * B), element]
    with pytest.raises(InvalidInputError):
        store.hash_tokens(toks, MODEL)


def test_bad_value_in_partial_tail_of_array_raises(store):
    arr = np.asarray([*tokens(2 * B), 2**40], dtype=np.int64)
    with pytest.raises(InvalidInputError):
        store.hash_tokens(arr, MODEL)


# -- parent= ----------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 4])
def test_parent_continues_a_chain(store, k):
    toks = tokens(5 * B + 3)
    whole = store.hash_tokens(toks, MODEL)
    head = store.hash_tokens(toks[: k * B], MODEL)
    tail = store.hash_tokens(toks[k * B :], MODEL, parent=head[-1])
    assert head + tail == whole
    # numpy tail with a bytearray/memoryview parent works the same
    tail_np = store.hash_tokens(np.asarray(toks[k * B :]), MODEL, parent=bytearray(head[-1]))
    assert tail_np == tail
    # without parent, the tail starts a new chain: different keys
    assert set(store.hash_tokens(toks[k * B :], MODEL)).isdisjoint(tail)


@pytest.mark.parametrize("parent", [b"", b"x" * 15, b"x" * 17, "0" * 32, 5])
def test_bad_parent_raises(store, parent):
    with pytest.raises(InvalidInputError):
        store.hash_tokens(tokens(B), MODEL, parent=parent)


# -- prefix property ----------------------------------------------------------------
chunk = st.lists(st.integers(0, 2**31 - 1), min_size=B, max_size=B)


@settings(max_examples=60, deadline=None)
@given(
    common=st.lists(chunk, min_size=0, max_size=4),
    rest_a=st.lists(chunk, min_size=0, max_size=3),
    rest_b=st.lists(chunk, min_size=0, max_size=3),
    tail_a=st.lists(st.integers(0, 1000), max_size=B - 1),
    tail_b=st.lists(st.integers(0, 1000), max_size=B - 1),
)
def test_prefix_property(store, common, rest_a, rest_b, tail_a, tail_b):
    if rest_a and rest_b and rest_a[0] == rest_b[0]:
        rest_b[0] = [t ^ 1 for t in rest_b[0]]
    m = len(common)
    toks_a = [t for c in common + rest_a for t in c] + tail_a
    toks_b = [t for c in common + rest_b for t in c] + tail_b
    keys_a = store.hash_tokens(toks_a, MODEL)
    keys_b = store.hash_tokens(toks_b, MODEL)
    assert len(keys_a) == m + len(rest_a)
    assert len(keys_b) == m + len(rest_b)
    assert keys_a[:m] == keys_b[:m]
    # after the first differing chunk, every key differs (and never reappears)
    assert set(keys_a[m:]).isdisjoint(keys_b[m:])
    assert set(keys_a[m:]).isdisjoint(keys_b[:m])


@settings(max_examples=40, deadline=None)
@given(
    toks=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6 * B),
    split=st.integers(0, 6),
)
def test_parent_split_property(store, toks, split):
    whole = store.hash_tokens(toks, MODEL)
    k = min(split, len(whole))
    if k == 0:
        assert store.hash_tokens(np.asarray(toks, dtype=np.int64), MODEL) == whole
        return
    head = store.hash_tokens(toks[: k * B], MODEL)
    assert head + store.hash_tokens(toks[k * B :], MODEL, parent=head[-1]) == whole


# -- engine keys --------------------------------------------------------------------
ENGINE_HASHES = [b"\x00" * 32, bytearray(b"abc"), memoryview(b"xyz"), "blockhash-1", 0, -1, 2**200]


def test_engine_keys_accept_bytes_str_int_and_are_deterministic(store):
    keys = store.engine_keys(ENGINE_HASHES, MODEL)
    assert len(keys) == len(ENGINE_HASHES)
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)
    assert store.engine_keys(ENGINE_HASHES, MODEL) == keys
    assert engine_keys(ENGINE_HASHES, store.namespace(MODEL)) == keys
    assert engine_keys(iter(ENGINE_HASHES), store.namespace(MODEL)) == keys
    assert store.engine_keys([], MODEL) == []


def test_engine_keys_formula(store):
    ns = store.namespace(MODEL)
    (key,) = store.engine_keys([b"abc"], ns)
    assert key == xxhash.xxh3_128_digest(ns.seed + b"|engine|" + b"b" + b"abc")  # type tag "b"


def test_engine_keys_distinct_ints():
    ns = Namespace(MODEL, LAYOUT)
    values = [0, 1, -1, 255, 256, -256, 2**63, -(2**63)]
    keys = engine_keys(values, ns)
    assert len(set(keys)) == len(values)


@pytest.mark.parametrize(
    "other",
    [
        Namespace("org/model@rev2", LAYOUT),
        Namespace(MODEL, LAYOUT, tp_rank=1),
        Namespace(MODEL, LAYOUT, salt="s"),
        Namespace(MODEL, KVLayout(2, 2, 8, block_tokens=B, dtype="fp16")),
    ],
)
def test_engine_keys_are_namespaced(other):
    base = engine_keys(ENGINE_HASHES, Namespace(MODEL, LAYOUT))
    assert set(base).isdisjoint(engine_keys(ENGINE_HASHES, other))


def test_engine_keys_differ_from_token_keys(store):
    toks = tokens(B)
    (token_key,) = store.hash_tokens(toks, MODEL)
    assert token_key not in store.engine_keys([le_int32(toks), token_key], MODEL)


@pytest.mark.parametrize("bad", [1.5, None, True, [b"x"], object()])
def test_engine_keys_bad_types_raise(store, bad):
    with pytest.raises(InvalidInputError):
        store.engine_keys([b"ok", bad], MODEL)


# -- check_keys ---------------------------------------------------------------------
def test_check_keys_accepts_and_normalises():
    raw = [b"a" * 16, bytearray(b"b" * 16), memoryview(b"c" * 16)]
    out = check_keys(raw)
    assert out == [b"a" * 16, b"b" * 16, b"c" * 16]
    assert all(type(k) is bytes for k in out)
    assert check_keys(iter([b"d" * 16])) == [b"d" * 16]
    assert check_keys(()) == []


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32])
def test_check_keys_rejects_wrong_lengths(length):
    with pytest.raises(InvalidInputError, match=r"keys\[1\]"):
        check_keys([b"k" * 16, b"k" * length])


@pytest.mark.parametrize("bad", ["k" * 16, 16, None, [1] * 16, 1.0])
def test_check_keys_rejects_non_bytes_keys(bad):
    with pytest.raises(InvalidInputError, match=r"keys\[0\]"):
        check_keys([bad])


@pytest.mark.parametrize("bad", [b"k" * 16, bytearray(16), "k" * 16, 5, None])
def test_check_keys_rejects_non_sequences(bad):
    with pytest.raises(InvalidInputError):
        check_keys(bad)


def test_check_keys_names_the_argument():
    with pytest.raises(InvalidInputError, match=r"parent\[0\]"):
        check_keys([b"short"], "parent")


@pytest.mark.parametrize("bad", [[b"short"], ["k" * 16], b"k" * 16])
def test_store_methods_check_keys(store, bad):
    with pytest.raises(InvalidInputError):
        store.lookup(bad)
    with pytest.raises(InvalidInputError):
        store.delete(bad)


# -- the compiled chain and its fallback -------------------------------------------
def reference_chain(data: bytes, block_tokens: int, parent: bytes) -> list[bytes]:
    """The chain as the module docstring writes it, one chunk at a time."""
    step = 4 * block_tokens
    out = []
    for start in range(0, len(data) - step + 1, step):
        parent = xxhash.xxh3_128_digest(
            parent, seed=xxhash.xxh3_64_intdigest(data[start : start + step])
        )
        out.append(parent)
    return out


def _random_case(rng: np.random.Generator) -> tuple[bytes, int, bytes]:
    """Random int32 token bytes (0 to ~24 chunks, sometimes a long prompt), block size, parent."""
    block_tokens = int(rng.integers(1, 513))
    n_tokens = int(rng.integers(0, 24 * block_tokens + block_tokens))
    if rng.random() < 0.1:
        n_tokens = int(rng.integers(16_000, 40_000))  # past the size where C drops the GIL
    data = rng.integers(-(2**31), 2**31, n_tokens, dtype=np.int64).astype("<i4").tobytes()
    parent = rng.bytes(int(rng.choice([16, 16, 16, 0, 1, 15, 17, 32])))
    return data, block_tokens, parent


def test_chain_implementations_match_reference_on_random_inputs():
    rng = np.random.default_rng(1234)
    impls = _impls()
    for case in range(300):
        data, block_tokens, parent = _random_case(rng)
        expected = reference_chain(data, block_tokens, parent)
        assert len(expected) == len(data) // (4 * block_tokens)
        assert chain_keys(data, block_tokens, parent) == expected, case
        assert chain_keys(memoryview(data), block_tokens, parent) == expected, case
        for name, fn in impls.items():
            got = fn(data, block_tokens, parent)
            assert got == expected, (name, case, block_tokens, len(data))
            assert all(type(k) is bytes for k in got)


def test_hash_tokens_matches_reference_for_random_lists_and_arrays():
    rng = np.random.default_rng(99)
    sizes = [1, 2, 3, 7, 16, 64, 255, 256, 512, *(int(x) for x in rng.integers(1, 513, 7))]
    for block_tokens in sizes:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=block_tokens)
        s = make_store(layout)
        try:
            ns = s.namespace(MODEL)
            for _ in range(4):
                n = int(rng.integers(0, 20 * block_tokens + block_tokens))
                arr = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
                parent = rng.bytes(16)
                data = arr.astype("<i4").tobytes()
                assert s.hash_tokens(arr.tolist(), ns) == reference_chain(
                    data, block_tokens, ns.seed
                )
                assert s.hash_tokens(arr, ns) == reference_chain(data, block_tokens, ns.seed)
                expected = reference_chain(data, block_tokens, parent)
                assert s.hash_tokens(arr.tolist(), ns, parent=parent) == expected
                assert s.hash_tokens(torch.from_numpy(arr), ns, parent=parent) == expected
        finally:
            s.close()


def test_compiled_chain_is_built():
    # The install (scripts/setup.sh: pip install -e .) compiles kvstore.native._chain; without it
    # keys are the same but hashing is ~4x slower at 16-token chunks.
    assert keys_mod.CHAIN_IMPL == "c", "kvstore.native._chain is missing: run `pip install -e .`"
    assert keys_mod.chain_keys_native is not None


_FALLBACK_CHILD = """
import sys
sys.modules["kvstore.native._chain"] = None  # as if the extension had not been built
import xxhash
from kvstore import keys
data = bytes.fromhex(sys.argv[1])
print(keys.CHAIN_IMPL)
for bt in (1, 16, 256):
    print(xxhash.xxh3_128_hexdigest(b"".join(keys.chain_keys(data, bt, bytes(range(16))))))
"""


def test_pure_python_fallback_when_extension_is_missing():
    data = GOLDEN_TOKENS
    out = subprocess.run(
        [sys.executable, "-c", _FALLBACK_CHILD, data.hex()],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
        check=True,
    ).stdout.split()
    assert out == ["python", *(GOLDEN_CHAIN_DIGESTS[bt] for bt in (1, 16, 256))]


def test_chain_keys_is_thread_safe():
    # The C loop hashes with the GIL released: threads hashing at once get their own keys.
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    inputs = [rng.integers(0, 2**31, 40_000, dtype=np.int32).tobytes() for _ in range(4)]
    expected = [reference_chain(d, 16, b"p" * 16) for d in inputs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda d: chain_keys(d, 16, b"p" * 16), inputs))
            assert got == expected


@pytest.mark.parametrize("bad", [0, -1, 1.5, None, True])
def test_chain_keys_rejects_bad_block_tokens(bad):
    with pytest.raises(InvalidInputError, match="block_tokens"):
        chain_keys(b"\0" * 64, bad, b"p" * 16)


def test_compiled_chain_rejects_bad_arguments():
    native = keys_mod.chain_keys_native
    if native is None:
        pytest.skip("kvstore.native._chain is not built")
    with pytest.raises(ValueError, match="step"):
        native(b"\0" * 64, 0, b"p" * 16)
    with pytest.raises(TypeError):
        native("text", 4, b"p" * 16)
    with pytest.raises(TypeError):
        native(b"\0" * 64, 4)
    assert native(b"", 4, b"p" * 16) == []


def test_a_tail_key_is_never_a_chunk_key_and_names_its_prefix_and_tokens() -> None:
    """A tail (the first tokens of a chunk, kvstore.connectors.tails) is keyed by the chunk
    before it and its tokens: the same in every process, and distinct from every full
    chunk's key, from another parent's tail and from a tail one token longer or shorter."""
    seed = bytes(16)
    tokens = list(range(1000, 1000 + 3 * 16))
    data = tokens_to_bytes(tokens)
    chunks = chain_keys(data, 16, seed)
    tail = tail_key(chunks[0], tokens_to_bytes(tokens[16:24]))
    assert tail == tail_key(chunks[0], bytes(data)[16 * 4 : 24 * 4])  # bytes or a view
    assert len(tail) == 16 and tail not in chunks
    assert tail != tail_key(chunks[1], tokens_to_bytes(tokens[16:24]))
    assert tail != tail_key(chunks[0], tokens_to_bytes(tokens[16:23]))
    assert tail != tail_key(chunks[0], tokens_to_bytes(tokens[16:25]))
    assert tail.hex() == tail_key(chunks[0], tokens_to_bytes(tokens[16:24])).hex()
