"""KVStore public API: the contract, bad input (clear error, store unchanged), lifecycle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvstore import (
    BlockNotFoundError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    KVLayout,
    KVStore,
    KVStoreError,
    LayoutMismatchError,
    StoreConfig,
)
from kvstore.testing.data import host_config, random_blocks, small_layout
from kvstore.testing.faults import FaultyTier
from kvstore.tiers.host import HostTier


@pytest.fixture
def filled(store: KVStore, layout: KVLayout) -> Iterator[tuple[KVStore, list[bytes], torch.Tensor]]:
    tokens = np.arange(layout.block_tokens * 5 + 3, dtype=np.int32)
    keys = store.hash_tokens(tokens, "model@1")
    kv = random_blocks(layout, len(keys), seed=11)
    assert store.put(keys, kv) == len(keys)
    yield store, keys, kv


def state(store: KVStore, keys: list[bytes]) -> tuple[Any, ...]:
    """What must not change when an operation is rejected."""
    stats = store.stats()
    contents = store.get(keys) if store.lookup(keys) == len(keys) else None
    return (
        len(store.engine.datapath),
        [store.engine.datapath.contains(k) for k in keys],
        [t["blocks"] for t in stats["tiers"]],
        stats["blocks_stored"],
        None if contents is None else contents.clone(),
    )


def same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        a[:4] == b[:4]
        and (a[4] is None) == (b[4] is None)
        and (a[4] is None or torch.equal(a[4], b[4]))
    )


def test_readme_contract(layout: KVLayout) -> None:
    store = KVStore(layout, StoreConfig.from_dict(host_config(layout, 32)))
    token_ids = list(range(1000, 1000 + layout.block_tokens * 6 + 5))
    keys = store.hash_tokens(token_ids, namespace="llama-3-8b@rev")
    assert len(keys) == 6
    assert store.lookup(keys) == 0
    kv = random_blocks(layout, len(keys))
    assert kv.shape == layout.tensor_shape(len(keys))
    store.put(keys[:4], kv[:, :, : 4 * layout.block_tokens])
    n = store.lookup(keys)
    assert n == 4
    out = store.get(keys[:n])
    assert out.shape == layout.tensor_shape(n)
    assert torch.equal(out, kv[:, :, : n * layout.block_tokens])
    buf = torch.empty(layout.tensor_shape(n), dtype=layout.dtype)
    assert store.get(keys[:n], out=buf) is buf and torch.equal(buf, out)
    assert store.lookup(keys[:1]) == 1 and store.lookup(keys[5:6]) == 0
    assert store.delete(keys[:2]) == 2
    assert store.lookup(keys) == 0
    assert store.stats()["blocks"] == 2
    store.close()
    with pytest.raises(ClosedError):
        store.lookup(keys)


def test_embedded_default_config(layout: KVLayout) -> None:
    kv = random_blocks(layout, 2)
    with KVStore(layout) as store:
        assert [t.kind for t in store.config.tiers] == ["host", "disk"]
        keys = store.hash_tokens(range(layout.block_tokens * 2), "m")
        store.put(keys, kv)
        assert store.lookup(keys) == 2
        assert [store.engine.datapath.where(k) for k in keys] == [[0], [0]]  # in host memory
    # close() flushed to disk: a new process (here: a new store) finds the blocks.
    with KVStore(layout) as again:
        assert again.lookup(keys) == 2
        assert [again.engine.datapath.where(k) for k in keys] == [[1], [1]]
        assert torch.equal(again.get(keys), kv)


def test_put_is_idempotent_and_counts_stored(
    filled: tuple[KVStore, list[bytes], torch.Tensor],
) -> None:
    store, keys, kv = filled
    assert store.put(keys, kv) == len(keys)
    assert store.stats()["blocks_already_present"] == len(keys)
    assert store.stats()["blocks_stored"] == len(keys)


def test_get_prefix_loads_what_is_there(
    filled: tuple[KVStore, list[bytes], torch.Tensor], layout: KVLayout
) -> None:
    store, keys, kv = filled
    store.delete(keys[3:4])
    out = torch.zeros_like(kv)
    assert store.get_prefix(keys, out) == 3
    t = 3 * layout.block_tokens
    assert torch.equal(out[:, :, :t], kv[:, :, :t])
    with pytest.raises(BlockNotFoundError, match="block 3"):
        store.get(keys)


def test_get_into_a_strided_view(
    filled: tuple[KVStore, list[bytes], torch.Tensor], layout: KVLayout
) -> None:
    store, keys, kv = filled
    big = torch.zeros((layout.num_layers, 2, 10 * layout.block_tokens, 2, 16), dtype=layout.dtype)
    window = big[:, :, layout.block_tokens : layout.block_tokens * 6]
    store.get(keys, out=window)
    assert torch.equal(window, kv)


def test_evict_and_stats(filled: tuple[KVStore, list[bytes], torch.Tensor]) -> None:
    store, keys, _ = filled
    evicted = store.evict(2)
    assert len(evicted) == 2
    stats = store.stats()
    assert stats["blocks"] == len(keys) - 2
    assert stats["tiers"][0]["evictions"] == 2
    with pytest.raises(InvalidInputError):
        store.evict(1, tier=5)


# -- bad input: a clear KVStoreError subclass, and the store unchanged -------
BAD_PUTS = [
    ("wrong shape", lambda L, kv: kv[:, :, :-1], LayoutMismatchError),
    ("wrong rank", lambda L, kv: kv[0], InvalidInputError),
    ("wrong dtype", lambda L, kv: kv.to(torch.float16), LayoutMismatchError),
    (
        "wrong device",
        lambda L, kv: torch.empty(kv.shape, dtype=kv.dtype, device="meta"),
        InvalidInputError,
    ),
    (
        "not a tensor",
        lambda L, kv: kv.numpy() if kv.dtype != torch.bfloat16 else [1, 2],
        InvalidInputError,
    ),
    ("too few blocks", lambda L, kv: kv[:, :, : L.block_tokens], LayoutMismatchError),
]


@pytest.mark.parametrize(("what", "make_bad", "error"), BAD_PUTS, ids=[b[0] for b in BAD_PUTS])
def test_bad_put_changes_nothing(
    filled: tuple[KVStore, list[bytes], torch.Tensor],
    layout: KVLayout,
    what: str,
    make_bad: Any,
    error: type[KVStoreError],
) -> None:
    store, keys, _ = filled
    new_keys = store.hash_tokens(np.arange(10_000, 10_000 + 5 * layout.block_tokens), "other")
    before = state(store, keys)
    with pytest.raises(error):
        store.put(new_keys, make_bad(layout, random_blocks(layout, 5, seed=3)))
    assert same_state(before, state(store, keys))
    assert store.lookup(new_keys) == 0


def test_key_count_mismatch_changes_nothing(
    filled: tuple[KVStore, list[bytes], torch.Tensor], layout: KVLayout
) -> None:
    store, keys, _ = filled
    before = state(store, keys)
    new_keys = store.hash_tokens(np.arange(50_000, 50_000 + 3 * layout.block_tokens), "m")
    with pytest.raises(LayoutMismatchError, match="expected"):
        store.put(new_keys[:2], random_blocks(layout, 3))
    assert same_state(before, state(store, keys))


@pytest.mark.parametrize(
    "bad_keys",
    [[b"short"], ["a" * 16], [None], b"0123456789abcdef", 7],
    ids=["short key", "str key", "None key", "bare bytes", "int"],
)
def test_bad_keys_change_nothing(
    filled: tuple[KVStore, list[bytes], torch.Tensor], bad_keys: Any
) -> None:
    store, keys, _ = filled
    before = state(store, keys)
    for op in (store.lookup, store.delete, lambda k: store.get(k)):
        with pytest.raises(InvalidInputError):
            op(bad_keys)
    assert same_state(before, state(store, keys))


def test_bad_out_changes_nothing(
    filled: tuple[KVStore, list[bytes], torch.Tensor], layout: KVLayout
) -> None:
    store, keys, _ = filled
    before = state(store, keys)
    with pytest.raises(LayoutMismatchError):
        store.get(keys, out=torch.empty(layout.tensor_shape(len(keys) - 1), dtype=layout.dtype))
    with pytest.raises(LayoutMismatchError):
        store.get(keys, out=torch.empty(layout.tensor_shape(len(keys)), dtype=torch.float32))
    with pytest.raises(InvalidInputError):
        store.get_prefix(
            keys, out=torch.empty(layout.tensor_shape(len(keys)), dtype=layout.dtype, device="meta")
        )
    assert same_state(before, state(store, keys))


def test_namespace_of_another_layout_is_rejected(store: KVStore) -> None:
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_tokens=8)
    ns = store.namespace("m").__class__(model="m", layout=other)
    with pytest.raises(LayoutMismatchError):
        store.hash_tokens(range(64), ns)


def test_tiers_of_another_layout_are_rejected(layout: KVLayout) -> None:
    other = small_layout(head_dim=32)
    tier = HostTier(StoreConfig.from_dict(host_config(other, 2)).tiers[0], other)
    with pytest.raises(LayoutMismatchError):
        KVStore(layout, tiers=[tier])


@pytest.mark.parametrize(
    "config",
    [
        {"tiers": [{"kind": "host", "capacity": "1GiB", "colour": "blue"}]},
        {"tierz": []},
        {"tiers": [{"kind": "tape"}]},
        {"tiers": [{"kind": "host", "capacity": "-1"}]},
        {"tiers": [{"kind": "host", "capacity": "1GiB", "low_watermark": 0.95}]},
    ],
    ids=["unknown tier key", "unknown top key", "unknown kind", "bad size", "low above high"],
)
def test_bad_config_is_a_clear_error(layout: KVLayout, config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        KVStore(layout, config)
    message = str(info.value)
    assert any(word in message for word in ("colour", "tierz", "tape", "capacity", "low_watermark"))


def test_injected_tiers_and_closed_context(layout: KVLayout) -> None:
    faulty = FaultyTier(HostTier(StoreConfig.from_dict(host_config(layout, 4)).tiers[0], layout))
    store = KVStore(layout, tiers=[faulty])
    keys = store.hash_tokens(range(layout.block_tokens * 2), "m")
    store.put(keys, random_blocks(layout, 2))
    faulty.down = True
    assert store.get(keys).shape == layout.tensor_shape(0)  # a dead tier is a miss, not a crash
    with pytest.raises(BlockNotFoundError):
        store.get(keys, out=torch.empty(layout.tensor_shape(2), dtype=layout.dtype))
    assert store.get_prefix(keys, torch.empty(layout.tensor_shape(2), dtype=layout.dtype)) == 0
    store.close()
    with pytest.raises(ClosedError), store:
        pass


def test_errors_are_one_family() -> None:
    import kvstore.errors as errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.KVStoreError)
