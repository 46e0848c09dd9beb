"""Loans (zero-copy reads) and two-step whole-block puts (KVStore.engine.lend, .begin_put)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore import KVStore
from kvstore.errors import InvalidInputError
from kvstore.layout import KVLayout
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import host_config, random_blocks


def chunks(layout: KVLayout, n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(layout, n, seed)
    step = layout.block_tokens
    return [kv[:, :, i * step : (i + 1) * step] for i in range(n)]


def test_a_loan_lends_host_memory_and_pins_it(store: KVStore, layout: KVLayout) -> None:
    keys, data = make_keys(3), chunks(layout, 3, seed=1)
    store.put(keys[:2], torch.cat(data[:2], dim=2))
    with store.engine.lend(keys) as loan:
        assert loan.found == [True, True, False]
        assert loan.views[2] is None
        assert all(torch.equal(v, d) for v, d in zip(loan.views[:2], data, strict=False))
        assert store.engine.datapath.pinned_blocks() == 2
        evicter = threading.Thread(target=store.delete, args=(keys[:1],))
        evicter.start()
        evicter.join(timeout=0.2)
        assert evicter.is_alive()  # a delete waits for the loan
    evicter.join(timeout=5)
    assert not evicter.is_alive() and not store.engine.datapath.contains(keys[0])
    assert store.engine.datapath.pinned_blocks() == 0


def test_a_loan_reads_blocks_only_slow_tiers_hold(layout: KVLayout, tmp_path: object) -> None:
    config = {
        "tiers": [
            {"kind": "host", "capacity": 4 * layout.block_nbytes},
            {"kind": "disk", "path": str(tmp_path), "capacity": "16MiB"},
        ]
    }
    with KVStore(layout, config) as store:
        keys, data = make_keys(2), chunks(layout, 2, seed=2)
        store.put(keys, torch.cat(data, dim=2))
        store.flush()
        store.evict(2)
        with store.engine.lend(keys) as loan:
            assert loan.found == [True, True] and loan.views == [None, None]
            out = torch.zeros(layout.block_shape, dtype=layout.dtype)
            assert loan.read_into(1, out[1:], (1, layout.num_layers))
            assert torch.equal(out[1:], data[1][1:])


def test_a_loan_ends_with_its_lease(layout: KVLayout) -> None:
    now = [0.0]
    with KVStore(layout, host_config(layout, 4), clock=lambda: now[0]) as store:
        store.put(make_keys(1), chunks(layout, 1, seed=3)[0])
        loan = store.engine.lend(make_keys(1), lease_s=5)
        assert store.engine.datapath.pinned_blocks() == 1
        now[0] = 6.0  # the client that held it died
        assert store.engine.datapath.pinned_blocks() == 0
        loan.release()  # late and harmless
    with pytest.raises(InvalidInputError):
        KVStore(layout, host_config(layout, 1)).engine.lend(make_keys(1), lease_s=0)


def test_begin_put_fills_in_place_and_commits(store: KVStore, layout: KVLayout) -> None:
    keys, data = make_keys(4), chunks(layout, 4, seed=4)
    store.put(keys[:1], data[0])
    with store.engine.begin_put([*keys, keys[1]]) as put:
        assert [v is not None for v in put.views] == [False, True, True, True, False]
        for view, block in zip(put.views[1:4], data[1:4], strict=True):
            assert view is not None
            view.copy_(block)
        assert store.lookup(keys) == 1  # nothing visible before the commit
        assert put.commit([False, True, False, True, False]) == 2
    assert [store.engine.datapath.contains(k) for k in keys] == [True, True, False, True]
    assert torch.equal(store.get(keys[3:]), data[3])
    assert store.engine.datapath.pinned_blocks() == 0
    assert put.commit() == 0  # once only


def test_an_aborted_put_gives_its_room_back(layout: KVLayout) -> None:
    with KVStore(layout, host_config(layout, 2)) as store:
        for _ in range(3):
            with store.engine.begin_put(make_keys(2)) as put:
                assert all(v is not None for v in put.views)
        assert store.put(make_keys(2, salt=1), torch.cat(chunks(layout, 2, 5), dim=2)) == 2


def test_persist_writes_memory_only_blocks_to_disk(layout: KVLayout, tmp_path: object) -> None:
    config = {
        "tiers": [
            {"kind": "host", "capacity": 4 * layout.block_nbytes},
            {"kind": "disk", "path": str(tmp_path), "capacity": "16MiB"},
        ]
    }
    with KVStore(layout, config) as store:
        keys = make_keys(2)
        store.put(keys, torch.cat(chunks(layout, 2, 6), dim=2))
        assert store.engine.datapath.persist([*keys, make_keys(1, salt=9)[0]]) == [
            True,
            True,
            False,
        ]
        assert store.engine.datapath.where(keys[0]) == [0, 1]
    with KVStore(layout, host_config(layout, 2)) as memory_only:
        memory_only.put(keys[:1], chunks(layout, 1, 7)[0])
        assert memory_only.engine.datapath.persist(keys[:1]) == [False]  # nowhere to persist to
